/* A lightning indexer's top-k choice (``dsa``; q . k's for ``topk``), in float32 or on int8 queries
 * and keys (``score_i8``: AVX-512 VNNI where built for it, a portable loop elsewhere or under
 * GTX_PORTABLE), and its KL loss over the kept keys, for the CPU. Each call splits its work into `parts` of rows run on OpenMP threads
 * (``ON_PARTS``, kernel.h). Layouts as in keys_kernel.c; index queries iq (n, J, d), weights
 * w (n, J), index keys ik (N, d). */
#include "kernel.h"

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

#if defined(__AVX512F__) && !defined(GTX_PORTABLE)
#include <immintrin.h>
#define GTX_AVX512 1
#endif

/* Partitions c[lo, hi] (hi inclusive) around the pivot c[mid]: those better than it first, then it, then the
 * rest; returns its place. Branch-free, in place; on AVX-512, 8 at a time through `spare` (room for
 * hi - lo + 8), the better ones compressed forward in c, the others into spare and copied back. */
static int64_t partition(uint64_t *c, int64_t lo, int64_t hi, int64_t mid, uint64_t *spare) {
    int64_t store = lo, x = lo;
    swap(c, mid, hi);  /* the pivot, parked at hi */
    uint64_t pivot = c[hi];
#ifdef GTX_AVX512
    int64_t rest = 0;
    __m512i p = _mm512_set1_epi64((long long)pivot);
    for (; x + 8 <= hi; x += 8) {  /* whole vectors stored: at c + store they end by x + 8, lanes already read */
        __m512i v = _mm512_loadu_si512(c + x);
        __mmask8 m = _mm512_cmpgt_epu64_mask(v, p);
        _mm512_storeu_si512(c + store, _mm512_maskz_compress_epi64(m, v));
        _mm512_storeu_si512(spare + rest, _mm512_maskz_compress_epi64((__mmask8)~m, v));
        store += __builtin_popcount(m), rest += 8 - __builtin_popcount(m);
    }
    for (; x < hi; x++) {
        uint64_t y = c[x];
        c[store] = y, spare[rest] = y;
        store += y > pivot, rest += y <= pivot;
    }
    memcpy(c + store + 1, spare, sizeof(uint64_t) * rest);  /* store + rest = hi */
    c[store] = pivot;
    return store;
#else
    (void)spare;
    for (; x < hi; x++) {  /* branch-free: on random scores a branch would miss half the time */
        uint64_t y = c[x];
        c[x] = c[store], c[store] = y;
        store += y > pivot;
    }
    swap(c, store, hi);  /* [lo, store) better than the pivot, now at store */
    return store;
#endif
}

/* Reorders c[0, size) so that its best (largest) `count` come first; returns the worst score among
 * them. Quickselect (``partition``, `spare` its room); its first pivot is the element of a sample whose
 * rank in the sample matches count's in the whole, so that one or two partitions usually suffice. */
static float keep_best(uint64_t *c, int64_t size, int64_t count, uint64_t *spare) {
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
        int64_t store = partition(c, lo, hi, mid, spare);
        if (store == count - 1 || store == count) break;
        if (store < count) lo = store + 1; else hi = store - 1;
        mid = lo + (hi - lo) / 2;
    }
    uint64_t worst = UINT64_MAX;
    for (int64_t x = 0; x < count; x++) worst = c[x] < worst ? c[x] : worst;
    return candidate_score(worst);
}

#ifdef GTX_AVX512

/* Appends to c[filled ...) the candidates (``candidate``) of scores sc (keys key0 .. key0 + 15) where
 * `pass` is set, as two compressed vectors of 8 (16 slots written, whatever passes); returns the new fill. */
static inline int64_t compress_candidates(uint64_t *c, int64_t filled, __m512 sc, __mmask16 pass, int64_t key0) {
    __m512i bits = _mm512_castps_si512(sc);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(bits, _mm512_set1_epi32((int32_t)0x80000000u)),
                                 _mm512_setzero_si512());  /* -0 as +0 */
    bits = _mm512_xor_si512(bits, _mm512_or_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32((int32_t)0x80000000u)));
    __m512i keys = _mm512_add_epi32(_mm512_set1_epi32((int32_t)key0),
                                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (int half = 0; half < 2; half++) {
        __m256i b = half ? _mm512_extracti64x4_epi64(bits, 1) : _mm512_castsi512_si256(bits);
        __m256i k = half ? _mm512_extracti64x4_epi64(keys, 1) : _mm512_castsi512_si256(keys);
        __m512i both = _mm512_or_si512(_mm512_slli_epi64(_mm512_cvtepu32_epi64(b), 32), _mm512_cvtepu32_epi64(k));
        __mmask8 m = (__mmask8)(half ? pass >> 8 : pass);
        _mm512_storeu_si512(c + filled, _mm512_maskz_compress_epi64(m, both));
        filled += __builtin_popcount(m);
    }
    return filled;
}
#endif

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
#ifdef GTX_AVX512
        for (; s + 32 <= width; s += 32) {  /* 4 vectors x 32 keys: half the instructions of 8 lanes; the same sums */
            __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
            for (int64_t c = 0; c < d; c++) {
                __m512 k0 = _mm512_loadu_ps(k_t + c * TILE + s), k1 = _mm512_loadu_ps(k_t + c * TILE + s + 16);
                __m512 b0 = _mm512_set1_ps(q0[c]), b1 = _mm512_set1_ps(q1[c]), b2 = _mm512_set1_ps(q2[c]), b3 = _mm512_set1_ps(q3[c]);
                a00 = _mm512_fmadd_ps(b0, k0, a00), a01 = _mm512_fmadd_ps(b0, k1, a01);
                a10 = _mm512_fmadd_ps(b1, k0, a10), a11 = _mm512_fmadd_ps(b1, k1, a11);
                a20 = _mm512_fmadd_ps(b2, k0, a20), a21 = _mm512_fmadd_ps(b2, k1, a21);
                a30 = _mm512_fmadd_ps(b3, k0, a30), a31 = _mm512_fmadd_ps(b3, k1, a31);
            }
            _mm512_storeu_ps(o + s, a00), _mm512_storeu_ps(o + s + 16, a01);
            _mm512_storeu_ps(o + width + s, a10), _mm512_storeu_ps(o + width + s + 16, a11);
            _mm512_storeu_ps(o + 2 * width + s, a20), _mm512_storeu_ps(o + 2 * width + s + 16, a21);
            _mm512_storeu_ps(o + 3 * width + s, a30), _mm512_storeu_ps(o + 3 * width + s + 16, a31);
        }
#endif
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

/* Index scores of `rows` query rows against a tile of int8 keys (``index_precision=int8``): queries and
 * keys quantised per token, q = sq * q8, k = sk * k8 (symmetric, |q8|, |k8| <= 127), so that
 * I(t, s) = sk(s) sum_a wq(t, a) f(q8(t, a) . k8(s)) with wq = w sq (the scales are positive: they pass
 * the relu). q8 (rows, J, dp) int8, wq (rows, J); the tile k (dp / 4, TILE, 4) holds k8 + 128 as bytes,
 * the layout of VNNI's unsigned-by-signed dot products of 4 bytes, whose offset each query row takes
 * back as 128 sum(q8); ks the tile's key scales (TILE, zero-padded). out (rows, TILE): the first
 * `width` scores of each row (more may be written). Dot products are exact in int32 (|.| < 2^31 for
 * dp < 2^17), so that every build scores alike up to the float epilogue's rounding. */
#if defined(__AVX512VNNI__) && defined(GTX_AVX512)
#define GTX_INT8 "avx512-vnni"
static void score_i8(float *out, const int8_t *q8, const float *wq, int64_t rows, int64_t J, int64_t dp,
                     const uint8_t *k, const float *ks, int64_t width, int64_t relu) {
    int64_t runs = (width + 63) / 64;  /* runs of 4 x 16 keys: 4 independent chains (a tile has TILE, padded) */
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + r * TILE;
        for (int64_t a = 0; a < J; a++) {
            const int8_t *q = q8 + (r * J + a) * dp;
            int32_t offset = 0, q4;
            for (int64_t c = 0; c < dp; c++) offset += q[c];
            __m512 wv = _mm512_set1_ps(wq[r * J + a]);
            for (int64_t run = 0; run < runs; run++) {
                __m512i a0 = _mm512_set1_epi32(-128 * offset), a1 = a0, a2 = a0, a3 = a0;  /* named: GCC kept an array in memory */
                for (int64_t c = 0; c < dp / 4; c++) {
                    memcpy(&q4, q + 4 * c, 4);
                    __m512i qb = _mm512_set1_epi32(q4);
                    const uint8_t *kc = k + (c * TILE + run * 64) * 4;
                    a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(kc), qb);
                    a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(kc + 64), qb);
                    a2 = _mm512_dpbusd_epi32(a2, _mm512_loadu_si512(kc + 128), qb);
                    a3 = _mm512_dpbusd_epi32(a3, _mm512_loadu_si512(kc + 192), qb);
                }
                __m512i acc[4] = {a0, a1, a2, a3};
                for (int x = 0; x < 4; x++) {
                    __m512i v = relu ? _mm512_max_epi32(acc[x], _mm512_setzero_si512()) : acc[x];
                    __m512 f = _mm512_cvtepi32_ps(v);
                    float *at = o + run * 64 + 16 * x;
                    f = a ? _mm512_fmadd_ps(wv, f, _mm512_loadu_ps(at)) : _mm512_mul_ps(wv, f);
                    _mm512_storeu_ps(at, f);
                }
            }
        }
        for (int64_t s = 0; s < runs * 64; s += 16) _mm512_storeu_ps(o + s, _mm512_mul_ps(_mm512_loadu_ps(o + s), _mm512_loadu_ps(ks + s)));
    }
}
#else
#define GTX_INT8 "portable"
static void score_i8(float *out, const int8_t *q8, const float *wq, int64_t rows, int64_t J, int64_t dp,
                     const uint8_t *k, const float *ks, int64_t width, int64_t relu) {
    int32_t acc[TILE];
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + r * TILE;
        for (int64_t a = 0; a < J; a++) {
            const int8_t *q = q8 + (r * J + a) * dp;
            int32_t offset = 0;
            for (int64_t c = 0; c < dp; c++) offset += q[c];
            for (int64_t s = 0; s < width; s++) acc[s] = -128 * offset;
            for (int64_t c = 0; c < dp; c++) {
                const uint8_t *kc = k + (c / 4 * TILE) * 4 + c % 4;
                int32_t qc = q[c];
                for (int64_t s = 0; s < width; s++) acc[s] += qc * kc[4 * s];
            }
            float wa = wq[r * J + a];
            for (int64_t s = 0; s < width; s++) {
                float f = (float)(relu && acc[s] < 0 ? 0 : acc[s]);
                o[s] = a ? o[s] + wa * f : wa * f;
            }
        }
        for (int64_t s = 0; s < width; s++) o[s] *= ks[s];
    }
}
#endif

/* Which int8 scoring this build has: "avx512-vnni" or "portable". */
const char *gtx_int8_kind(void) { return GTX_INT8; }

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
                     const void *iq, const float *w, const void *ik_tiles, const float *k_scale, int64_t causal,
                     int64_t relu, int64_t count, int64_t offset, int32_t *keys, uint8_t *valid) {
    float *dots = malloc(sizeof(float) * GROUP * (k_scale ? 1 : J) * TILE);
    int64_t cap = CANDIDATES * count < MIN_CANDIDATES ? MIN_CANDIDATES : CANDIDATES * count;
    uint64_t *cands = malloc(sizeof(uint64_t) * GROUP * cap), *spare = malloc(sizeof(uint64_t) * (cap + 8));
    if (!dots || !cands || !spare) return free(dots), free(cands), free(spare), 1;
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
            if (k_scale)
                score_i8(dots, (const int8_t *)iq + g0 * J * d, w + g0 * J, rows, J, d,
                         (const uint8_t *)ik_tiles + s0 * d, k_scale + s0, width, relu);
            else
                tile_dots(dots, (const float *)iq + g0 * J * d, rows * J, (const float *)ik_tiles + s0 * d, d, width);
            for (int64_t r = 0; r < rows; r++) {
                float *row = dots + r * (k_scale ? TILE : J * width);
                uint64_t *cand = cands + r * cap;
                if (!k_scale) {
                    for (int64_t s = 0; s < width; s++) row[s] = w[(g0 + r) * J] * (row[s] > 0.0f || !relu ? row[s] : 0.0f);
                    for (int64_t a = 1; a < J; a++) {
                        const float *da = row + a * width, wa = w[(g0 + r) * J + a];
                        for (int64_t s = 0; s < width; s++) row[s] += wa * (da[s] > 0.0f || !relu ? da[s] : 0.0f);
                    }
                }
                int64_t filled = size[r];
                for (int64_t hi = seen[r] - s0 < width ? seen[r] - s0 : width; hi > 0; hi -= 16) {
                    int64_t lo = hi > 16 ? hi - 16 : 0, any = 0;
                    uint64_t packed[16];
#ifdef GTX_AVX512
                    if (hi - lo == 16) {  /* the passing candidates of 16, compressed into the buffer: no loop over them */
                        __m512 sc = _mm512_loadu_ps(row + lo);
                        __mmask16 pass = _mm512_cmp_ps_mask(sc, _mm512_set1_ps(bar[r]), _CMP_GT_OQ);
                        if (!pass) continue;
                        if (filled + 16 > cap) {  /* room for 16 (whole vectors are stored): select first */
                            bar[r] = keep_best(cand, filled, count, spare), filled = count;
                            pass = _mm512_cmp_ps_mask(sc, _mm512_set1_ps(bar[r]), _CMP_GT_OQ);
                        }
                        filled = compress_candidates(cand, filled, sc, pass, s0 + lo);
                        continue;
                    }
#endif
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
                        if (filled == cap) bar[r] = keep_best(cand, filled, count, spare), filled = count;
                    }
                }
                size[r] = filled;
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            uint64_t *cand = cands + r * cap;
            int64_t t = g0 + r;
            if (size[r] > count) keep_best(cand, size[r], count, spare), size[r] = count;
            for (int64_t j = 0; j < count; j++) {
                valid[t * count + j] = j < size[r];
                keys[t * count + j] = j < size[r] ? (int64_t)(uint32_t)cand[j] + offset : 0;
            }
        }
    }
    free(dots), free(cands), free(spare);
    return 0;
}

int gtx_top_index(int64_t parts, int64_t n, int64_t nk, int64_t J, int64_t d,
                  const float *iq, const float *w, const float *ik_tiles, int64_t causal, int64_t relu,
                  int64_t count, int64_t offset, int32_t *keys, uint8_t *valid) {
    ON_PARTS(parts, top_index(part, parts, n, nk, J, d, iq, w, ik_tiles, NULL, causal, relu, count, offset, keys, valid));
}

/* gtx_top_index on int8 queries and keys (``score_i8``): iq8 (n, J, dp) int8, wq (n, J) the weights
 * times the queries' scales, ik8_tiles (ceil(nk / TILE), dp / 4, TILE, 4) the keys plus 128 as bytes,
 * k_scale (ceil(nk / TILE) * TILE) the keys' scales, zero-padded; dp a multiple of 4. */
int gtx_top_index_i8(int64_t parts, int64_t n, int64_t nk, int64_t J, int64_t dp,
                     const int8_t *iq8, const float *wq, const uint8_t *ik8_tiles, const float *k_scale,
                     int64_t causal, int64_t relu, int64_t count, int64_t offset, int32_t *keys, uint8_t *valid) {
    ON_PARTS(parts, top_index(part, parts, n, nk, J, dp, iq8, wq, ik8_tiles, k_scale, causal, relu, count, offset, keys, valid));
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
        for (int64_t a = 0; a < J; a++) slot_dots(dots + a * K, qt + a * d, ik, key, 0, 1, K, d);
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
