/* Lean dropout's passes (see lean_dropout.py), float32, contiguous.
 *
 * et_dropout: ATen's CPU dropout draws, then applies, in one pass. The draws are its default Bernoulli
 *             kernel's: per element, two outputs of the generator's MT19937 (the first the high word) make
 *             a 64-bit value whose low 53 bits, times 2^-53, are compared with the keep probability. The
 *             generator's state is read from and written back to torch's serialised CPU generator state
 *             (`rng`: the_initial_seed u64, left i32, seeded i32, next u64, state u64[624], ...), so the
 *             stream continues exactly where torch's own kernel would leave it. y = x * (kept ? scale : 0),
 *             one bit per element recorded in `bits` (bit i of byte i/8).
 * et_dropout_backward: gx = g * (kept ? scale : 0); gx may be g.
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <stdint.h>
#include <string.h>

#define MT_N 624
#define MT_M 397

typedef struct {
    uint32_t s[MT_N];
    int32_t left;
    int64_t next;
} mt_t;

static inline uint32_t twist(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

static void next_state(mt_t *mt) {
    uint32_t *p = mt->s;
    mt->left = MT_N;
    mt->next = 0;
    for (int j = MT_N - MT_M + 1; --j; p++) *p = p[MT_M] ^ twist(p[0], p[1]);
    for (int j = MT_M; --j; p++) *p = p[MT_M - MT_N] ^ twist(p[0], p[1]);
    *p = p[MT_M - MT_N] ^ twist(p[0], mt->s[0]);
}

static inline uint32_t temper(uint32_t y) {
    y ^= (y >> 11);
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= (y >> 18);
    return y;
}

/* The next `count` outputs of the engine, as torch's mt19937::operator() makes them one by one: decrement
 * `left`, refill the state when it reaches 0, return the tempered word at `next`. */
static void draws(mt_t *mt, uint32_t *out, int64_t count) {
    while (count > 0) {
        int64_t take = (int64_t)mt->left - 1;  /* outputs before the decrement that refills */
        if (take > count) take = count;
        const uint32_t *src = mt->s + mt->next;
        for (int64_t i = 0; i < take; i++) out[i] = temper(src[i]);
        out += take;
        count -= take;
        mt->next += take;
        mt->left -= (int32_t)take;
        if (count > 0) {  /* this output's decrement reaches 0: refill, then state word 0 */
            next_state(mt);
            *out++ = temper(mt->s[mt->next++]);
            count--;
        }
    }
}

#define CHUNK 4096 /* elements per batch of draws (two each) */

static void load(mt_t *mt, const uint8_t *rng) {
    int32_t left;
    uint64_t next, word;
    memcpy(&left, rng + 8, 4);
    memcpy(&next, rng + 16, 8);
    for (int i = 0; i < MT_N; i++) {
        memcpy(&word, rng + 24 + 8 * (size_t)i, 8);
        mt->s[i] = (uint32_t)word;
    }
    mt->left = left;
    mt->next = (int64_t)next;
}

static void store(const mt_t *mt, uint8_t *rng) {
    const int32_t left = mt->left;
    const uint64_t next = (uint64_t)mt->next;
    memcpy(rng + 8, &left, 4);
    memcpy(rng + 16, &next, 8);
    for (int i = 0; i < MT_N; i++) {
        const uint64_t word = mt->s[i];
        memcpy(rng + 24 + 8 * (size_t)i, &word, 8);
    }
}

/* Returns 0, or -1 when the state is not one this code can continue (torch would not produce it). x and y may
 * both be NULL: the mask's bits only (a whole batch's mask, edgetrain.capture.draws). */
int et_dropout(const float *x, float *y, uint8_t *bits, int64_t n, uint8_t *rng, double keep, float scale) {
    mt_t mt;
    uint32_t buf[2 * CHUNK];
    load(&mt, rng);
    if (mt.left < 1 || mt.left > MT_N || mt.next < 0 || mt.next > MT_N || mt.next + mt.left - 1 > MT_N) return -1;
    /* u = (v & (2^53 - 1)) * 2^-53 < keep  <=>  (v & (2^53 - 1)) < ceil(keep * 2^53): scaling by 2^53 is exact.
     * v's low 53 bits are the high word's low 21 bits then the low word, so the test is a comparison of those two
     * 32-bit fields with the threshold's (half the time of the 64-bit one once vectorised). */
    const double limit = keep * 9007199254740992.0;
    const uint64_t thresh = (uint64_t)limit + ((double)(uint64_t)limit < limit ? 1u : 0u);
    const uint32_t th_hi = (uint32_t)(thresh >> 32), th_lo = (uint32_t)thresh;
    uint8_t keep_of[CHUNK];
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {  /* CHUNK is a multiple of 8: bytes of bits stay whole */
        const int64_t m = c0 + CHUNK < n ? CHUNK : n - c0;
        draws(&mt, buf, 2 * m);
        /* three simple loops the compiler vectorises: the keep flags, the product, the packed bits */
        for (int64_t i = 0; i < m; i++) {
            const uint32_t hi = buf[2 * i] & 0x1fffffu, lo = buf[2 * i + 1];
            keep_of[i] = (uint8_t)((hi < th_hi) | ((hi == th_hi) & (lo < th_lo)));
        }
        if (x != NULL && y != NULL) {
            const float *xc = x + c0;
            float *yc = y + c0;
            for (int64_t i = 0; i < m; i++) yc[i] = xc[i] * (keep_of[i] ? scale : 0.0f);
        }
        const int64_t whole = m / 8;
        for (int64_t b = 0; b < whole; b++) {
            const uint8_t *k = keep_of + 8 * b;
            bits[c0 / 8 + b] = (uint8_t)(k[0] | k[1] << 1 | k[2] << 2 | k[3] << 3 | k[4] << 4 | k[5] << 5 | k[6] << 6
                                         | k[7] << 7);
        }
        if (m % 8) {
            uint8_t byte = 0;
            for (int64_t i = 8 * whole; i < m; i++) byte |= (uint8_t)(keep_of[i] << (i - 8 * whole));
            bits[c0 / 8 + whole] = byte;
        }
    }
    store(&mt, rng);
    return 0;
}

int et_dropout_backward(const float *g, const uint8_t *bits, float *gx, int64_t n, float scale) {
    /* each byte's eight factors (scale or 0) from a table: 3-4x faster than testing the bits one by one */
    float factor[256][8];
    for (int b = 0; b < 256; b++)
        for (int j = 0; j < 8; j++) factor[b][j] = ((b >> j) & 1) ? scale : 0.0f;
    const int64_t whole = n / 8;
    for (int64_t b = 0; b < whole; b++) {
        const float *f = factor[bits[b]];
        for (int j = 0; j < 8; j++) gx[8 * b + j] = g[8 * b + j] * f[j];
    }
    for (int64_t i = 8 * whole; i < n; i++) gx[i] = g[i] * factor[bits[whole]][i - 8 * whole];
    return 0;
}
