/* Dropout on the CPU by a counter-based generator: element i of a call with seed s is kept when
 * 16-bit lane i % 4 of word(s, i / 4) is at least ``threshold`` (keep probability exact to 1/65536),
 * where word(s, w) is SplitMix64's output for the counter w + 1: its finaliser applied to
 * s + (w + 1) * 0x9E3779B97F4A7C15, lanes in little-endian order. A mask is a function of (s, i)
 * alone: the backward draws the same one again from the seed instead of keeping it, and the parts a
 * call is split into (threads) do not change it. */
#include <stdint.h>
#include <string.h>

#define GAMMA 0x9E3779B97F4A7C15ull
#define WORDS 256 /* random words drawn per pass over a stretch: lanes stay in L1 */

static inline uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* words [w0, w1): elements [4 w0, min(4 w1, n)) */
static void mask(int64_t w0, int64_t w1, int64_t n, const float *x, float *out, uint64_t seed, uint32_t threshold,
                 float scale) {
    uint16_t lanes[4 * WORDS];
    for (int64_t b = w0; b < w1; b += WORDS) {
        int64_t e = b + WORDS < w1 ? b + WORDS : w1;
        for (int64_t w = b; w < e; w++) {
            uint64_t z = mix(seed + (uint64_t)(w + 1) * GAMMA);
            memcpy(lanes + 4 * (w - b), &z, sizeof z);
        }
        int64_t i0 = 4 * b, i1 = 4 * e < n ? 4 * e : n;
        for (int64_t i = i0; i < i1; i++) out[i] = lanes[i - i0] >= threshold ? x[i] * scale : 0.0f;
    }
}

/* out (n,) = x (n,) times scale where kept, else 0; x and out may be the same. */
int gtx_dropout(int64_t parts, int64_t n, const float *x, float *out, uint64_t seed, int64_t threshold, float scale) {
    int64_t words = (n + 3) / 4;
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int64_t part = 0; part < parts; part++)
        mask(words * part / parts, words * (part + 1) / parts, n, x, out, seed, (uint32_t)threshold, scale);
    return 0;
}
