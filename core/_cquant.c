/* Row-wise quantization kernels for ckpt_core.codecs.rowwise (codes and errors with the stored
 * parameters, and the greedy range search), loaded through ctypes (no Python API here, so ctypes
 * releases the GIL around each call).
 *
 * Built by setup.py as the optional extension ckpt_core._cquant. When it is missing (no C
 * compiler at install time) rowwise.py does the same work in numpy. Both do the same float32
 * operations per element in the same order, so codes are identical, and the search adds its
 * squared errors in the order of numpy's search over many short rows; elsewhere (numpy's search
 * over few or long rows sums in other orders) the two can pick different ranges only where two
 * candidates tie to float32 rounding (rowwise.py: "Native kernels").
 *
 * Build with -ffp-contract=off: a fused multiply-add would round differently from numpy.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* Version of this interface; rowwise.py refuses a library with another one. */
int checkrun_cquant_abi(void) { return 1; }

/* x + 1.5 * 2**23 - 1.5 * 2**23 rounds |x| < 2**22 to the nearest integer, ties to even, like
 * numpy's rint, in plain float arithmetic the compiler can vectorise (codes are at most 255). */
#define ROUNDER 12582912.0f
/* Rows searched together, one per vector lane (16 fill an AVX-512 register, two AVX2 ones). */
#define W 16
/* Elements the quantize kernel sums in float32 before adding the sums into doubles. */
#define FLUSH 1024

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* Versions for AVX-512, AVX2 and the baseline (SSE2), chosen at load time by the CPU. */
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif
#ifdef __GNUC__
/* Inlined into each clone of the caller, so they compile for its instruction set. */
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

/* Squared grid errors, per lane, of t = u * a - b0 and t = u * a - b1 against the nearest code
 * in [0, q]; ut holds `cols` groups of W lanes (element j of lane l at ut[j * W + l]). Each lane
 * adds its squares in float32 in element order: what numpy's einsum does in rowwise._direct_loss
 * (transposed rows), so both searches compare the same numbers. */
INLINE void block_loss(const float *ut, size_t cols, float a, const float *b0, const float *b1, float q,
                       float *e0, float *e1) {
    float s0[W] = {0}, s1[W] = {0};
    for (size_t j = 0; j < cols; j++) {
        const float *v = ut + j * W;
        for (int l = 0; l < W; l++) {
            float p = v[l] * a;
            float t0 = p - b0[l], t1 = p - b1[l];
            float c0 = t0 > 0.0f ? t0 : 0.0f, c1 = t1 > 0.0f ? t1 : 0.0f;
            c0 = c0 < q ? c0 : q;
            c1 = c1 < q ? c1 : q;
            t0 -= (c0 + ROUNDER) - ROUNDER;
            t1 -= (c1 + ROUNDER) - ROUNDER;
            s0[l] += t0 * t0;
            s1[l] += t1 * t1;
        }
    }
    for (int l = 0; l < W; l++) {
        e0[l] = s0[l];
        e1[l] = s1[l];
    }
}

/* The greedy path of W rows at once in step units (see rowwise.greedy_range): per lane, steps
 * taken at the min end and steps in all of the best range seen, the start range included.
 * Losses are float32 (sum * spacing**2, as numpy computes them), compared in float32. */
INLINE void search_block(const float *ut, size_t cols, int q, int bins, int steps, double *best_lo,
                         double *best_k) {
    double moved[W] = {0}, spacing = (double)bins / q;
    float best[W], e0[W], e1[W], b0[W], b1[W], a = (float)(1.0 / spacing), sq = (float)(spacing * spacing);
    for (int l = 0; l < W; l++) {
        b0[l] = b1[l] = 0.0f;
        best_lo[l] = best_k[l] = 0.0;
    }
    block_loss(ut, cols, a, b0, b1, (float)q, e0, e1);
    for (int l = 0; l < W; l++) best[l] = e0[l] * sq;
    for (int k = 1; k <= steps; k++) {
        spacing = (double)(bins - k) / q;
        a = (float)(1.0 / spacing);
        sq = (float)(spacing * spacing);
        for (int l = 0; l < W; l++) {
            b0[l] = (float)((moved[l] + 1.0) * a);
            b1[l] = (float)(moved[l] * a);
        }
        block_loss(ut, cols, a, b0, b1, (float)q, e0, e1);
        for (int l = 0; l < W; l++) {
            float x0 = e0[l] * sq, x1 = e1[l] * sq;
            if (x0 < x1) moved[l] += 1.0;  /* ties move the max end, as FBGEMM does */
            float cur = x0 < x1 ? x0 : x1;
            if (cur < best[l]) {
                best[l] = cur;
                best_lo[l] = moved[l];
                best_k[l] = k;
            }
        }
    }
}

CLONES static void search_rows(const float *x, size_t rows, size_t cols, size_t stride, const float *lo,
                               const float *inv, int q, int bins, int steps, double *best_lo, double *best_k,
                               float *ut) {
    double bl[W], bk[W];
    for (size_t r0 = 0; r0 < rows; r0 += W) {
        size_t nr = rows - r0 < W ? rows - r0 : W;
        for (size_t l = 0; l < W; l++) {  /* transpose: lanes beyond the last row search zeros */
            const float *xr = x + (r0 + l) * stride;
            for (size_t j = 0; j < cols; j++) ut[j * W + l] = l < nr ? (xr[j] - lo[r0 + l]) * inv[r0 + l] : 0.0f;
        }
        search_block(ut, cols, q, bins, steps, bl, bk);
        for (size_t l = 0; l < nr; l++) {
            best_lo[r0 + l] = bl[l];
            best_k[r0 + l] = bk[l];
        }
    }
}

/* Greedy search over `rows` rows of `cols` float32 values, row r at x + r * stride (elements),
 * in step units u = (x - lo[r]) * inv[r]. Writes best_lo[r], best_k[r]. Returns 1 when done,
 * 0 when out of memory (the caller then runs the numpy search). */
int checkrun_greedy_search(const float *x, size_t rows, size_t cols, size_t stride, const float *lo,
                           const float *inv, int q, int bins, int steps, double *best_lo, double *best_k) {
    float *ut = malloc((cols ? cols : 1) * W * sizeof(float));
    if (ut == NULL) return 0;
    search_rows(x, rows, cols, stride, lo, inv, q, bins, steps, best_lo, best_k, ut);
    free(ut);
    return 1;
}

/* Quantize `rows` rows of `cols` float32 values (row r at x + r * stride elements) with the stored
 * per-row minimum m[r] and step s[r] (as float32) and inv[r] = 1 / s[r] (0 for step 0):
 * codes[r * cols + j] = rint(clip((x - m) * inv, 0, q)) like rowwise._float_codes, with the decoded
 * value c * s + m (rowwise._recon) giving per row the squared error sq_err[r], the largest
 * absolute error max_err[r] and the sum of squares of the values sq_ref[r]. */
CLONES static void quantize(const float *x, size_t rows, size_t cols, size_t stride, const float *m,
                            const float *s, const float *invs, float q, uint8_t *codes, double *sq_err, float *max_err,
                            double *sq_ref) {
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        uint8_t *cr = codes + r * cols;
        float mr = m[r], sr = s[r], inv = invs[r], mx[W] = {0};
        double e = 0.0, f = 0.0;
        for (size_t j0 = 0; j0 < cols; j0 += FLUSH) {
            size_t end = j0 + FLUSH < cols ? j0 + FLUSH : cols, j = j0;
            float se[W] = {0}, sf[W] = {0};
            for (; j + W <= end; j += W) {
                for (int l = 0; l < W; l++) {
                    float v = xr[j + l], t = (v - mr) * inv;
                    t = t > 0.0f ? t : 0.0f;
                    t = t < q ? t : q;
                    t = (t + ROUNDER) - ROUNDER;
                    cr[j + l] = (uint8_t)t;
                    float d = t * sr;
                    d = (d + mr) - v;
                    float a = d > 0.0f ? d : -d;
                    mx[l] = a > mx[l] ? a : mx[l];
                    se[l] += d * d;
                    sf[l] += v * v;
                }
            }
            for (; j < end; j++) {  /* the last few elements of the row */
                float v = xr[j], t = (v - mr) * inv;
                t = t > 0.0f ? t : 0.0f;
                t = t < q ? t : q;
                t = (t + ROUNDER) - ROUNDER;
                cr[j] = (uint8_t)t;
                float d = t * sr;
                d = (d + mr) - v;
                float a = d > 0.0f ? d : -d;
                mx[0] = a > mx[0] ? a : mx[0];
                se[0] += d * d;
                sf[0] += v * v;
            }
            for (int l = 0; l < W; l++) {
                e += se[l];
                f += sf[l];
            }
        }
        float top = 0.0f;
        for (int l = 0; l < W; l++) top = mx[l] > top ? mx[l] : top;
        sq_err[r] = e;
        max_err[r] = top;
        sq_ref[r] = f;
    }
}

int checkrun_quantize_rows(const float *x, size_t rows, size_t cols, size_t stride, const float *m,
                           const float *s, const float *inv, int q, uint8_t *codes, double *sq_err,
                           float *max_err, double *sq_ref) {
    quantize(x, rows, cols, stride, m, s, inv, (float)q, codes, sq_err, max_err, sq_ref);
    return 1;
}

/* Per-row minimum and maximum of `rows` rows of `cols` float32 values (row r at x + r * stride
 * elements); both are NaN for a row holding inf or nan (min/max in numpy propagate nan, and an
 * inf must not pass as a range: rowwise.py refuses both). */
CLONES static void minmax(const float *x, size_t rows, size_t cols, size_t stride, float *lo, float *hi) {
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        float mn[W], mx[W], z[W] = {0};
        size_t j = 0;
        for (int l = 0; l < W; l++) mn[l] = mx[l] = xr[0];
        for (; j + W <= cols; j += W) {
            for (int l = 0; l < W; l++) {
                float v = xr[j + l];
                mn[l] = v < mn[l] ? v : mn[l];
                mx[l] = v > mx[l] ? v : mx[l];
                z[l] += v - v;  /* 0 for finite values, nan for inf and nan */
            }
        }
        for (; j < cols; j++) {
            float v = xr[j];
            mn[0] = v < mn[0] ? v : mn[0];
            mx[0] = v > mx[0] ? v : mx[0];
            z[0] += v - v;
        }
        float a = mn[0], b = mx[0], bad = 0.0f;
        for (int l = 0; l < W; l++) {
            a = mn[l] < a ? mn[l] : a;
            b = mx[l] > b ? mx[l] : b;
            bad += z[l];
        }
        if (!(bad == 0.0f)) a = b = bad;
        lo[r] = a;
        hi[r] = b;
    }
}

/* `cols` must be at least 1. */
int checkrun_row_minmax(const float *x, size_t rows, size_t cols, size_t stride, float *lo, float *hi) {
    minmax(x, rows, cols, stride, lo, hi);
    return 1;
}
