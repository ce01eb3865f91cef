/* Attention of each query and head over its selected keys, for the CPU (``topk``, ``dsa``): read
 * where they lie, no gathered copy; scores in a (heads x K) buffer. Each call splits its work into
 * `parts` (rows or ranges of keys) run on OpenMP threads (``ON_PARTS``, kernel.h).
 *
 * Layouts (float32, row-major, contiguous): q (n, H, D), k (N, H, D), v (N, H, E), out (n, H, E),
 * lse (n, H), mean_p (n, K) or NULL. keys (int32: a selection holds n x K of them) and valid (uint8)
 * are (n, H, K) with row strides sn and head strides sh in elements (sh = 0: one choice shared by
 * the heads), K contiguous. q arrives scaled: a score is q . k. */
#include "kernel.h"

/* exp_approx of 8 lanes at once (measured under the kernels' flags: at most 0.9 ulp for |x| <= 5, 4.5 up to 87). */
static inline v8 exp8(v8 x) {
    const v8 zero = {0};
    v8 t = x * 1.44269504088896341f;
    /* truncated, then rounded to nearest (masks are -1 where true); adding and subtracting 1.5 * 2^23
     * would round in one step, but -fassociative-math folds that away */
    v8i e = __builtin_convertvector(t, v8i);
    v8 d = t - __builtin_convertvector(e, v8);
    e = e - (d > 0.5f) + (d < -0.5f);
    v8 n = __builtin_convertvector(e, v8);
    v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8 y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r
            + 1.6666665459e-1f) * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    v8i floor = e < -126;
    v8i bits = ((e & ~floor) + (-126 & floor) + 127) << 23;
    v8 scale;
    memcpy(&scale, &bits, sizeof scale);
    v8i out, keep = x >= zero - 87.0f;
    y *= scale;
    memcpy(&out, &y, sizeof out);
    out &= keep;  /* 0 below -87 */
    memcpy(&y, &out, sizeof y);
    return y;
}

static inline __attribute__((always_inline)) int keys_forward(int64_t i0, int64_t i1, int64_t H, int64_t K, int64_t D, int64_t E,
                                                              const float *q, const float *k, const float *v,
                                                              const int32_t *keys, const uint8_t *valid, int64_t sn, int64_t sh,
                                                              float *out, float *lse, float *mean_p) {
    float *p = malloc(sizeof(float) * H * K);
    if (!p) return 1;
    for (int64_t i = i0; i < i1; i++) {
        const int32_t *key = keys + i * sn;
        const uint8_t *ok = valid + i * sn;
        slot_dots(p, q + i * H * D, k, key, sh, H, K, D);
        for (int64_t h = 0; h < H; h++) {  /* softmax weights (0 for an invalid slot) and lse */
            float *ph = p + h * K, m = -INFINITY, z = 0.0f;
            for (int64_t j = 0; j < K; j++) ph[j] = ok[h * sh + j] ? ph[j] : -INFINITY, m = ph[j] > m ? ph[j] : m;
            for (int64_t j = 0; j < K; j++) ph[j] = m == -INFINITY ? 0.0f : exp_approx(ph[j] - m), z += ph[j];
            for (int64_t j = 0; j < K; j++) ph[j] = z > 0.0f ? ph[j] / z : 0.0f;
            lse[i * H + h] = m == -INFINITY ? -INFINITY : m + logf(z);
        }
        for (int64_t h = 0; h < H; h++) {
            const float *ph = p + h * K;
            float *o = out + (i * H + h) * E;
            if (E % 8 || E > MAX_DIM) {
                for (int64_t e = 0; e < E; e++) o[e] = 0.0f;
                for (int64_t j = 0; j < K; j++) axpy(o, ph[j], v + ((int64_t)key[h * sh + j] * H + h) * E, E);
                continue;
            }
            v8 acc[MAX_DIM / 8];  /* the output row in registers: added to in memory, it was a chain of dependent stores */
            for (int64_t c = 0; c < E / 8; c++) acc[c] = (v8){0};
            for (int64_t j = 0; j < K; j++) {
                if (h == 0 && j + AHEAD < K) prefetch_row(v + (int64_t)key[j + AHEAD] * H * E, H * E);
                const float *row = v + ((int64_t)key[h * sh + j] * H + h) * E;
                for (int64_t c = 0; c < E / 8; c++) acc[c] += ph[j] * load8(row + 8 * c);
            }
            memcpy(o, acc, sizeof(float) * E);
        }
        if (mean_p)
            for (int64_t j = 0; j < K; j++) {
                float sum = 0.0f;
                for (int64_t h = 0; h < H; h++) sum += p[h * K + j];
                mean_p[i * K + j] = sum / (float)H;
            }
    }
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
/* Query i's kept keys in one range (ks, m of them), head h: each weight recomputed from lse, dk and
 * dv rows added to, dq's row too, once. Where D and E are multiples of 8 up to MAX_DIM the query's
 * q, grad and dq rows stay in registers (added to in memory, a dq row was a chain of dependent
 * stores: one per key) and 8 keys' dot products are summed lane-wise together. */
static inline __attribute__((always_inline)) void query_keys(int64_t i, const int32_t *ks, int64_t m, int64_t h, int64_t H,
                                                             int64_t D, int64_t E, const float *q, const float *k,
                                                             const float *v, const float *grad, float l, float dl,
                                                             float *dq, float *dk, float *dv) {
    const float *qi = q + (i * H + h) * D, *gi = grad + (i * H + h) * E;
    if (D % 8 || E % 8 || D > MAX_DIM || E > MAX_DIM) {
        for (int64_t y = 0; y < m; y++) {
            int64_t row = (int64_t)ks[y] * H + h;
            float pj = exp_approx(dot(qi, k + row * D, D) - l);  /* the query has a valid key: l is finite */
            float ds = pj * (dot(gi, v + row * E, E) - dl);
            axpy(dq + (i * H + h) * D, ds, k + row * D, D);
            axpy(dk + row * D, ds, qi, D);
            axpy(dv + row * E, pj, gi, E);
        }
        return;
    }
    v8 qv[MAX_DIM / 8], gv[MAX_DIM / 8], dqa[MAX_DIM / 8];
    for (int64_t c = 0; c < D / 8; c++) qv[c] = load8(qi + 8 * c), dqa[c] = (v8){0};
    for (int64_t c = 0; c < E / 8; c++) gv[c] = load8(gi + 8 * c);
    for (int64_t y0 = 0; y0 < m; y0 += 8) {
        int64_t run = m - y0 < 8 ? m - y0 : 8;
        v8 a[8], b[8];
        for (int64_t y = 0; y < 8; y++) {
            const float *ky = k + ((int64_t)ks[y0 + (y < run ? y : 0)] * H + h) * D, *vy = v + ((int64_t)ks[y0 + (y < run ? y : 0)] * H + h) * E;
            a[y] = qv[0] * load8(ky), b[y] = gv[0] * load8(vy);
            for (int64_t c = 1; c < D / 8; c++) a[y] += qv[c] * load8(ky + 8 * c);
            for (int64_t c = 1; c < E / 8; c++) b[y] += gv[c] * load8(vy + 8 * c);
        }
        v8 p = exp8(lane_sums(a) - l), ds = p * (lane_sums(b) - dl);
        for (int64_t y = 0; y < run; y++) {
            int64_t row = (int64_t)ks[y0 + y] * H + h;
            float *dky = dk + row * D, *dvy = dv + row * E;
            const float *ky = k + row * D;
            for (int64_t c = 0; c < D / 8; c++) {
                v8 x = load8(dky + 8 * c) + ds[y] * qv[c];
                dqa[c] += ds[y] * load8(ky + 8 * c);
                memcpy(dky + 8 * c, &x, sizeof x);
            }
            for (int64_t c = 0; c < E / 8; c++) {
                v8 x = load8(dvy + 8 * c) + p[y] * gv[c];
                memcpy(dvy + 8 * c, &x, sizeof x);
            }
        }
    }
    float *dqi = dq + (i * H + h) * D;
    for (int64_t c = 0; c < D / 8; c++) {
        v8 x = load8(dqi + 8 * c) + dqa[c];
        memcpy(dqi + 8 * c, &x, sizeof x);
    }
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
