/* What the CPU kernels beside this file share (built and loaded by gtx/native/__init__.py): how a
 * kernel's parts run on threads, vectors of 8 floats, exp, dot products over selected rows. */
#ifndef GTX_KERNEL_H
#define GTX_KERNEL_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Runs `call` (an int: nonzero where it could not allocate) for part = 0 .. parts - 1 on OpenMP
 * threads and returns whether any failed. Built with -fopenmp this library shares the libgomp that
 * torch loaded (one soname), so the parts run on the team torch's own threads form: threads of our
 * own competed for the cores with torch's workers, which spin for a while after each op (a
 * third of the indexer's choice at 4k tokens). Without OpenMP the parts run one after another. */
#define ON_PARTS(parts, call)                                                             \
    do {                                                                                  \
        int failed_ = 0;                                                                  \
        _Pragma("omp parallel for num_threads(parts) schedule(static, 1) reduction(| : failed_)") \
        for (int64_t part = 0; part < (parts); part++) failed_ |= (call);                 \
        return failed_;                                                                   \
    } while (0)

/* e^x by Cephes' expf polynomial, 0 below -87: plain arithmetic, so that loops of it vectorize (glibc's
 * expf is a call per element). Within 1 ulp as written; the kernels' -fassociative-math merges the
 * two-step reduction x - n ln 2, and the error then grows with |x| (measured, GCC 12, its loops
 * vectorized): at most 1.3 ulp for |x| <= 1, 4 for |x| <= 5, 16 for |x| <= 20, 61 up to 87. The
 * kernels take e^(s - max): a weight at x < -5 is below 0.7% of the largest, its relative error
 * below 61 x 2^-23 (7e-6). */
static inline float exp_approx(float x) {
    float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r
               + 1.6666665459e-1f) * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    int32_t bits = ((int32_t)(n < -126.0f ? -126.0f : n) + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : y * scale;
}

static float dot(const float *a, const float *b, int64_t d) {
    float s = 0.0f;
    for (int64_t x = 0; x < d; x++) s += a[x] * b[x];
    return s;
}

static void axpy(float *y, float a, const float *x, int64_t d) {
    for (int64_t e = 0; e < d; e++) y[e] += a * x[e];
}

static void prefetch_row(const float *row, int64_t len) {
    for (int64_t x = 0; x < len; x += 16) __builtin_prefetch(row + x);  /* 16 floats: a cache line */
}

typedef float v8 __attribute__((vector_size(32)));  /* GCC/Clang vectors: one AVX register, or two SSE */

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }

typedef int32_t v8i __attribute__((vector_size(32)));

/* Lanes of a and b (b's numbered 8 to 15) picked by 8 constant indices: GCC has
 * __builtin_shufflevector only from version 12, clang has no __builtin_shuffle. */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* Pairwise sums within each half: (a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7). */
static inline v8 pair_sums(v8 a, v8 b) {
    return SHUFFLE8(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE8(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* The lane sums of 8 vectors, as one vector: 7 pairings for 8 sums, where each sum alone takes 3. */
static inline v8 lane_sums(const v8 *a) {
    v8 lo = pair_sums(pair_sums(a[0], a[1]), pair_sums(a[2], a[3]));
    v8 hi = pair_sums(pair_sums(a[4], a[5]), pair_sums(a[6], a[7]));
    return SHUFFLE8(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE8(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

#define MAX_DIM 128 /* head sizes up to this (multiples of 8) keep a query's rows in registers */
#define AHEAD 8 /* keys prefetched ahead: a selected key's row is a random read */

/* out[h * K + j] = a_h . x(key j, h) for the H heads and slots [0, K) of one query: a (H, d) its
 * rows, x (N, H, d), key its slots (head stride sh). Slots in runs of 8, heads inside a run (a shared
 * key is one contiguous row, read once from memory); where d is a multiple of 8, a run's 8 dot
 * products are summed lane-wise and reduced together (``lane_sums``). */
static inline __attribute__((always_inline)) void slot_dots(float *out, const float *a, const float *x, const int32_t *key, int64_t sh,
                                                            int64_t H, int64_t K, int64_t d) {
    int64_t j = 0;
    if (d % 8 == 0)
        for (; j + 8 <= K; j += 8) {
            for (int64_t y = j + AHEAD; y < j + AHEAD + 8 && y < K; y++) prefetch_row(x + (int64_t)key[y] * H * d, H * d);
            for (int64_t h = 0; h < H; h++) {
                const float *ah = a + h * d, *row[8];
                v8 acc[8] = {{0}};
                for (int64_t y = 0; y < 8; y++) row[y] = x + ((int64_t)key[h * sh + j + y] * H + h) * d;
                for (int64_t c = 0; c < d; c += 8) {
                    v8 av = load8(ah + c);
                    for (int64_t y = 0; y < 8; y++) acc[y] += av * load8(row[y] + c);
                }
                v8 sums = lane_sums(acc);
                memcpy(out + h * K + j, &sums, sizeof sums);
            }
        }
    for (; j < K; j++)
        for (int64_t h = 0; h < H; h++) out[h * K + j] = dot(a + h * d, x + ((int64_t)key[h * sh + j] * H + h) * d, d);
}

typedef float v16 __attribute__((vector_size(64)));  /* one AVX-512 register; two AVX or four SSE ones elsewhere */
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }

/* exp_approx of a vector's lanes at once, for vectors of 8 (exp8) and 16 (exp16) floats (measured under
 * the kernels' flags: at most 0.9 ulp for |x| <= 5, 4.5 up to 87; 0 below -87, -inf included). */
#define DEFINE_EXP(name, vf, vi)                                                                              \
    static inline vf name(vf x) {                                                                             \
        vf t = x * 1.44269504088896341f;                                                                      \
        /* truncated, then rounded to nearest (masks are -1 where true); adding and subtracting 1.5 * 2^23 \
         * would round in one step, but -fassociative-math folds that away */                                \
        vi e = __builtin_convertvector(t, vi);                                                                \
        vf d = t - __builtin_convertvector(e, vf);                                                            \
        e = e - (d > 0.5f) + (d < -0.5f);                                                                     \
        vf n = __builtin_convertvector(e, vf);                                                                \
        vf r = x - n * 0.693359375f + n * 2.12194440e-4f;                                                     \
        vf y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r \
                + 1.6666665459e-1f) * r + 5.0000001201e-1f;                                                   \
        y = y * r * r + r + 1.0f;                                                                             \
        vi floor = e < -126;                                                                                  \
        vi bits = ((e & ~floor) + (-126 & floor) + 127) << 23;                                                \
        vf scale;                                                                                             \
        memcpy(&scale, &bits, sizeof scale);                                                                  \
        vi out, keep = x >= -87.0f;                                                                           \
        y *= scale;                                                                                           \
        memcpy(&out, &y, sizeof out);                                                                         \
        out &= keep; /* 0 below -87 */                                                                        \
        memcpy(&y, &out, sizeof y);                                                                           \
        return y;                                                                                             \
    }
DEFINE_EXP(exp8, v8, v8i)
DEFINE_EXP(exp16, v16, v16i)

/* Query i's attention over its K slots (key ids `key`, `ok` nonzero where a slot holds a key; head
 * stride sh, 0: shared by the heads): out and lse rows i, and where mean_p (K,) is given the weights
 * averaged over the heads. p: scratch of H x K floats. */
static inline __attribute__((always_inline)) void query_forward(float *p, int64_t i, const int32_t *key, const uint8_t *ok,
                                                                int64_t sh, int64_t H, int64_t K, int64_t D, int64_t E,
                                                                const float *q, const float *k, const float *v,
                                                                float *out, float *lse, float *mean_p) {
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
            mean_p[j] = sum / (float)H;
        }
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

#endif
