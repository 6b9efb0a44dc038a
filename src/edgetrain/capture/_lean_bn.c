/* Lean BatchNorm's memory-bound passes (see lean_bn.py), float32, layout [N, C, S] contiguous, S > 1.
 *
 * et_bn_act:  y = act(z) and the activation's gradient mask, one bit per element (bit i of byte i/8).
 * et_bn_backward: PyTorch's CPU BatchNorm backward (the contiguous kernel of ATen's batch_norm_kernel.cpp),
 *             operation for operation, fed the masked gradient on the fly, so that its results are the
 *             same bits as autograd's: per channel and per plane, float sums in `lanes` vector lanes
 *             (tail lanes merged as ATen's reduce_all does, lanes folded in halves or in a row: seq), each plane's sum
 *             added to a double; k, the mean gradient and the weight / bias gradients with ATen's
 *             types; out = ((g - gmean) - (x - mean) * k) * invstd * w, elementwise, and may be x (each
 *             element is read before it is written). Whether ATen's build fused a multiply-add (fma_dot bit 0:
 *             the dot product's accumulation over whole vectors, bit 1: over the tail; fma_dx: the
 *             input gradient) is not visible from here:
 *             lean_bn.py picks the variant that reproduces the installed torch bit for bit, or none.
 * act: 0 none (no mask), 1 relu (gradient kept unless y <= 0), 2 hardtanh (kept unless y <= lo or y >= hi).
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>

/* The 8 mask bits of elements k..k+7 (the mask has a padding byte, so k's byte and the next are there) */
static inline uint8_t bits8(const uint8_t *bits, int64_t k) {
    const uint32_t w = (uint32_t)bits[k >> 3] | ((uint32_t)bits[(k >> 3) + 1] << 8);
    return (uint8_t)(w >> (k & 7));
}

/* 8 lanes, all ones where bit j of byte is set */
static inline __m256 lanes_of(uint8_t byte) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i b = _mm256_and_si256(_mm256_set1_epi32(byte), sel);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, sel));
}

static inline __m256 grad8(const float *gp, const uint8_t *bits, int64_t k, int64_t i) {
    const __m256 g = _mm256_loadu_ps(gp + i);
    return bits ? _mm256_and_ps(g, lanes_of(bits8(bits, k))) : g;
}
#endif

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
                m = _mm256_cmp_ps(o, _mm256_setzero_ps(), _CMP_NLE_UQ);
            } else {
                const __m256 l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
                o = _mm256_blendv_ps(v, l, _mm256_cmp_ps(v, l, _CMP_LT_OQ));
                o = _mm256_blendv_ps(o, h, _mm256_cmp_ps(o, h, _CMP_GT_OQ));
                m = _mm256_and_ps(_mm256_cmp_ps(o, l, _CMP_NLE_UQ), _mm256_cmp_ps(o, h, _CMP_NGE_UQ));
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
                m = !(o <= 0.0f);
            } else {
                o = v < lo ? lo : (v > hi ? hi : v);
                m = !(o <= lo) && !(o >= hi);
            }
            y[i] = o;
            byte |= (uint8_t)(m << (i - i0));
        }
        bits[b] = byte;
    }
    return 0;
}

#define MAX_LANES 16

static inline float grad_at(const float *gp, const uint8_t *bits, int64_t k, int64_t i) {
    if (!bits) return gp[i];
    return ((bits[k >> 3] >> (k & 7)) & 1) ? gp[i] : 0.0f;
}

/* ATen's lane fold: v[i] += v[i + h] for h = L/2, L/4, ..., 1 (its SIMD specialisations), or lanes added
 * left to right (seq: its generic vec_reduce_all); lane 0 */
static inline float fold(float *v, int lanes, int seq) {
    if (seq) {
        float a = v[0];
        for (int i = 1; i < lanes; i++) a = a + v[i];
        return a;
    }
    for (int h = lanes / 2; h >= 1; h /= 2)
        for (int i = 0; i < h; i++) v[i] = v[i] + v[i + h];
    return v[0];
}

static void plane_sums(const float *xp, const float *gp, const uint8_t *bits, int64_t base, int64_t S, float m,
                       int lanes, int seq, int fma_dot, float *sum, float *dotp) {
    float as[MAX_LANES] = {0}, ad[MAX_LANES] = {0};
    if (S < lanes) {  /* one partial vector, lanes added left to right */
        float s = grad_at(gp, bits, base, 0), d = (xp[0] - m) * s;
        for (int64_t i = 1; i < S; i++) {
            const float g = grad_at(gp, bits, base + i, i);
            s = s + g;
            d = d + (xp[i] - m) * g;
        }
        *sum = s;
        *dotp = d;
        return;
    }
    for (int j = 0; j < lanes; j++) {
        const float g = grad_at(gp, bits, base + j, j);
        as[j] = g;
        ad[j] = (xp[j] - m) * g;
    }
    int64_t i = lanes;
    const int64_t full = S - S % lanes;
#ifdef __AVX2__
    if (lanes == 8) {  /* the same operations on one register per accumulator */
        __m256 vs = _mm256_loadu_ps(as), vd = _mm256_loadu_ps(ad);
        const __m256 vm = _mm256_set1_ps(m);
        for (; i < full; i += 8) {
            const __m256 g = grad8(gp, bits, base + i, i), t = _mm256_sub_ps(_mm256_loadu_ps(xp + i), vm);
            vs = _mm256_add_ps(vs, g);
            vd = (fma_dot & 1) ? _mm256_fmadd_ps(t, g, vd) : _mm256_add_ps(vd, _mm256_mul_ps(t, g));
        }
        _mm256_storeu_ps(as, vs);
        _mm256_storeu_ps(ad, vd);
    }
#endif
    if (lanes == 8) {
        for (; i < full; i += 8)
            for (int j = 0; j < 8; j++) {
                const float g = grad_at(gp, bits, base + i + j, i + j);
                as[j] = as[j] + g;
                ad[j] = (fma_dot & 1) ? fmaf(xp[i + j] - m, g, ad[j]) : ad[j] + (xp[i + j] - m) * g;
            }
    } else if (lanes == 16) {
        for (; i < full; i += 16)
            for (int j = 0; j < 16; j++) {
                const float g = grad_at(gp, bits, base + i + j, i + j);
                as[j] = as[j] + g;
                ad[j] = (fma_dot & 1) ? fmaf(xp[i + j] - m, g, ad[j]) : ad[j] + (xp[i + j] - m) * g;
            }
    } else {
        for (; i < full; i += lanes)
            for (int j = 0; j < lanes; j++) {
                const float g = grad_at(gp, bits, base + i + j, i + j);
                as[j] = as[j] + g;
                ad[j] = (fma_dot & 1) ? fmaf(xp[i + j] - m, g, ad[j]) : ad[j] + (xp[i + j] - m) * g;
            }
    }
    for (int j = 0; i + j < S; j++) {  /* the tail: ATen's Vec::set keeps these lanes only */
        const float g = grad_at(gp, bits, base + i + j, i + j);
        as[j] = as[j] + g;
        ad[j] = (fma_dot & 2) ? fmaf(xp[i + j] - m, g, ad[j]) : ad[j] + (xp[i + j] - m) * g;
    }
    *sum = fold(as, lanes, seq);
    *dotp = fold(ad, lanes, seq);
}

/* The whole backward, channel by channel (module comment). mean/invstd: the forward's saved statistics
 * (training) or the running mean and ATen's eval-mode invstd (batch_stats 0: out = g * invstd * w). gw, gb,
 * out may be NULL (not wanted). Returns 0, or -1 for a lane count other than 4, 8 or 16. */
int et_bn_backward(const float *x, const float *gy, const uint8_t *bits, int64_t N, int64_t C, int64_t S,
                   const float *mean, const float *invstd, const float *weight, int batch_stats, float *out,
                   float *gw, float *gb, int threads, int lanes, int seq, int fma_dot, int fma_dx) {
    if (lanes != 4 && lanes != 8 && lanes != 16) return -1;
    const int64_t count = N * S;
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < C; c++) {
        const float m = mean[c], inv = invstd[c], w = weight ? weight[c] : 1.0f;
        double sum = 0.0, dotp = 0.0;
        for (int64_t n = 0; n < N; n++) {
            const int64_t base = (n * C + c) * S;
            float ps, pd;
            plane_sums(x + base, gy + base, bits, base, S, m, lanes, seq, fma_dot, &ps, &pd);
            sum += (double)ps;
            dotp += (double)pd;
        }
        if (out) {
            const float k = batch_stats ? (float)dotp * inv * inv / (float)count : 0.0f;
            const float gmean = batch_stats ? (float)(sum / (double)count) : 0.0f;
            for (int64_t n = 0; n < N; n++) {
                const int64_t base = (n * C + c) * S;
                const float *xp = x + base, *gp = gy + base;
                float *op = out + base;
                if (!batch_stats) {
                    for (int64_t i = 0; i < S; i++) op[i] = grad_at(gp, bits, base + i, i) * inv * w;
                } else if (fma_dx) {
                    int64_t i = 0;
#ifdef __AVX2__
                    const __m256 vm = _mm256_set1_ps(m), vk = _mm256_set1_ps(k), vg = _mm256_set1_ps(gmean),
                                 vi = _mm256_set1_ps(inv), vw = _mm256_set1_ps(w);
                    for (; i + 8 <= S; i += 8) {
                        const __m256 t = _mm256_sub_ps(_mm256_loadu_ps(xp + i), vm);
                        const __m256 r = _mm256_fnmadd_ps(t, vk, _mm256_sub_ps(grad8(gp, bits, base + i, i), vg));
                        _mm256_storeu_ps(op + i, _mm256_mul_ps(_mm256_mul_ps(r, vi), vw));
                    }
#endif
                    for (; i < S; i++)
                        op[i] = fmaf(-(xp[i] - m), k, grad_at(gp, bits, base + i, i) - gmean) * inv * w;
                } else {
                    for (int64_t i = 0; i < S; i++) {
                        const float dx = (xp[i] - m) * k;
                        op[i] = (grad_at(gp, bits, base + i, i) - gmean - dx) * inv * w;
                    }
                }
            }
        }
        if (gw) gw[c] = (float)(dotp * (double)inv);
        if (gb) gb[c] = (float)sum;
    }
    return 0;
}
