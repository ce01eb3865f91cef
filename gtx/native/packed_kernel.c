/* Attention where each query reads one contiguous range of keys of its own sample, for the CPU
 * (``gtx.backends.packed``: short samples, complete or causal, and windows over them): the keys read
 * where they lie, no padded copy, no mask. A call's samples are split into `parts` runs of
 * consecutive samples (OpenMP threads, ``ON_PARTS``); a sample's queries and keys belong to it alone,
 * so the backward adds to dq, dk and dv rows no other part touches.
 *
 * Layouts (float32, row-major, contiguous): q (n, H, D), k (N, H, D), v (N, H, E), out and grad
 * (n, H, E), lse and delta (n, H). spans (S, 4) int64: per sample its first query row, its queries,
 * its first key row, its keys. ranges (n, 2) int64: per query its first key and one past its last,
 * within its sample's keys (an empty range: output 0, lse -inf). q arrives scaled: a score is q . k. */
#include "kernel.h"

/* The largest key count of samples [s0, s1): their scratch. */
static int64_t widest(const int64_t *spans, int64_t s0, int64_t s1) {
    int64_t most = 1;
    for (int64_t s = s0; s < s1; s++) most = spans[4 * s + 3] > most ? spans[4 * s + 3] : most;
    return most;
}

/* Key ids k0 .. k0 + m - 1 (and, where ok is given, m slots marked valid): a sample's keys as the
 * slots of query_forward and query_keys, a query's range a run of them. */
static void key_range(int32_t *ids, uint8_t *ok, int64_t k0, int64_t m) {
    for (int64_t j = 0; j < m; j++) ids[j] = (int32_t)(k0 + j);
    if (ok) memset(ok, 1, (size_t)m);
}

static inline __attribute__((always_inline)) int packed_forward(int64_t s0, int64_t s1, const int64_t *spans,
                                                                const int64_t *ranges, int64_t H, int64_t D, int64_t E,
                                                                const float *q, const float *k, const float *v,
                                                                float *out, float *lse) {
    int64_t most = widest(spans, s0, s1);
    float *p = malloc(sizeof(float) * H * most);
    int32_t *ids = malloc(sizeof(int32_t) * most);
    uint8_t *ok = malloc(most);
    if (!p || !ids || !ok) return free(p), free(ids), free(ok), 1;
    for (int64_t s = s0; s < s1; s++) {
        const int64_t *span = spans + 4 * s;
        key_range(ids, ok, span[2], span[3]);
        for (int64_t i = span[0]; i < span[0] + span[1]; i++) {
            int64_t lo = ranges[2 * i], m = ranges[2 * i + 1] - lo;
            query_forward(p, i, ids + (lo - span[2]), ok, 0, H, m, D, E, q, k, v, out, lse, NULL);
        }
    }
    free(p), free(ids), free(ok);
    return 0;
}

int gtx_packed_forward(int64_t parts, int64_t S, const int64_t *spans, const int64_t *ranges, int64_t H, int64_t D,
                       int64_t E, const float *q, const float *k, const float *v, float *out, float *lse) {
    if (D == 32 && E == 32)  /* the common head size, its loops unrolled */
        ON_PARTS(parts, packed_forward(S * part / parts, S * (part + 1) / parts, spans, ranges, H, 32, 32, q, k, v, out, lse));
    ON_PARTS(parts, packed_forward(S * part / parts, S * (part + 1) / parts, spans, ranges, H, D, E, q, k, v, out, lse));
}

static inline __attribute__((always_inline)) int packed_backward(int64_t s0, int64_t s1, const int64_t *spans,
                                                                 const int64_t *ranges, int64_t H, int64_t D, int64_t E,
                                                                 const float *q, const float *k, const float *v,
                                                                 const float *grad, const float *lse, const float *delta,
                                                                 float *dq, float *dk, float *dv) {
    int32_t *ids = malloc(sizeof(int32_t) * widest(spans, s0, s1));
    if (!ids) return 1;
    for (int64_t s = s0; s < s1; s++) {
        const int64_t *span = spans + 4 * s;
        key_range(ids, NULL, span[2], span[3]);
        for (int64_t i = span[0]; i < span[0] + span[1]; i++) {
            int64_t lo = ranges[2 * i], m = ranges[2 * i + 1] - lo;
            if (m == 0) continue;  /* no key: its output is 0, no gradient (and lse is -inf) */
            for (int64_t h = 0; h < H; h++)
                query_keys(i, ids + (lo - span[2]), m, h, H, D, E, q, k, v, grad, lse[i * H + h], delta[i * H + h], dq, dk,
                           dv);
        }
    }
    free(ids);
    return 0;
}

/* dq, dk, dv zeroed by the caller; delta = grad . out per query and head (the softmax backward's row term). */
int gtx_packed_backward(int64_t parts, int64_t S, const int64_t *spans, const int64_t *ranges, int64_t H, int64_t D,
                        int64_t E, const float *q, const float *k, const float *v, const float *grad, const float *lse,
                        const float *delta, float *dq, float *dk, float *dv) {
    if (D == 32 && E == 32)
        ON_PARTS(parts, packed_backward(S * part / parts, S * (part + 1) / parts, spans, ranges, H, 32, 32, q, k, v, grad,
                                        lse, delta, dq, dk, dv));
    ON_PARTS(parts, packed_backward(S * part / parts, S * (part + 1) / parts, spans, ranges, H, D, E, q, k, v, grad, lse,
                                    delta, dq, dk, dv));
}
