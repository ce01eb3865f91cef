/* Attention of each query and head over its selected keys, for the CPU (``topk``, ``dsa``): read
 * where they lie, no gathered copy; scores in a (heads x K) buffer. Each call splits its work into
 * `parts` (rows or ranges of keys) run on OpenMP threads (``ON_PARTS``, kernel.h).
 *
 * Layouts (float32, row-major, contiguous): q (n, H, D), k (N, H, D), v (N, H, E), out (n, H, E),
 * lse (n, H), mean_p (n, K) or NULL. keys (int32: a selection holds n x K of them) and valid (uint8)
 * are (n, H, K) with row strides sn and head strides sh in elements (sh = 0: one choice shared by
 * the heads), K contiguous. q arrives scaled: a score is q . k. */
#include "kernel.h"

static inline __attribute__((always_inline)) int keys_forward(int64_t i0, int64_t i1, int64_t H, int64_t K, int64_t D, int64_t E,
                                                              const float *q, const float *k, const float *v,
                                                              const int32_t *keys, const uint8_t *valid, int64_t sn, int64_t sh,
                                                              float *out, float *lse, float *mean_p) {
    float *p = malloc(sizeof(float) * H * K);
    if (!p) return 1;
    for (int64_t i = i0; i < i1; i++)
        query_forward(p, i, keys + i * sn, valid + i * sn, sh, H, K, D, E, q, k, v, out, lse, mean_p ? mean_p + i * K : NULL);
    free(p);
    return 0;
}

int gtx_keys_forward(int64_t parts, int64_t n, int64_t H, int64_t K, int64_t D, int64_t E,
                     const float *q, const float *k, const float *v,
                     const int32_t *keys, const uint8_t *valid, int64_t sn, int64_t sh,
                     float *out, float *lse, float *mean_p) {
    if (D == 32 && E == 32)  /* the common head size, its loops unrolled */
        ON_PARTS(parts, keys_forward(n * part / parts, n * (part + 1) / parts, H, K, 32, 32, q, k, v, keys, valid, sn, sh, out, lse, mean_p));
    ON_PARTS(parts, keys_forward(n * part / parts, n * (part + 1) / parts, H, K, D, E, q, k, v, keys, valid, sn, sh, out, lse, mean_p));
}
/* The backward by ranges of 2^shift keys: part (of parts) owns ranges part, part + parts, ...
 * and, per head group (a shared choice, sh = 0: all heads at once; else each head alone), lists the
 * (query, key) pairs whose key falls in them, range by range in query order, then recomputes each
 * pair's weight from lse and adds to dk, dv (N, H, D / E) rows of its own ranges only and to its own
 * dq buffer (n, H, D), zeroed by the caller. A range's k, v, dk and dv rows stay in this core's cache
 * while the queries stream past: read query-major, every kept key was a random read and write of
 * three rows, and beyond the last-level cache (16k tokens) a miss. delta (n, H): the softmax
 * backward's row term, grad . out. */
static int keys_backward(int64_t part, int64_t parts, int64_t shift, int64_t n, int64_t N, int64_t H, int64_t K,
                         int64_t D, int64_t E, const float *q, const float *k, const float *v,
                         const int32_t *keys, const uint8_t *valid, int64_t sn, int64_t sh,
                         const float *grad, const float *lse, const float *delta,
                         float *dq, float *dk, float *dv) {
    int64_t ranges = ((N - 1) >> shift) + 1, owned = ranges > part ? (ranges - part + parts - 1) / parts : 0;
    int64_t groups = sh ? H : 1, width = sh ? 1 : H;
    int64_t *start = malloc(sizeof(int64_t) * (owned + 1)), *slot = malloc(sizeof(int64_t) * ranges);
    int32_t *pairs = NULL;
    if (!start || !slot) return free(start), free(slot), 1;
    for (int64_t r = 0; r < ranges; r++) slot[r] = r % parts == part ? r / parts + 1 : 0;  /* 0: another part's */
    for (int64_t group = 0; group < groups; group++) {
        const int32_t *gkeys = keys + group * sh;
        const uint8_t *gvalid = valid + group * sh;
        for (int64_t r = 0; r <= owned; r++) start[r] = 0;
        for (int64_t i = 0; i < n; i++)  /* counted, then placed: pairs of a range in query order */
            for (int64_t j = 0; j < K; j++) {
                int64_t r = gkeys[i * sn + j] >> shift;  /* shifts: a division per kept key cost more than the rest */
                if (gvalid[i * sn + j]) start[slot[r]]++;  /* start[0] counts others' pairs, never read */
            }
        start[0] = 0;
        for (int64_t r = 0; r < owned; r++) start[r + 1] += start[r];
        int64_t total = start[owned];
        free(pairs);
        pairs = malloc(sizeof(int32_t) * 2 * (total ? total : 1));  /* queries, then their keys */
        if (!pairs) return free(start), free(slot), 1;
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < K; j++) {
                int64_t r = gkeys[i * sn + j] >> shift;  /* shifts: a division per kept key cost more than the rest */
                if (!gvalid[i * sn + j] || !slot[r]) continue;
                int64_t at = start[slot[r] - 1]++;
                pairs[at] = (int32_t)i, pairs[total + at] = gkeys[i * sn + j];
            }
        for (int64_t x0 = 0, x1; x0 < total; x0 = x1) {  /* a run of one query's keys */
            int64_t i = pairs[x0];
            for (x1 = x0 + 1; x1 < total && pairs[x1] == i; x1++) {}
            for (int64_t h = group * width; h < group * width + width; h++) {
                float l = lse[i * H + h], dl = delta[i * H + h];
                if (D == 32 && E == 32)  /* the common head size, its loops unrolled */
                    query_keys(i, pairs + total + x0, x1 - x0, h, H, 32, 32, q, k, v, grad, l, dl, dq, dk, dv);
                else
                    query_keys(i, pairs + total + x0, x1 - x0, h, H, D, E, q, k, v, grad, l, dl, dq, dk, dv);
            }
        }
    }
    free(pairs), free(start), free(slot);
    return 0;
}

/* dqs: (parts, n, H, D), a part's own dq each, zeroed by the caller. */
int gtx_keys_backward(int64_t parts, int64_t shift, int64_t n, int64_t N, int64_t H, int64_t K,
                      int64_t D, int64_t E, const float *q, const float *k, const float *v,
                      const int32_t *keys, const uint8_t *valid, int64_t sn, int64_t sh,
                      const float *grad, const float *lse, const float *delta,
                      float *dqs, float *dk, float *dv) {
    ON_PARTS(parts, keys_backward(part, parts, shift, n, N, H, K, D, E, q, k, v, keys, valid, sn, sh, grad, lse, delta,
                                  dqs + part * n * H * D, dk, dv));
}
