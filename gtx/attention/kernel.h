/* What the CPU kernels beside this file share (built and loaded by gtx/attention/native.py): how a
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

#define MAX_DIM 64 /* head sizes up to this (multiples of 8) keep a query's rows in registers */
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

#endif
