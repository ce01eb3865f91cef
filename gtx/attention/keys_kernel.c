/* Token-selection kernels for the CPU, built and loaded by gtx/attention/native.py: attention of each
 * query and head over its selected keys (read where they lie, no gathered copy; scores in a
 * (heads x K) buffer), a top-k choice (a lightning indexer's, or q . k's for topk) and the indexer's
 * KL loss. Each call splits its work into `parts` (rows or ranges of keys) run on OpenMP threads
 * (``ON_PARTS``).
 *
 * Layouts (float32, row-major, contiguous): q (n, H, D), k (N, H, D), v (N, H, E), out (n, H, E),
 * lse (n, H), mean_p (n, K) or NULL. keys (int32: a selection holds n x K of them) and valid (uint8)
 * are (n, H, K) with row strides sn and head strides sh in elements (sh = 0: one choice shared by
 * the heads), K contiguous. q arrives scaled: a score is q . k. */
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

/* e^x to about 2 ulp (Cephes' expf polynomial), 0 below -87: plain arithmetic, so that loops of it
 * vectorize (glibc's expf is a call per element). */
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

/* exp_approx of 8 lanes at once. */
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

/* Pairwise sums within each half: (a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7). */
static inline v8 pair_sums(v8 a, v8 b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* The lane sums of 8 vectors, as one vector: 7 pairings for 8 sums, where each sum alone takes 3. */
static inline v8 lane_sums(const v8 *a) {
    v8 lo = pair_sums(pair_sums(a[0], a[1]), pair_sums(a[2], a[3]));
    v8 hi = pair_sums(pair_sums(a[4], a[5]), pair_sums(a[6], a[7]));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

#define MAX_DIM 64 /* head sizes up to this (multiples of 8) keep a query's rows in registers */
#define AHEAD 8 /* keys prefetched ahead: a selected key's row is a random read */

/* out[h * K + j] = a_h . x(key j, h) for heads [h0, h1) and slots [0, K) of one query: a (H, d) its
 * rows, x (N, H, d), key its slots (head stride sh). Slots in runs of 8, heads inside a run (a shared
 * key is one contiguous row, read once from memory); where d is a multiple of 8, a run's 8 dot
 * products are summed lane-wise and reduced together (``lane_sums``). */
static inline __attribute__((always_inline)) void slot_dots(float *out, const float *a, const float *x, const int32_t *key, int64_t sh,
                      int64_t h0, int64_t h1, int64_t H, int64_t K, int64_t d) {
    int64_t j = 0;
    if (d % 8 == 0)
        for (; j + 8 <= K; j += 8) {
            for (int64_t y = j + AHEAD; y < j + AHEAD + 8 && y < K; y++) prefetch_row(x + ((int64_t)key[y] * H + h0) * d, (h1 - h0) * d);
            for (int64_t h = h0; h < h1; h++) {
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
        for (int64_t h = h0; h < h1; h++) out[h * K + j] = dot(a + h * d, x + ((int64_t)key[h * sh + j] * H + h) * d, d);
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
        slot_dots(p, q + i * H * D, k, key, sh, 0, H, H, K, D);
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

/* A candidate as one integer that orders as (score, key) does: the score's bits made monotone in the
 * high half (a negative float's bits all flipped, a positive one's sign bit set; -0 taken as +0, as
 * the float comparison sees it), the key in the low half. Quickselect then moves one array and
 * compares integers. */
static inline uint64_t candidate(float score, int64_t key) {
    uint32_t bits;
    memcpy(&bits, &score, sizeof bits);
    bits = bits == 0x80000000u ? 0u : bits;
    bits ^= (uint32_t)((int32_t)bits >> 31) | 0x80000000u;  /* branch-free, so that a run of them vectorizes */
    return (uint64_t)bits << 32 | (uint32_t)key;
}

static inline float candidate_score(uint64_t c) {
    uint32_t bits = (uint32_t)(c >> 32);
    bits = bits & 0x80000000u ? bits & 0x7fffffffu : ~bits;
    float score;
    memcpy(&score, &bits, sizeof score);
    return score;
}

static inline void swap(uint64_t *c, int64_t a, int64_t b) { uint64_t x = c[a]; c[a] = c[b]; c[b] = x; }

#define SAMPLE 31 /* elements a first pivot is chosen from */

/* Reorders c[0, size) so that its best (largest) `count` come first; returns the worst score among
 * them. Quickselect; its first pivot is the element of a sample whose rank in the sample matches
 * count's in the whole, so that one or two partitions usually suffice. */
static float keep_best(uint64_t *c, int64_t size, int64_t count) {
    int64_t lo = 0, hi = size - 1, mid = size / 2;
    if (size >= 4 * SAMPLE) {  /* the strided sample's element with `want` better than it: ranks by counting, no branch */
        int64_t step = size / SAMPLE, want = count * SAMPLE / size;
        uint64_t sample[SAMPLE];
        for (int64_t x = 0; x < SAMPLE; x++) sample[x] = c[x * step];
        for (int64_t x = 0; x < SAMPLE; x++) {
            int64_t rank = 0;
            for (int64_t y = 0; y < SAMPLE; y++) rank += sample[y] > sample[x];
            if (rank == want) mid = x * step;  /* candidates are distinct (their keys differ): one x has it */
        }
    }
    while (lo < hi) {
        int64_t store = lo;
        swap(c, mid, hi);  /* the pivot, parked at hi */
        uint64_t pivot = c[hi];
        for (int64_t x = lo; x < hi; x++) {  /* branch-free: on random scores a branch would miss half the time */
            uint64_t y = c[x];
            c[x] = c[store], c[store] = y;
            store += y > pivot;
        }
        swap(c, store, hi);  /* [lo, store) better than the pivot, now at store */
        if (store == count - 1 || store == count) break;
        if (store < count) lo = store + 1; else hi = store - 1;
        mid = lo + (hi - lo) / 2;
    }
    uint64_t worst = UINT64_MAX;
    for (int64_t x = 0; x < count; x++) worst = c[x] < worst ? c[x] : worst;
    return candidate_score(worst);
}

#define GROUP 32 /* query rows scored together, each tile of index keys read once per group: choice.py's GROUP */
#define TILE 128 /* keys per tile: gtx/attention/choice.py's TILE */
#define CANDIDATES 4 /* a row's candidate buffer, in multiples of count... */
#define MIN_CANDIDATES 1024 /* ...and at least this many: a small buffer would fill, and select, too often */

/* out[r * width + s] = q_r . k(s) for `nq` query vectors q (nq, d) and the `width` keys of a tile,
 * k(s) = column s of k_t (d rows of TILE): 4 vectors x 16 keys at a time, their 8 sums in registers
 * (independent chains keep the FMA units busy; one vector's 2 would wait on their own latency). */
static void tile_dots(float *out, const float *q, int64_t nq, const float *k_t, int64_t d, int64_t width) {
    int64_t r = 0;
    for (; r + 4 <= nq; r += 4) {
        const float *q0 = q + r * d, *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
        float *o = out + r * width;
        int64_t s = 0;
        for (; s + 16 <= width; s += 16) {
            v8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
            for (int64_t c = 0; c < d; c++) {
                v8 k0 = load8(k_t + c * TILE + s), k1 = load8(k_t + c * TILE + s + 8);
                a00 += q0[c] * k0, a01 += q0[c] * k1, a10 += q1[c] * k0, a11 += q1[c] * k1;
                a20 += q2[c] * k0, a21 += q2[c] * k1, a30 += q3[c] * k0, a31 += q3[c] * k1;
            }
            memcpy(o + s, &a00, 32), memcpy(o + s + 8, &a01, 32), memcpy(o + width + s, &a10, 32);
            memcpy(o + width + s + 8, &a11, 32), memcpy(o + 2 * width + s, &a20, 32);
            memcpy(o + 2 * width + s + 8, &a21, 32), memcpy(o + 3 * width + s, &a30, 32), memcpy(o + 3 * width + s + 8, &a31, 32);
        }
        for (; s < width; s++)
            for (int64_t x = 0; x < 4; x++) {
                float acc = 0.0f;
                for (int64_t c = 0; c < d; c++) acc += q[(r + x) * d + c] * k_t[c * TILE + s];
                o[x * width + s] = acc;
            }
    }
    for (; r < nq; r++)
        for (int64_t s = 0; s < width; s++) {
            float acc = 0.0f;
            for (int64_t c = 0; c < d; c++) acc += q[r * d + c] * k_t[c * TILE + s];
            out[r * width + s] = acc;
        }
}

/* A lightning indexer's choice (DSA), for the n query rows of one sample: index queries iq (n, J, d),
 * weights w (n, J), index keys in tiles of TILE keys transposed, ik_tiles (ceil(nk / TILE), d, TILE). Row t
 * scores I(t, s) = sum_a w(t, a) relu(iq(t, a) . ik(s)) (without the relu where relu = 0: q . k for
 * top-k attention, J = 1, w = 1) over the keys it sees (s <= t for causal rows, else all nk) and keeps
 * the `count` best: keys (n, count) as s + offset, valid (n, count); a row that sees fewer leaves
 * slots invalid (key 0). Equal scores prefer the later key. Rows are scored in groups
 * against tiles of keys, latest tile first, into a buffer of `cap` candidates per row; a full
 * buffer keeps its best `count` (quickselect) and their worst score becomes the bar a candidate must
 * pass, so most keys cost one comparison. No (rows x keys) score matrix: a tile's at a time. Part (of parts)
 * does groups part, part + parts, ... of GROUP rows. */
static int top_index(int64_t part, int64_t parts, int64_t n, int64_t nk, int64_t J, int64_t d,
                     const float *iq, const float *w, const float *ik_tiles, int64_t causal, int64_t relu,
                     int64_t count, int64_t offset, int32_t *keys, uint8_t *valid) {
    float *dots = malloc(sizeof(float) * GROUP * J * TILE);
    int64_t cap = CANDIDATES * count < MIN_CANDIDATES ? MIN_CANDIDATES : CANDIDATES * count;
    uint64_t *cands = malloc(sizeof(uint64_t) * GROUP * cap);
    if (!dots || !cands) return free(dots), free(cands), 1;
    for (int64_t g0 = part * GROUP; g0 < n; g0 += parts * GROUP) {  /* groups dealt round-robin: causal rows grow */
        int64_t rows = n - g0 < GROUP ? n - g0 : GROUP, size[GROUP], seen[GROUP];
        float bar[GROUP];
        for (int64_t r = 0; r < rows; r++) {
            seen[r] = causal ? (g0 + r + 1 < nk ? g0 + r + 1 : nk) : nk;
            size[r] = 0, bar[r] = -INFINITY;  /* latest first: an equal score is an earlier key, never better */
        }
        int64_t last = seen[rows - 1];
        for (int64_t s0 = (last - 1) / TILE * TILE; s0 >= 0; s0 -= TILE) {
            int64_t width = last - s0 < TILE ? last - s0 : TILE;
            tile_dots(dots, iq + g0 * J * d, rows * J, ik_tiles + s0 * d, d, width);
            for (int64_t r = 0; r < rows; r++) {
                float *row = dots + r * J * width;
                uint64_t *cand = cands + r * cap;
                for (int64_t s = 0; s < width; s++) row[s] = w[(g0 + r) * J] * (row[s] > 0.0f || !relu ? row[s] : 0.0f);
                for (int64_t a = 1; a < J; a++) {
                    const float *da = row + a * width, wa = w[(g0 + r) * J + a];
                    for (int64_t s = 0; s < width; s++) row[s] += wa * (da[s] > 0.0f || !relu ? da[s] : 0.0f);
                }
                int64_t filled = size[r];
                for (int64_t hi = seen[r] - s0 < width ? seen[r] - s0 : width; hi > 0; hi -= 16) {
                    int64_t lo = hi > 16 ? hi - 16 : 0, any = 0;
                    uint64_t packed[16];
                    if (hi - lo == 16) {  /* once the bar is up, most runs of 16 stop here: two vector comparisons */
                        v8 b = (v8){0} + bar[r];
                        v8i pass = (load8(row + lo) > b) | (load8(row + lo + 8) > b);
                        int64_t lanes[4];
                        memcpy(lanes, &pass, sizeof lanes);
                        any = lanes[0] | lanes[1] | lanes[2] | lanes[3];
                    } else {
                        for (int64_t s = lo; s < hi; s++) any |= row[s] > bar[r];
                    }
                    if (!any) continue;
                    for (int64_t s = lo; s < hi; s++) packed[s - lo] = candidate(row[s], s0 + s);
                    for (int64_t s = hi - 1; s >= lo; s--) {
                        cand[filled] = packed[s - lo];  /* written always, kept if it passes: no branch to miss */
                        filled += row[s] > bar[r];
                        if (filled == cap) bar[r] = keep_best(cand, filled, count), filled = count;
                    }
                }
                size[r] = filled;
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            uint64_t *cand = cands + r * cap;
            int64_t t = g0 + r;
            if (size[r] > count) keep_best(cand, size[r], count), size[r] = count;
            for (int64_t j = 0; j < count; j++) {
                valid[t * count + j] = j < size[r];
                keys[t * count + j] = j < size[r] ? (int64_t)(uint32_t)cand[j] + offset : 0;
            }
        }
    }
    free(dots), free(cands);
    return 0;
}

int gtx_top_index(int64_t parts, int64_t n, int64_t nk, int64_t J, int64_t d,
                  const float *iq, const float *w, const float *ik_tiles, int64_t causal, int64_t relu,
                  int64_t count, int64_t offset, int32_t *keys, uint8_t *valid) {
    ON_PARTS(parts, top_index(part, parts, n, nk, J, d, iq, w, ik_tiles, causal, relu, count, offset, keys, valid));
}

/* The indexer's KL over the kept keys (DSA's sparse stage), rows [i0, i1): for row t with targets p
 * (n, K) over keys (n, K) (valid (n, K)), I_j = sum_a w(t, a) relu(iq(t, a) . ik(key_j)) (iq (n, J, d),
 * w (n, J), ik (N, d)), loss[t] = sum_j p_j (log p_j - log softmax(I)_j) over the valid j, and its
 * gradients: diq, dw rows written, dik (N, d) added to (a part's own buffer). */
static inline __attribute__((always_inline)) int index_kl(int64_t i0, int64_t i1, int64_t J, int64_t K, int64_t d,
                 const float *iq, const float *w, const float *ik, const int32_t *keys, const uint8_t *valid,
                 const float *p, float *loss, float *diq, float *dw, float *dik) {
    float *dots = malloc(sizeof(float) * (J + 1) * K), *score = dots + J * K;
    if (!dots) return 1;
    for (int64_t t = i0; t < i1; t++) {
        const int32_t *key = keys + t * K;
        const uint8_t *ok = valid + t * K;
        const float *pt = p + t * K, *wt = w + t * J, *qt = iq + t * J * d;
        float m = -INFINITY, z = 0.0f, mass = 0.0f, l = 0.0f;
        for (int64_t a = 0; a < J; a++) slot_dots(dots + a * K, qt + a * d, ik, key, 0, 0, 1, 1, K, d);
        for (int64_t j = 0; j < K; j++) {
            score[j] = 0.0f;
            for (int64_t a = 0; a < J; a++) score[j] += wt[a] * (dots[a * K + j] > 0.0f ? dots[a * K + j] : 0.0f);
            if (ok[j] && score[j] > m) m = score[j];
        }
        loss[t] = 0.0f;
        if (m == -INFINITY) {  /* no valid key: nothing to fit */
            for (int64_t x = 0; x < J * d; x++) diq[t * J * d + x] = 0.0f;
            for (int64_t a = 0; a < J; a++) dw[t * J + a] = 0.0f;
            continue;
        }
        for (int64_t j = 0; j < K; j++)
            if (ok[j]) z += exp_approx(score[j] - m), mass += pt[j];
        float lse = m + logf(z);
        for (int64_t j = 0; j < K; j++) {  /* score[j] becomes d loss / d I_j (0 for an invalid slot) */
            if (ok[j] && pt[j] > 0.0f) l += pt[j] * (logf(pt[j]) - (score[j] - lse));
            score[j] = ok[j] ? exp_approx(score[j] - lse) * mass - pt[j] : 0.0f;
        }
        for (int64_t a = 0; a < J; a++) {
            const float *qa = qt + a * d, *xa = dots + a * K;
            float *diqa = diq + (t * J + a) * d, dwa = 0.0f;
            if (d % 8 || d > MAX_DIM) {
                for (int64_t x = 0; x < d; x++) diqa[x] = 0.0f;
                for (int64_t j = 0; j < K; j++) {
                    float ga = xa[j] > 0.0f ? score[j] * wt[a] : 0.0f;  /* through the relu */
                    dwa += xa[j] > 0.0f ? score[j] * xa[j] : 0.0f;
                    axpy(diqa, ga, ik + (int64_t)key[j] * d, d);
                    axpy(dik + (int64_t)key[j] * d, ga, qa, d);
                }
            } else {
                v8 qv[MAX_DIM / 8], acc[MAX_DIM / 8];  /* diq's row in registers: added to in memory, a chain of dependent stores */
                for (int64_t c = 0; c < d / 8; c++) qv[c] = load8(qa + 8 * c), acc[c] = (v8){0};
                for (int64_t j = 0; j < K; j++) {  /* branch-free: the relu passes about half the keys, unpredictably */
                    float ga = xa[j] > 0.0f ? score[j] * wt[a] : 0.0f;
                    dwa += xa[j] > 0.0f ? score[j] * xa[j] : 0.0f;
                    const float *row = ik + (int64_t)key[j] * d;
                    float *drow = dik + (int64_t)key[j] * d;
                    for (int64_t c = 0; c < d / 8; c++) {
                        v8 x = load8(drow + 8 * c) + ga * qv[c];
                        acc[c] += ga * load8(row + 8 * c);
                        memcpy(drow + 8 * c, &x, sizeof x);
                    }
                }
                memcpy(diqa, acc, sizeof(float) * d);
            }
            dw[t * J + a] = dwa;
        }
        loss[t] = l;
    }
    free(dots);
    return 0;
}

/* diks: (parts, N, d), a part's own dik each, zeroed by the caller. */
int gtx_index_kl(int64_t parts, int64_t n, int64_t N, int64_t J, int64_t K, int64_t d,
                 const float *iq, const float *w, const float *ik, const int32_t *keys, const uint8_t *valid,
                 const float *p, float *loss, float *diq, float *dw, float *diks) {
    if (d == 32)  /* the common index size, its loops unrolled */
        ON_PARTS(parts, index_kl(n * part / parts, n * (part + 1) / parts, J, K, 32, iq, w, ik, keys, valid, p, loss, diq, dw, diks + part * N * d));
    ON_PARTS(parts, index_kl(n * part / parts, n * (part + 1) / parts, J, K, d, iq, w, ik, keys, valid, p, loss, diq, dw, diks + part * N * d));
}
