/* Lean BatchNorm's memory-bound passes (see lean_bn.py), float32, layout [N, C, S] contiguous.
 *
 * et_bn_act:  y = act(z) and the activation's gradient mask, one bit per element (bit i of byte i/8).
 * et_bn_backward: per channel, sum(g) and sum((x - mean) * g) with g = gy masked (in double), the
 *             weight and bias gradients, and out = ((g - gmean) - (x - mean) * k) * scale; out may be x
 *             (each element is read before it is written).
 * act: 0 none (no mask), 1 relu (mask y > 0), 2 hardtanh (mask lo < y < hi).
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>

/* 8 lanes, all ones where bit j of byte is set */
static inline __m256 lanes_of(uint8_t byte) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i b = _mm256_and_si256(_mm256_set1_epi32(byte), sel);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, sel));
}
#endif

#define LANES 16

static inline float masked(const float *gy, const uint8_t *bits, int64_t k) {
    if (!bits) return gy[k];
    return ((bits[k >> 3] >> (k & 7)) & 1) ? gy[k] : 0.0f;
}

int et_bn_act(const float *z, float *y, uint8_t *bits, int64_t n, int act, float lo, float hi, int threads) {
    int64_t bytes = (n + 7) / 8;
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < bytes; b++) {
        uint8_t byte = 0;
        int64_t i0 = b * 8, i1 = i0 + 8 < n ? i0 + 8 : n;
#ifdef __AVX2__
        if (i1 - i0 == 8) {
            __m256 v = _mm256_loadu_ps(z + i0), o, m;
            if (act == 1) {  /* max(v, 0) with v's NaN kept: blend where v < 0 */
                o = _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
                m = _mm256_cmp_ps(o, _mm256_setzero_ps(), _CMP_GT_OQ);
            } else {
                const __m256 l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
                o = _mm256_blendv_ps(v, l, _mm256_cmp_ps(v, l, _CMP_LT_OQ));
                o = _mm256_blendv_ps(o, h, _mm256_cmp_ps(o, h, _CMP_GT_OQ));
                m = _mm256_and_ps(_mm256_cmp_ps(o, l, _CMP_GT_OQ), _mm256_cmp_ps(o, h, _CMP_LT_OQ));
            }
            _mm256_storeu_ps(y + i0, o);
            bits[b] = (uint8_t)_mm256_movemask_ps(m);
            continue;
        }
#endif
        for (int64_t i = i0; i < i1; i++) {
            float v = z[i], o;
            int m;
            if (act == 1) {
                o = v < 0.0f ? 0.0f : v;  /* NaN passes through, as clamp_min does */
                m = o > 0.0f;
            } else {
                o = v < lo ? lo : (v > hi ? hi : v);
                m = o > lo && o < hi;
            }
            y[i] = o;
            byte |= (uint8_t)(m << (i - i0));
        }
        bits[b] = byte;
    }
    return 0;
}

/* sum(g) and sum((x - m) g) over the planes of one channel, g = gy masked */
static void channel_sums(const float *x, const float *gy, const uint8_t *bits, int64_t N, int64_t C, int64_t S,
                         int64_t c, float m, double *sum, double *dotp) {
    double s = 0.0, d = 0.0;
    for (int64_t n = 0; n < N; n++) {
        const int64_t base = (n * C + c) * S;
        const float *xp = x + base, *gp = gy + base;
        float as[LANES], ad[LANES];
        memset(as, 0, sizeof as);
        memset(ad, 0, sizeof ad);
        int64_t i = 0;
#ifdef __AVX2__
        if (!bits || (base & 7) == 0) {
            __m256 vs = _mm256_setzero_ps(), vd = _mm256_setzero_ps(), vm = _mm256_set1_ps(m);
            for (; i + 8 <= S; i += 8) {
                __m256 g = _mm256_loadu_ps(gp + i);
                if (bits) g = _mm256_and_ps(g, lanes_of(bits[(base + i) >> 3]));
                vs = _mm256_add_ps(vs, g);
                vd = _mm256_add_ps(vd, _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xp + i), vm), g));
            }
            _mm256_storeu_ps(as, vs);
            _mm256_storeu_ps(ad, vd);
        }
#endif
        if (!bits) {
            for (; i + LANES <= S; i += LANES)
                for (int j = 0; j < LANES; j++) {
                    as[j] += gp[i + j];
                    ad[j] += (xp[i + j] - m) * gp[i + j];
                }
        } else if ((base & 7) == 0) {
            for (; i + LANES <= S; i += LANES)
                for (int j = 0; j < LANES; j++) {
                    const int64_t k = base + i + j;
                    const float g = ((bits[k >> 3] >> (j & 7)) & 1) ? gp[i + j] : 0.0f;
                    as[j] += g;
                    ad[j] += (xp[i + j] - m) * g;
                }
        }
        for (; i < S; i++) {
            const float g = masked(gy, bits, base + i);
            as[0] += g;
            ad[0] += (xp[i] - m) * g;
        }
        float ps = 0.0f, pd = 0.0f;
        for (int j = 0; j < LANES; j++) {
            ps += as[j];
            pd += ad[j];
        }
        s += ps;
        d += pd;
    }
    *sum = s;
    *dotp = d;
}

/* out = ((g - gm) - (x - m) * kk) * sc over the planes of one channel; out may be x */
static void channel_dx(const float *x, const float *gy, const uint8_t *bits, int64_t N, int64_t C, int64_t S,
                       int64_t c, float m, float kk, float gm, float sc, float *out) {
    for (int64_t n = 0; n < N; n++) {
        const int64_t base = (n * C + c) * S;
        const float *xp = x + base, *gp = gy + base;
        float *op = out + base;
        int64_t i = 0;
#ifdef __AVX2__
        if (!bits || (base & 7) == 0) {
            const __m256 vm = _mm256_set1_ps(m), vk = _mm256_set1_ps(kk), vg = _mm256_set1_ps(gm),
                         vs = _mm256_set1_ps(sc);
            for (; i + 8 <= S; i += 8) {
                __m256 g = _mm256_loadu_ps(gp + i);
                if (bits) g = _mm256_and_ps(g, lanes_of(bits[(base + i) >> 3]));
                __m256 t = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xp + i), vm), vk);
                _mm256_storeu_ps(op + i, _mm256_mul_ps(_mm256_sub_ps(_mm256_sub_ps(g, vg), t), vs));
            }
        }
#endif
        if (!bits) {
            for (; i < S; i++) op[i] = ((gp[i] - gm) - (xp[i] - m) * kk) * sc;
        } else if ((base & 7) == 0) {
            for (; i + 8 <= S; i += 8) {
                const uint8_t byte = bits[(base + i) >> 3];
                for (int j = 0; j < 8; j++) {
                    const float g = ((byte >> j) & 1) ? gp[i + j] : 0.0f;
                    op[i + j] = ((g - gm) - (xp[i + j] - m) * kk) * sc;
                }
            }
        }
        for (; i < S; i++) {
            const float g = masked(gy, bits, base + i);
            op[i] = ((g - gm) - (xp[i] - m) * kk) * sc;
        }
    }
}

/* The whole backward, channel by channel: sums, then the weight and bias gradients (gw, gb; either may
 * be NULL) and the input gradient (out, may be x; NULL: not wanted). batch_stats: the mean and invstd
 * are the batch's (training); else constants (eval), and out = g * invstd * weight. */
int et_bn_backward(const float *x, const float *gy, const uint8_t *bits, int64_t N, int64_t C, int64_t S,
                   const float *mean, const float *invstd, const float *weight, int batch_stats, float *out,
                   float *gw, float *gb, int threads) {
    const double count = (double)N * (double)S;
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < C; c++) {
        double s, d;
        const float m = mean[c];
        const double inv = invstd[c];
        channel_sums(x, gy, bits, N, C, S, c, m, &s, &d);
        if (gw) gw[c] = (float)(d * inv);
        if (gb) gb[c] = (float)s;
        if (out) {
            const float kk = batch_stats ? (float)(d * inv * inv / count) : 0.0f;
            const float gm = batch_stats ? (float)(s / count) : 0.0f;
            const float sc = (float)(inv * (weight ? (double)weight[c] : 1.0));
            channel_dx(x, gy, bits, N, C, S, c, m, kk, gm, sc, out);
        }
    }
    return 0;
}
