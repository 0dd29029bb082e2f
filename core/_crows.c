/* Row change detection for ckpt_core.saving.streams (incremental saves), the row scatter of
 * ckpt_core.loading.decode (delta links applied on restore) and the folding of equal adjacent
 * rows for ckpt_core.steplog.capture (a pooled embedding's sparse gradient), loaded through ctypes (no
 * Python API here, so ctypes releases the GIL around each call and the copier's helper thread can
 * run the other half of a table at the same time).
 *
 * Built by setup.py as the optional extension ckpt_core._crows. When it is missing (no C compiler
 * at install time) streams.py does the same work in numpy: the same rows, in the same order.
 *
 * The comparison is bytewise (memcmp), so it is exact for every dtype: -0.0 and 0.0 differ, NaNs
 * with different payloads differ, equal bytes never count as a change.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Version of this interface; streams.py refuses a library with another one. */
int checkrun_crows_abi(void) { return 3; }

/* For each of ``rows`` rows of ``row_bytes`` bytes (both buffers contiguous): if src's row differs
 * from dst's, copy it into dst and append ``first + row`` to ``out`` (room for ``rows`` entries).
 * One pass: a row is compared and copied while both are in cache. Returns the number of rows
 * written to ``out``, in ascending order. */
int64_t checkrun_copy_changed_rows(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t row_bytes,
                                   int64_t first, int64_t *out) {
    int64_t n = 0;
    size_t width = (size_t)row_bytes;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *s = src + (size_t)r * width;
        uint8_t *d = dst + (size_t)r * width;
        if (memcmp(s, d, width) != 0) {
            memcpy(d, s, width);
            out[n++] = first + r;
        }
    }
    return n;
}

/* Apply one delta link: copy row ``i`` of ``values`` (``n`` contiguous rows of ``row_bytes``) to row
 * ``idx[i]`` of ``table``, for i in order (a row listed twice ends with its last value). The caller
 * has checked every index against the table's rows. */
void checkrun_scatter_rows(const uint8_t *values, uint8_t *table, const int64_t *idx, int64_t n,
                           int64_t row_bytes) {
    size_t width = (size_t)row_bytes;
    for (int64_t i = 0; i < n; i++)
        memcpy(table + (size_t)idx[i] * width, values + (size_t)i * width, width);
}

/* Fold runs of equal adjacent rows: ``src`` holds ``rows`` contiguous rows of ``row_bytes``; row r
 * continues the run of row r-1 when their bytes are equal (memcmp). Each run's row goes to ``dst``
 * and its length to ``runs`` (room for ``limit`` of each); returns the number of runs, or -1 as
 * soon as there are more than ``limit`` (what was written is then of no use). One pass: a row is
 * compared with the previous one, still in cache, and copied. A pooled lookup's gradient
 * (sum/mean over a bag) repeats the bag's row once per id: those runs fold. */
int64_t checkrun_fold_rows(const uint8_t *src, int64_t rows, int64_t row_bytes, int64_t limit, uint8_t *dst,
                           int32_t *runs) {
    size_t width = (size_t)row_bytes;
    int64_t k = -1;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *s = src + (size_t)r * width;
        if (r == 0 || memcmp(s, s - width, width) != 0) {
            if (++k >= limit)
                return -1;
            memcpy(dst + (size_t)k * width, s, width);
            runs[k] = 0;
        }
        runs[k]++;
    }
    return k + 1;
}
