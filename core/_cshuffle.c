/* Byte-shuffle kernels for ckpt_core.codecs.shuffle, loaded through ctypes (no Python API here,
 * so ctypes releases the GIL around each call).
 *
 * Built by setup.py as the optional extension ckpt_core._cshuffle. When it is missing (no C
 * compiler at install time) or a call returns 0 (an element size or CPU it has no vector kernel
 * for), the numpy code in shuffle.py does the same work, byte for byte.
 *
 * Plane layout: planes[k][i] is byte k of element i, for i < n.
 */
#include <stddef.h>
#include <stdint.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* Version of this interface; shuffle.py refuses a library with another one. */
int checkrun_cshuffle_abi(void) { return 1; }

#define BLOCK8 2048 /* 8-byte elements per block of the 8-byte kernels (16 KiB of stack) */

/* planes[k][i] = src[i * itemsize + k]. Returns 1 when done, 0 when not handled. */
int checkrun_shuffle(const uint8_t *src, size_t itemsize, size_t n, uint8_t *const *planes) {
    size_t i = 0, k;
#ifdef __SSE2__
    if (itemsize == 4) {
        uint8_t *p0 = planes[0], *p1 = planes[1], *p2 = planes[2], *p3 = planes[3];
        for (; i + 16 <= n; i += 16) {
            const uint8_t *s = src + i * 4;
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(s + 48));
            /* Three rounds of byte unpacking sort the 64 bytes by byte index within pairs of
             * vectors; the 64-bit unpacks then gather each plane's 16 bytes. */
            __m128i t0 = _mm_unpacklo_epi8(a, b), t1 = _mm_unpackhi_epi8(a, b);
            __m128i t2 = _mm_unpacklo_epi8(c, d), t3 = _mm_unpackhi_epi8(c, d);
            a = _mm_unpacklo_epi8(t0, t1); b = _mm_unpackhi_epi8(t0, t1);
            c = _mm_unpacklo_epi8(t2, t3); d = _mm_unpackhi_epi8(t2, t3);
            t0 = _mm_unpacklo_epi8(a, b); t1 = _mm_unpackhi_epi8(a, b);
            t2 = _mm_unpacklo_epi8(c, d); t3 = _mm_unpackhi_epi8(c, d);
            _mm_storeu_si128((__m128i *)(p0 + i), _mm_unpacklo_epi64(t0, t2));
            _mm_storeu_si128((__m128i *)(p1 + i), _mm_unpackhi_epi64(t0, t2));
            _mm_storeu_si128((__m128i *)(p2 + i), _mm_unpacklo_epi64(t1, t3));
            _mm_storeu_si128((__m128i *)(p3 + i), _mm_unpackhi_epi64(t1, t3));
        }
    } else if (itemsize == 2) {
        const __m128i low = _mm_set1_epi16(0x00FF);
        for (; i + 16 <= n; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + 2 * i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 2 * i + 16));
            _mm_storeu_si128((__m128i *)(planes[0] + i),
                             _mm_packus_epi16(_mm_and_si128(a, low), _mm_and_si128(b, low)));
            _mm_storeu_si128((__m128i *)(planes[1] + i),
                             _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
        }
    } else if (itemsize == 8) {
        /* As 4-byte elements (2 per element) into 4 planes of byte pairs (byte k, byte k + 4), then
         * each pair plane as 2-byte elements into planes k and k + 4: the two kernels above, on
         * cache-sized blocks. */
        uint8_t tmp[4][2 * BLOCK8];
        for (; i < n; i += BLOCK8) {
            size_t m = n - i < BLOCK8 ? n - i : BLOCK8;
            uint8_t *const quads[4] = {tmp[0], tmp[1], tmp[2], tmp[3]};
            checkrun_shuffle(src + 8 * i, 4, 2 * m, quads);
            for (k = 0; k < 4; k++) {
                uint8_t *const pair[2] = {planes[k] + i, planes[k + 4] + i};
                checkrun_shuffle(tmp[k], 2, m, pair);
            }
        }
        return 1;
    } else {
        return 0;
    }
    for (; i < n; i++)
        for (k = 0; k < itemsize; k++) planes[k][i] = src[i * itemsize + k];
    return 1;
#else
    (void)src; (void)itemsize; (void)n; (void)planes; (void)i; (void)k;
    return 0;
#endif
}

/* out[i * itemsize + k] = planes[k][i]. Returns 1 when done, 0 when not handled. */
int checkrun_unshuffle(const uint8_t *const *planes, size_t itemsize, size_t n, uint8_t *out) {
    size_t i = 0, k;
#ifdef __SSE2__
    if (itemsize == 4) {
        const uint8_t *p0 = planes[0], *p1 = planes[1], *p2 = planes[2], *p3 = planes[3];
        for (; i + 16 <= n; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(p0 + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(p1 + i));
            __m128i c = _mm_loadu_si128((const __m128i *)(p2 + i));
            __m128i d = _mm_loadu_si128((const __m128i *)(p3 + i));
            __m128i ab0 = _mm_unpacklo_epi8(a, b), ab1 = _mm_unpackhi_epi8(a, b);
            __m128i cd0 = _mm_unpacklo_epi8(c, d), cd1 = _mm_unpackhi_epi8(c, d);
            uint8_t *o = out + i * 4;
            _mm_storeu_si128((__m128i *)o, _mm_unpacklo_epi16(ab0, cd0));
            _mm_storeu_si128((__m128i *)(o + 16), _mm_unpackhi_epi16(ab0, cd0));
            _mm_storeu_si128((__m128i *)(o + 32), _mm_unpacklo_epi16(ab1, cd1));
            _mm_storeu_si128((__m128i *)(o + 48), _mm_unpackhi_epi16(ab1, cd1));
        }
    } else if (itemsize == 2) {
        for (; i + 16 <= n; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(planes[0] + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(planes[1] + i));
            _mm_storeu_si128((__m128i *)(out + 2 * i), _mm_unpacklo_epi8(a, b));
            _mm_storeu_si128((__m128i *)(out + 2 * i + 16), _mm_unpackhi_epi8(a, b));
        }
    } else if (itemsize == 8) { /* checkrun_shuffle's two steps, reversed */
        uint8_t tmp[4][2 * BLOCK8];
        for (; i < n; i += BLOCK8) {
            size_t m = n - i < BLOCK8 ? n - i : BLOCK8;
            const uint8_t *const quads[4] = {tmp[0], tmp[1], tmp[2], tmp[3]};
            for (k = 0; k < 4; k++) {
                const uint8_t *const pair[2] = {planes[k] + i, planes[k + 4] + i};
                checkrun_unshuffle(pair, 2, m, tmp[k]);
            }
            checkrun_unshuffle(quads, 4, 2 * m, out + 8 * i);
        }
        return 1;
    } else {
        return 0;
    }
    for (; i < n; i++)
        for (k = 0; k < itemsize; k++) out[i * itemsize + k] = planes[k][i];
    return 1;
#else
    (void)planes; (void)itemsize; (void)n; (void)out; (void)i; (void)k;
    return 0;
#endif
}

/* Several shuffles in one call (one GIL release from ctypes instead of one per buffer: a
 * background encoder that takes the GIL back after each call makes the training thread wait
 * for it). Job j shuffles srcs[j] (itemsizes[j]-byte elements, ns[j] of them) into the next
 * itemsizes[j] pointers of planes. Returns 1 when all were done, 0 when one was not handled
 * (the jobs before it are done; the caller redoes them all its own way). */
int checkrun_shuffle_many(size_t jobs, const uint8_t *const *srcs, const size_t *itemsizes, const size_t *ns,
                          uint8_t *const *planes) {
    size_t j;
    for (j = 0; j < jobs; j++) {
        if (!checkrun_shuffle(srcs[j], itemsizes[j], ns[j], planes))
            return 0;
        planes += itemsizes[j];
    }
    return 1;
}
