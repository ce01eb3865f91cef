/* Attention where each query reads one contiguous range of keys of its own sample, for the CPU
 * (``gtx.backends.packed``: short samples, complete or causal, and windows over them): the keys read
 * where they lie, no padded copy. A call's work is split into units (a sample's tiles, below, or a
 * whole sample) dealt to `parts` OpenMP threads (``ON_PARTS``); each output row, and each row of dq,
 * dk and dv, is written by one unit alone, so no part adds into another's rows and the results are
 * the same on any number of threads.
 *
 * Layouts (float32, row-major, contiguous): q (n, H, D), k (N, H, D), v (N, H, E), out and grad
 * (n, H, E), lse and delta (n, H). spans (S, 4) int64: per sample its first query row, its queries,
 * its first key row, its keys. ranges (n, 2) int64: per query its first key and one past its last,
 * within its sample's keys (an empty range: output 0, lse -inf). q arrives scaled: a score is q . k. */
#include "kernel.h"

/* The largest key count of the S samples: their scratch. */
static int64_t widest(const int64_t *spans, int64_t S) {
    int64_t most = 1;
    for (int64_t s = 0; s < S; s++) most = spans[4 * s + 3] > most ? spans[4 * s + 3] : most;
    return most;
}

/* Key ids k0 .. k0 + m - 1 (and, where ok is given, m slots marked valid): a sample's keys as the
 * slots of query_forward and query_keys, a query's range a run of them. */
static void key_range(int32_t *ids, uint8_t *ok, int64_t k0, int64_t m) {
    for (int64_t j = 0; j < m; j++) ids[j] = (int32_t)(k0 + j);
    if (ok) memset(ok, 1, (size_t)m);
}

/* Tiles: where a sample's ranges move forward with its queries (first and last keys never decrease,
 * as in complete and causal samples and windows over them) and head sizes are multiples of 16 up to
 * MAX_DIM, the sample runs in tiles of T consecutive queries (the forward, dq) or keys (dk, dv), a
 * vector lane each: a tile reads the union of its queries' ranges once for all T of them, each key row
 * a broadcast into T lanes, and a lane's scores outside its own range are masked. The backward is two
 * passes that recompute the weights from lse: query tiles write their dq rows, key tiles their dk and
 * dv rows, each row by one tile, so tiles run on any thread in any order (no shared row, no copy
 * per thread) and the result is the same on any number of threads. */
#define T 16
#define KB 8 /* keys (dq pass) or queries (dk, dv pass) scored at once: their two vectors each stay in registers */
#define MIN_TILED 48 /* queries: shorter samples fill their tiles' lanes too sparsely and run faster query by query */

static int tiled(const int64_t *span, const int64_t *ranges, int64_t D, int64_t E) {
    if (span[1] < MIN_TILED || D % T || E % T || D > MAX_DIM || E > MAX_DIM) return 0;
    for (int64_t i = span[0] + 1; i < span[0] + span[1]; i++)
        if (ranges[2 * i] < ranges[2 * i - 2] || ranges[2 * i + 1] < ranges[2 * i - 1]) return 0;
    return 1;
}

/* a where `mask` (lanes of -1 or 0) is set, else b */
static inline v16 where(v16i mask, v16 a, v16 b) { return (v16)(((v16i)a & mask) | ((v16i)b & ~mask)); }

#define UNROLL _Pragma("GCC unroll 16") /* a tile's vectors stay in registers only where their loop is unrolled */

/* rows [r0, r0 + nt) of x (rows of stride H * d, head h) transposed into xt (d, T), lanes past nt zero */
static void transposed(float *xt, const float *x, int64_t r0, int64_t nt, int64_t h, int64_t H, int64_t d) {
    for (int64_t c = 0; c < d; c++)
        for (int64_t l = 0; l < T; l++) xt[c * T + l] = l < nt ? x[((r0 + l) * H + h) * d + c] : 0.0f;
}

/* transposed's inverse: lanes [0, nt) of xt (d, T) written to rows [r0, r0 + nt) of x (head h) */
static void untransposed(float *x, const float *xt, int64_t r0, int64_t nt, int64_t h, int64_t H, int64_t d) {
    for (int64_t l = 0; l < nt; l++)
        for (int64_t c = 0; c < d; c++) x[((r0 + l) * H + h) * d + c] = xt[c * T + l];
}

/* rows r0 .. r0 + count - 1 of x (head h; those past `last` as row `last`) copied into xr (count, d):
 * contiguous, so that a tile's loops address them at fixed offsets from one register */
static inline void rows_of(float *xr, const float *x, int64_t r0, int64_t count, int64_t last, int64_t h, int64_t H, int64_t d) {
    for (int64_t y = 0; y < count; y++) memcpy(xr + y * d, x + ((r0 + y < last ? r0 + y : last) * H + h) * d, sizeof(float) * d);
}

/* the lanes' ranges (lanes past nt: empty) */
static void lane_ranges(v16i *lo, v16i *hi, const int64_t *ranges, int64_t i0, int64_t nt) {
    for (int64_t l = 0; l < T; l++) (*lo)[l] = l < nt ? (int32_t)ranges[2 * (i0 + l)] : 0, (*hi)[l] = l < nt ? (int32_t)ranges[2 * (i0 + l) + 1] : 0;
}

/* s[y] = the lanes' a (d, T) against row y of xr (W, d), y < W: summed 32 dimensions at a time, then
 * those sums (one chain of 128 products rounded heads of 128 past the tests' float64 tolerance) */
#define LANE_DOTS(s, a, xr, d, W)                                                                      \
    do {                                                                                               \
        UNROLL for (int64_t y = 0; y < (W); y++) s[y] = (v16){0};                                      \
        for (int64_t c0 = 0; c0 < (d); c0 += 32) {                                                     \
            v16 part_[W];                                                                              \
            UNROLL for (int64_t y = 0; y < (W); y++) part_[y] = (v16){0};                              \
            for (int64_t c = c0; c < c0 + 32 && c < (d); c++) {                                        \
                v16 ac = load16((a) + c * T);                                                          \
                UNROLL for (int64_t y = 0; y < (W); y++) part_[y] += (xr)[y * (d) + c] * ac;           \
            }                                                                                          \
            UNROLL for (int64_t y = 0; y < (W); y++) s[y] += part_[y];                                 \
        }                                                                                              \
    } while (0)

/* acc (d, T) in memory += sum over y < W of xr[y] (W, d) times lanes s[y] (after acc *= scale) */
#define LANE_ADD(acc, xr, s, d, W, scale)                                                              \
    do {                                                                                               \
        for (int64_t c = 0; c < (d); c++) {                                                            \
            v16 a_ = load16((acc) + c * T) * (scale);                                                  \
            UNROLL for (int64_t y = 0; y < (W); y++) a_ += (xr)[y * (d) + c] * s[y];                   \
            memcpy((acc) + c * T, &a_, sizeof a_);                                                     \
        }                                                                                              \
    } while (0)

static inline __attribute__((always_inline)) void tile_forward(int64_t i0, int64_t nt, int64_t h, const int64_t *ranges,
                                                               int64_t H, int64_t D, int64_t E, const float *q,
                                                               const float *k, const float *v, float *out, float *lse) {
    float qt[MAX_DIM * T], ot[MAX_DIM * T], kr[T * MAX_DIM], vr[T * MAX_DIM];
    v16i lo, hi;
    transposed(qt, q, i0, nt, h, H, D);
    lane_ranges(&lo, &hi, ranges, i0, nt);
    memset(ot, 0, sizeof(float) * E * T);
    int64_t first = ranges[2 * i0], last = ranges[2 * (i0 + nt - 1) + 1];
    v16 m = (v16){0} - INFINITY, l = {0};
    for (int64_t j0 = first; j0 < last; j0 += T) {
        v16 s[T], top = m;
        rows_of(kr, k, j0, T, last - 1, h, H, D);
        rows_of(vr, v, j0, T, last - 1, h, H, E);
        LANE_DOTS(s, qt, kr, D, T);
        UNROLL for (int64_t y = 0; y < T; y++) {
            s[y] = where(((int32_t)(j0 + y) >= lo) & ((int32_t)(j0 + y) < hi), s[y], (v16){0} - INFINITY);
            top = where(s[y] > top, s[y], top);
        }
        v16 shift = where(top > -INFINITY, top, (v16){0}), scale = exp16(m - shift);  /* a lane without keys yet: 0 */
        l *= scale;
        UNROLL for (int64_t y = 0; y < T; y++) s[y] = exp16(s[y] - shift), l += s[y];
        LANE_ADD(ot, vr, s, E, T, scale);
        m = top;
    }
    for (int64_t x = 0; x < nt; x++) {
        float lx = l[x], *o = out + ((i0 + x) * H + h) * E;
        for (int64_t e = 0; e < E; e++) o[e] = lx > 0.0f ? ot[e * T + x] / lx : 0.0f;
        lse[(i0 + x) * H + h] = lx > 0.0f ? m[x] + logf(lx) : -INFINITY;
    }
}

static inline __attribute__((always_inline)) void tile_dq(int64_t i0, int64_t nt, int64_t h, const int64_t *ranges,
                                                          int64_t H, int64_t D, int64_t E, const float *q, const float *k,
                                                          const float *v, const float *grad, const float *lse,
                                                          const float *delta, float *dq) {
    float qt[MAX_DIM * T], gt[MAX_DIM * T], dqt[MAX_DIM * T], kr[KB * MAX_DIM], vr[KB * MAX_DIM];
    v16i lo, hi;
    v16 l = {0}, dl = {0};
    transposed(qt, q, i0, nt, h, H, D);
    transposed(gt, grad, i0, nt, h, H, E);
    lane_ranges(&lo, &hi, ranges, i0, nt);
    for (int64_t x = 0; x < nt; x++) l[x] = lse[(i0 + x) * H + h] > -INFINITY ? lse[(i0 + x) * H + h] : 0.0f, dl[x] = delta[(i0 + x) * H + h];
    memset(dqt, 0, sizeof(float) * D * T);
    int64_t first = ranges[2 * i0], last = ranges[2 * (i0 + nt - 1) + 1];
    for (int64_t j0 = first; j0 < last; j0 += KB) {
        v16 p[KB], dp[KB];
        rows_of(kr, k, j0, KB, last - 1, h, H, D);
        rows_of(vr, v, j0, KB, last - 1, h, H, E);
        LANE_DOTS(p, qt, kr, D, KB);
        LANE_DOTS(dp, gt, vr, E, KB);
        UNROLL for (int64_t y = 0; y < KB; y++) {
            v16i in = ((int32_t)(j0 + y) >= lo) & ((int32_t)(j0 + y) < hi);
            p[y] = where(in, exp16(p[y] - l), (v16){0});
            dp[y] = p[y] * (dp[y] - dl);  /* d loss / d score */
        }
        LANE_ADD(dqt, kr, dp, D, KB, 1.0f);
    }
    untransposed(dq, dqt, i0, nt, h, H, D);
}

/* keys j0 .. j0 + nt - 1 of a sample whose queries are rows [a, b) (their ranges move forward): the
 * queries that read any of them, [from, to) */
static void readers(const int64_t *ranges, int64_t a, int64_t b, int64_t j0, int64_t nt, int64_t *from, int64_t *to) {
    int64_t x = a, y = b;
    while (x < y) {  /* the first query whose range ends past j0 */
        int64_t mid = (x + y) / 2;
        if (ranges[2 * mid + 1] > j0) y = mid; else x = mid + 1;
    }
    *from = x, y = b;
    while (x < y) {  /* the first one whose range starts at or past the tile's end */
        int64_t mid = (x + y) / 2;
        if (ranges[2 * mid] >= j0 + nt) y = mid; else x = mid + 1;
    }
    *to = x;
}

static inline __attribute__((always_inline)) void tile_dkv(int64_t j0, int64_t nt, int64_t a, int64_t b, int64_t h,
                                                           const int64_t *ranges, int64_t H, int64_t D, int64_t E,
                                                           const float *q, const float *k, const float *v,
                                                           const float *grad, const float *lse, const float *delta,
                                                           float *dk, float *dv) {
    float kt[MAX_DIM * T], vt[MAX_DIM * T], dkt[MAX_DIM * T], dvt[MAX_DIM * T], qr[KB * MAX_DIM], gr[KB * MAX_DIM];
    int64_t from, to;
    readers(ranges, a, b, j0, nt, &from, &to);
    transposed(kt, k, j0, nt, h, H, D);
    transposed(vt, v, j0, nt, h, H, E);
    memset(dkt, 0, sizeof(float) * D * T), memset(dvt, 0, sizeof(float) * E * T);
    v16i key;
    for (int64_t l = 0; l < T; l++) key[l] = (int32_t)(l < nt ? j0 + l : -1);  /* -1: in no range */
    for (int64_t i0 = from; i0 < to; i0 += KB) {
        v16 p[KB], ds[KB];
        rows_of(qr, q, i0, KB, to - 1, h, H, D);
        rows_of(gr, grad, i0, KB, to - 1, h, H, E);
        LANE_DOTS(p, kt, qr, D, KB);
        LANE_DOTS(ds, vt, gr, E, KB);
        UNROLL for (int64_t y = 0; y < KB; y++) {
            int64_t i = i0 + y < to ? i0 + y : to - 1;  /* a repeated row is masked out */
            v16i in = i0 + y < to ? (key >= (int32_t)ranges[2 * i]) & (key < (int32_t)ranges[2 * i + 1]) : (v16i){0};
            p[y] = where(in, exp16(p[y] - lse[i * H + h]), (v16){0});  /* a query in range has a key: its lse is finite */
            ds[y] = p[y] * (ds[y] - delta[i * H + h]);
        }
        LANE_ADD(dvt, gr, p, E, KB, 1.0f);
        LANE_ADD(dkt, qr, ds, D, KB, 1.0f);
    }
    untransposed(dk, dkt, j0, nt, h, H, D);
    untransposed(dv, dvt, j0, nt, h, H, E);
}

/* Work units are dealt to the parts in turn (unit u to part u % parts: later causal tiles cost more):
 * per sample either its tiles (``tiled``) or the whole sample, query by query (query_forward,
 * query_keys). Whether the next unit, counted in u, is this part's: */
static inline int mine(int64_t *u, int64_t part, int64_t parts) { return (*u)++ % parts == part; }

static inline __attribute__((always_inline)) int packed_forward(int64_t part, int64_t parts, int64_t S, const int64_t *spans,
                                                                const int64_t *ranges, int64_t H, int64_t D, int64_t E,
                                                                const float *q, const float *k, const float *v,
                                                                float *out, float *lse) {
    int64_t most = widest(spans, S), u = 0;
    float *p = malloc(sizeof(float) * H * most);
    int32_t *ids = malloc(sizeof(int32_t) * most);
    uint8_t *ok = malloc(most);
    if (!p || !ids || !ok) return free(p), free(ids), free(ok), 1;
    for (int64_t s = 0; s < S; s++) {
        const int64_t *span = spans + 4 * s;
        int64_t end = span[0] + span[1];
        if (tiled(span, ranges, D, E)) {
            for (int64_t i0 = span[0]; i0 < end; i0 += T)
                if (mine(&u, part, parts))
                    for (int64_t h = 0; h < H; h++) tile_forward(i0, end - i0 < T ? end - i0 : T, h, ranges, H, D, E, q, k, v, out, lse);
            continue;
        }
        if (!mine(&u, part, parts)) continue;
        key_range(ids, ok, span[2], span[3]);
        for (int64_t i = span[0]; i < end; i++) {
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
        ON_PARTS(parts, packed_forward(part, parts, S, spans, ranges, H, 32, 32, q, k, v, out, lse));
    ON_PARTS(parts, packed_forward(part, parts, S, spans, ranges, H, D, E, q, k, v, out, lse));
}

static inline __attribute__((always_inline)) int packed_backward(int64_t part, int64_t parts, int64_t S, const int64_t *spans,
                                                                 const int64_t *ranges, int64_t H, int64_t D, int64_t E,
                                                                 const float *q, const float *k, const float *v,
                                                                 const float *grad, const float *lse, const float *delta,
                                                                 float *dq, float *dk, float *dv) {
    int32_t *ids = malloc(sizeof(int32_t) * widest(spans, S));
    int64_t u = 0;
    if (!ids) return 1;
    for (int64_t s = 0; s < S; s++) {
        const int64_t *span = spans + 4 * s;
        int64_t end = span[0] + span[1], keys_end = span[2] + span[3];
        if (tiled(span, ranges, D, E)) {
            for (int64_t i0 = span[0]; i0 < end; i0 += T)
                if (mine(&u, part, parts))
                    for (int64_t h = 0; h < H; h++)
                        tile_dq(i0, end - i0 < T ? end - i0 : T, h, ranges, H, D, E, q, k, v, grad, lse, delta, dq);
            for (int64_t j0 = span[2]; j0 < keys_end; j0 += T)
                if (mine(&u, part, parts))
                    for (int64_t h = 0; h < H; h++)
                        tile_dkv(j0, keys_end - j0 < T ? keys_end - j0 : T, span[0], end, h, ranges, H, D, E, q, k, v, grad, lse,
                                 delta, dk, dv);
            continue;
        }
        if (!mine(&u, part, parts)) continue;
        key_range(ids, NULL, span[2], span[3]);
        for (int64_t i = span[0]; i < end; i++) {
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
        ON_PARTS(parts, packed_backward(part, parts, S, spans, ranges, H, 32, 32, q, k, v, grad, lse, delta, dq, dk, dv));
    ON_PARTS(parts, packed_backward(part, parts, S, spans, ranges, H, D, E, q, k, v, grad, lse, delta, dq, dk, dv));
}
