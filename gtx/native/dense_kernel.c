/* The element-wise steps of the indexer's dense KL (``dense_index_kl``) for one block of query rows,
 * for the CPU: the products around it (q . k per head, the index dots, and the gradients' products
 * with the keys) stay with torch's matrix products. Plain loops over a row's columns that the compiler
 * vectorizes (exp_approx, log_approx: no calls), the same code on every CPU. A call is one block on the
 * calling thread: dense_index_kl runs blocks side by side, one per torch thread. */
#include "kernel.h"

#define CHUNK 512 /* columns at a time where a row's heads are summed: the chunk's rows stay in L1 */

/* ln x for normal x > 0 (the caller clamps at 1e-30): x = m 2^e with m in [sqrt(1/2), sqrt(2)), e and
 * m from x's bits by integer steps alone (a select there has GCC evaluate the polynomial on both
 * sides), then Cephes' logf polynomial in m - 1 and e ln 2 in two parts; plain arithmetic, so that
 * loops of it vectorize (glibc's logf is a call per element). */
static inline float log_approx(float x) {
    int32_t bits;
    memcpy(&bits, &x, sizeof bits);
    int32_t above = bits - 0x3f3504f3;  /* sqrt(1/2)'s bits: above >> 23 is floor(log2(x / sqrt(1/2))) */
    float e = (float)(above >> 23);
    bits -= above & (int32_t)0xff800000;  /* x / 2^e */
    float m;
    memcpy(&m, &bits, sizeof m);
    float f = m - 1.0f, z = f * f;
    float y = ((((((((7.0376836292e-2f * f - 1.1514610310e-1f) * f + 1.1676998740e-1f) * f - 1.2420140846e-1f) * f
                   + 1.4249322787e-1f) * f - 1.6668057665e-1f) * f + 2.0000714765e-1f) * f - 2.4999993993e-1f) * f
               + 3.3333331174e-1f) * f * z;
    return f + (y - 2.12194440e-4f * e - 0.5f * z) + 0.693359375f * e;
}

/* The largest of x[0 .. n), n > 0: the maxima of 4 x 8 lanes by masks (GCC keeps a running maximum's
 * comparisons, not associative where NaNs may be, scalar), 4 so that no comparison waits on the last. */
static inline float max_of(const float *x, int64_t n) {
    v8 lane[4];
    for (int64_t a = 0; a < 4; a++) lane[a] = load8((float[8]){x[0], x[0], x[0], x[0], x[0], x[0], x[0], x[0]});
    int64_t c = 0;
    for (; c + 32 <= n; c += 32)
        for (int64_t a = 0; a < 4; a++) {
            v8 y = load8(x + c + 8 * a);
            v8i more = y > lane[a];
            lane[a] = (v8)(((v8i)y & more) | ((v8i)lane[a] & ~more));
        }
    float most = x[0];
    for (int64_t a = 0; a < 4; a++)
        for (int64_t l = 0; l < 8; l++) most = lane[a][l] > most ? lane[a][l] : most;
    for (; c < n; c++) most = x[c] > most ? x[c] : most;
    return most;
}

/* One block of `rows` query rows against `cols` columns (keys, or blocks of `size` keys); row i, the
 * sample's query r0 + i, sees columns 0 .. (r0 + i) / size (those after it are left unread).
 * s: heads > 0: (heads, rows, cols) each head's exp argument, q . k - lse - log H, so that the head-mean
 * attention p = sum over heads of e^s (written over head 0); heads == 0: p itself (rows, cols).
 * dots (rows, J, cols): iq . k per index head in, d loss / d dots out (0 where a column is unseen); w
 * (rows, J). With I = sum_j w_j relu(dots_j): loss[i] = sum_c p (log p - log softmax(I)_c) over the
 * seen columns, dw (rows, J) its gradient. Returns 1 where it could not allocate. */
int gtx_dense_fit(int64_t rows, int64_t cols, int64_t heads, int64_t J, int64_t r0, int64_t size, float *restrict s,
                  const float *restrict w, float *restrict dots, float *restrict loss, float *restrict dw) {
    float *logits = malloc(sizeof(float) * (cols > 0 ? cols : 1));
    if (!logits) return 1;
    for (int64_t i = 0; i < rows; i++) {
        int64_t seen = (r0 + i) / size + 1;
        seen = seen < cols ? seen : cols;
        float *restrict p = s + i * cols;
        float *restrict row_dots = dots + i * J * cols;
        const float *wi = w + i * J;
        float top = -INFINITY, mass = 0.0f, plogp = 0.0f;
        for (int64_t c0 = 0; c0 < seen; c0 += CHUNK) {  /* p, the logits, their max and p's sums */
            int64_t c1 = c0 + CHUNK < seen ? c0 + CHUNK : seen;
            if (heads > 0) {
                for (int64_t c = c0; c < c1; c++) p[c] = exp_approx(p[c]);
                for (int64_t h = 1; h < heads; h++) {
                    const float *sh = s + (h * rows + i) * cols;
                    for (int64_t c = c0; c < c1; c++) p[c] += exp_approx(sh[c]);
                }
            }
            for (int64_t c = c0; c < c1; c++) logits[c] = 0.0f;
            for (int64_t j = 0; j < J; j++) {
                const float *dj = row_dots + j * cols;
                float wj = wi[j];
                for (int64_t c = c0; c < c1; c++) logits[c] += wj * (dj[c] > 0.0f ? dj[c] : 0.0f);
            }
            for (int64_t c = c0; c < c1; c++) {  /* p = 0 (underflow) adds 0: log of the clamped p is finite */
                float pc = p[c];
                mass += pc;
                plogp += pc * (log_approx(pc > 1e-30f ? pc : 1e-30f) - logits[c]);
            }
            float most = max_of(logits + c0, c1 - c0);
            top = most > top ? most : top;
        }
        float sum = 0.0f;
        for (int64_t c = 0; c < seen; c++) {
            logits[c] = exp_approx(logits[c] - top);
            sum += logits[c];
        }
        loss[i] = plogp + mass * (top + logf(sum));
        float scale = mass / sum;
        for (int64_t c = 0; c < seen; c++) logits[c] = logits[c] * scale - p[c];  /* d loss / d I */
        for (int64_t j = 0; j < J; j++) {
            float *restrict dj = row_dots + j * cols, wj = wi[j], g = 0.0f;
            for (int64_t c = 0; c < seen; c++) {  /* through the relu: where the dot is positive */
                float x = dj[c] > 0.0f ? logits[c] : 0.0f;
                g += x * dj[c];
                dj[c] = wj * x;
            }
            for (int64_t c = seen; c < cols; c++) dj[c] = 0.0f;
            dw[i * J + j] = g;
        }
    }
    free(logits);
    return 0;
}
