/* Gradient filtering's memory-bound steps, fused into single passes (see _gradfilter_native.py).
 *
 * Plain C99, float32, any strides. Compiled on first use with the system's C compiler (-O3, OpenMP when
 * available); the Python side falls back to the GEMM formulation when no compiler is found.
 *
 *   et_pool     dst[n, c, l] = scale / count(l) * sum of src[n, c, h, w] over the r x r patch l
 *   et_unpool   dst[n, c, h, w] = scale / count(l) * src[n, c, l] where (h, w) lies in patch l
 *   et_dw_core  the depthwise backward on the pooled maps, vectorised over channels
 *
 * Patches are taken in ceil mode: a last partial patch row or column averages its real positions.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;
/* Fixed-width vectors (GCC >= 12 and Clang lower them to the machine's SIMD: SSE/AVX, NEON, or scalars). */
typedef float v8 __attribute__((vector_size(32)));
static inline v8 ld8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void st8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
typedef float v16 __attribute__((vector_size(64)));
static inline v16 ld16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void st16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v8 pairs8(v8 a, v8 b) { /* sums of neighbouring pairs of a then b */
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}
static inline void st8s(float *p, i64 stride, v8 v) {
    if (stride == 1) st8(p, v);
    else for (int k = 0; k < 8; k++) p[k * stride] = v[k];
}

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define CHUNK 256 /* channels one step of a channels-innermost loop works on (stack buffers) */

static i64 cdiv(i64 a, i64 b) { return (a + b - 1) / b; }

static void inv_counts(float *inv, i64 h, i64 w, i64 r, float scale) {
    i64 hc = cdiv(h, r), wc = cdiv(w, r);
    for (i64 i = 0; i < hc; i++)
        for (i64 j = 0; j < wc; j++)
            inv[i * wc + j] = scale / (float)(MIN(r, h - r * i) * MIN(r, w - r * j));
}

/* Map widths and radii the plane loops are specialised for (constant trip counts unroll and vectorise);
 * any other pair runs the same loops with run-time bounds. */
#define FOR_SHAPES(X) X(4, 2) X(7, 2) X(8, 2) X(14, 2) X(16, 2) X(28, 2) X(32, 2) X(56, 2) \
    X(8, 4) X(7, 4) X(14, 4) X(16, 4) X(28, 4) X(32, 4) X(56, 4)

/* One plane whose rows are contiguous (sw == 1): row sums of each patch row, then patch sums. */
static inline __attribute__((always_inline)) void pool_plane(const float *restrict s, float *restrict d, i64 H, i64 W, i64 r, i64 sh,
                       i64 dl, const float *restrict inv, float *restrict acc) {
    i64 wc = cdiv(W, r);
    if (r == 2 && W % 16 == 0 && H % 2 == 0) { /* 16 inputs of a row pair -> 8 patch sums */
        v8 f = (v8){0} + inv[0];
        for (i64 i = 0; i < H / 2; i++) {
            const float *a = s + 2 * i * sh, *b = a + sh;
            for (i64 w = 0; w < W; w += 16)
                st8s(d + (i * wc + w / 2) * dl, dl, pairs8(ld8(a + w) + ld8(b + w), ld8(a + w + 8) + ld8(b + w + 8)) * f);
        }
        return;
    }
    if (r == 2 && W == 8 && H % 4 == 0) { /* two row pairs -> two patch rows of 4 */
        v8 f = (v8){0} + inv[0];
        for (i64 i = 0; i < H / 2; i += 2) {
            const float *a = s + 2 * i * sh;
            v8 top = ld8(a) + ld8(a + sh), bottom = ld8(a + 2 * sh) + ld8(a + 3 * sh);
            st8s(d + i * 4 * dl, dl, pairs8(top, bottom) * f);
        }
        return;
    }
    for (i64 i = 0, h0 = 0; h0 < H; i++, h0 += r) {
        i64 h1 = MIN(H, h0 + r);
        const float *row = s + h0 * sh;
        for (i64 w = 0; w < W; w++) acc[w] = row[w];
        for (i64 h = h0 + 1; h < h1; h++) {
            row = s + h * sh;
            for (i64 w = 0; w < W; w++) acc[w] += row[w];
        }
        if (r == 2 && W % 2 == 0) {
            for (i64 j = 0; j < wc; j++) d[(i * wc + j) * dl] = (acc[2 * j] + acc[2 * j + 1]) * inv[i * wc + j];
        } else {
            for (i64 j = 0, w0 = 0; j < wc; j++, w0 += r) {
                float t = 0.0f;
                for (i64 w = w0; w < MIN(W, w0 + r); w++) t += acc[w];
                d[(i * wc + j) * dl] = t * inv[i * wc + j];
            }
        }
    }
}

/* One plane of the output with contiguous rows: each coarse row is expanded once and copied r times. */
static inline __attribute__((always_inline)) void unpool_plane(const float *restrict s, float *restrict d, i64 H, i64 W, i64 r, i64 sl,
                         i64 dh, const float *restrict inv, float *restrict row) {
    i64 wc = cdiv(W, r);
    if (r == 2 && W % 16 == 0 && H % 2 == 0) { /* 8 patch values -> 16 outputs on two rows */
        v8 f = (v8){0} + inv[0];
        for (i64 i = 0; i < H / 2; i++) {
            float *a = d + 2 * i * dh;
            for (i64 w = 0; w < W; w += 16) {
                v8 v;
                if (sl == 1) v = ld8(s + i * wc + w / 2);
                else for (int k = 0; k < 8; k++) v[k] = s[(i * wc + w / 2 + k) * sl];
                v *= f;
                v8 lo = __builtin_shufflevector(v, v, 0, 0, 1, 1, 2, 2, 3, 3);
                v8 hi = __builtin_shufflevector(v, v, 4, 4, 5, 5, 6, 6, 7, 7);
                st8(a + w, lo); st8(a + w + 8, hi); st8(a + dh + w, lo); st8(a + dh + w + 8, hi);
            }
        }
        return;
    }
    if (r == 2 && W == 8 && H % 4 == 0) { /* two patch rows of 4 -> four rows of 8 */
        v8 f = (v8){0} + inv[0];
        for (i64 i = 0; i < H / 2; i += 2) {
            v8 v;
            if (sl == 1) v = ld8(s + i * 4);
            else for (int k = 0; k < 8; k++) v[k] = s[(i * 4 + k) * sl];
            v *= f;
            v8 lo = __builtin_shufflevector(v, v, 0, 0, 1, 1, 2, 2, 3, 3);
            v8 hi = __builtin_shufflevector(v, v, 4, 4, 5, 5, 6, 6, 7, 7);
            float *a = d + 2 * i * dh;
            st8(a, lo); st8(a + dh, lo); st8(a + 2 * dh, hi); st8(a + 3 * dh, hi);
        }
        return;
    }
    for (i64 i = 0, h0 = 0; h0 < H; i++, h0 += r) {
        if (r == 2 && W % 2 == 0) {
            for (i64 j = 0; j < wc; j++) {
                float v = s[(i * wc + j) * sl] * inv[i * wc + j];
                row[2 * j] = v;
                row[2 * j + 1] = v;
            }
        } else {
            for (i64 j = 0, w0 = 0; j < wc; j++, w0 += r) {
                float v = s[(i * wc + j) * sl] * inv[i * wc + j];
                for (i64 w = w0; w < MIN(W, w0 + r); w++) row[w] = v;
            }
        }
        for (i64 h = h0; h < MIN(H, h0 + r); h++) memcpy(d + h * dh, row, sizeof(float) * W);
    }
}

/* The plane loops above, specialised for the common (width, radius) pairs, chosen per plane. */
static void pool_plane_any(const float *s, float *d, i64 H, i64 W, i64 r, i64 sh, i64 dl, const float *inv,
                           float *acc) {
#define POOL_CASE(WW, RR) if (W == WW && r == RR) { pool_plane(s, d, H, WW, RR, sh, dl, inv, acc); return; }
    FOR_SHAPES(POOL_CASE)
    pool_plane(s, d, H, W, r, sh, dl, inv, acc);
}

static void unpool_plane_any(const float *s, float *d, i64 H, i64 W, i64 r, i64 sl, i64 dh, const float *inv,
                             float *row) {
#define UNPOOL_CASE(WW, RR) if (W == WW && r == RR) { unpool_plane(s, d, H, WW, RR, sl, dh, inv, row); return; }
    FOR_SHAPES(UNPOOL_CASE)
    unpool_plane(s, d, H, W, r, sl, dh, inv, row);
}

/* Every plane of a map whose plane rows are contiguous (NCHW): pooling (src rows sh apart, results dl
 * apart) or unpooling (src values sl apart, result rows dh apart), split over the threads. */
static int each_plane(int pooling, const float *src, float *dst, i64 N, i64 C, i64 H, i64 W, i64 r, i64 sn,
                      i64 sc, i64 dn, i64 dc, i64 s_step, i64 d_step, const float *inv, int threads) {
    int fail = 0;
#pragma omp parallel num_threads(threads) reduction(| : fail)
    {
        float *tmp = malloc(sizeof(float) * W);
        if (!tmp) fail = 1;
        else {
#pragma omp for schedule(static)
            for (i64 p = 0; p < N * C; p++) {
                const float *s = src + (p / C) * sn + (p % C) * sc;
                float *d = dst + (p / C) * dn + (p % C) * dc;
                if (pooling) pool_plane_any(s, d, H, W, r, s_step, d_step, inv, tmp);
                else unpool_plane_any(s, d, H, W, r, s_step, d_step, inv, tmp);
            }
            free(tmp);
        }
    }
    return fail;
}

/* Pooling with channels innermost (channels-last) or any other strides: vectors over channels. */
static int pool_channels(const float *src, float *dst, i64 N, i64 C, i64 H, i64 W, i64 r, i64 sn, i64 sc, i64 sh,
                         i64 sw, i64 dn, i64 dc, i64 dl, const float *inv, int threads) {
    i64 wc = cdiv(W, r), L = cdiv(H, r) * wc;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (i64 n = 0; n < N; n++) {
        for (i64 l = 0; l < L; l++) {
            i64 i = l / wc, j = l % wc;
            float acc[CHUNK];
            for (i64 c0 = 0; c0 < C; c0 += CHUNK) {
                i64 nc = MIN(CHUNK, C - c0);
                for (i64 c = 0; c < nc; c++) acc[c] = 0.0f;
                for (i64 h = i * r; h < MIN(H, i * r + r); h++)
                    for (i64 w = j * r; w < MIN(W, j * r + r); w++) {
                        const float *s = src + n * sn + c0 * sc + h * sh + w * sw;
                        if (sc == 1)
                            for (i64 c = 0; c < nc; c++) acc[c] += s[c];
                        else
                            for (i64 c = 0; c < nc; c++) acc[c] += s[c * sc];
                    }
                float *d = dst + n * dn + c0 * dc + l * dl;
                if (dc == 1)
                    for (i64 c = 0; c < nc; c++) d[c] = acc[c] * inv[l];
                else
                    for (i64 c = 0; c < nc; c++) d[c * dc] = acc[c] * inv[l];
            }
        }
    }
    return 0;
}

static float *inv_table(i64 H, i64 W, i64 r, float scale) {
    float *inv = malloc(sizeof(float) * cdiv(H, r) * cdiv(W, r));
    if (inv) inv_counts(inv, H, W, r, scale);
    return inv;
}

int et_pool(const float *src, float *dst, i64 N, i64 C, i64 H, i64 W, i64 r, float scale,
            i64 sn, i64 sc, i64 sh, i64 sw, i64 dn, i64 dc, i64 dl, int threads) {
    float *inv = inv_table(H, W, r, scale);
    int fail = !inv ? 1 : (sw == 1 && sc != 1) /* plane rows contiguous (NCHW): one plane at a time */
        ? each_plane(1, src, dst, N, C, H, W, r, sn, sc, dn, dc, sh, dl, inv, threads)
        : pool_channels(src, dst, N, C, H, W, r, sn, sc, sh, sw, dn, dc, dl, inv, threads);
    free(inv);
    return fail;
}

/* Unpooling into a map with channels innermost (channels-last) or any other strides. */
static int unpool_channels(const float *src, float *dst, i64 N, i64 C, i64 H, i64 W, i64 r, i64 sn, i64 sc,
                           i64 sl, i64 dn, i64 dc, i64 dh, i64 dw, const float *inv, int threads) {
    i64 wc = cdiv(W, r);
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (i64 n = 0; n < N; n++) {
        for (i64 h = 0; h < H; h++) {
            for (i64 w = 0; w < W; w++) {
                i64 l = (h / r) * wc + w / r;
                const float *s = src + n * sn + l * sl;
                float *d = dst + n * dn + h * dh + w * dw, f = inv[l];
                if (sc == 1 && dc == 1)
                    for (i64 c = 0; c < C; c++) d[c] = s[c] * f;
                else
                    for (i64 c = 0; c < C; c++) d[c * dc] = s[c * sc] * f;
            }
        }
    }
    return 0;
}

int et_unpool(const float *src, float *dst, i64 N, i64 C, i64 H, i64 W, i64 r, float scale,
              i64 sn, i64 sc, i64 sl, i64 dn, i64 dc, i64 dh, i64 dw, int threads) {
    float *inv = inv_table(H, W, r, scale);
    int fail = !inv ? 1 : (dw == 1 && dc != 1) /* output plane rows contiguous (NCHW) */
        ? each_plane(0, src, dst, N, C, H, W, r, sn, sc, dn, dc, sl, dh, inv, threads)
        : unpool_channels(src, dst, N, C, H, W, r, sn, sc, sl, dn, dc, dh, dw, inv, threads);
    free(inv);
    return fail;
}

#define MAXV 4 /* 16-wide vectors per block of channels: 64 channels, the sums held in registers */

/* One sample, one block of 16 nv channels: the slots' sums of products added into dws (row stride ws),
 * and the coarse input gradient written to dx (row stride ds; skipped when dx == NULL). g, x, wc, dws, dx
 * point at the block's first channel; gs, xst, wst are the row strides of G, X and the coarse kernels. */
static inline __attribute__((always_inline)) void dw_sample(
    const float *g, i64 gs, const float *x, i64 xst, const float *wc, i64 wst, float *dws, i64 ws, float *dx,
    i64 ds, i64 S, i64 Li, const i64 *wo, const i64 *wi, const i64 *woff, const i64 *xs, const i64 *xo,
    const i64 *xoff, const int nv) {
    v16 a[MAXV];
    if (dws) {
        for (i64 s = 0; s < S; s++) {
            float *o = dws + s * ws;
            for (int k = 0; k < nv; k++) a[k] = ld16(o + 16 * k);
            for (i64 e = woff[s]; e < woff[s + 1]; e++) {
                const float *ge = g + wo[e] * gs, *xe = x + wi[e] * xst;
                for (int k = 0; k < nv; k++) a[k] += ld16(ge + 16 * k) * ld16(xe + 16 * k);
            }
            for (int k = 0; k < nv; k++) st16(o + 16 * k, a[k]);
        }
    }
    if (dx) {
        for (i64 i = 0; i < Li; i++) {
            for (int k = 0; k < nv; k++) a[k] = (v16){0};
            for (i64 e = xoff[i]; e < xoff[i + 1]; e++) {
                const float *ge = g + xo[e] * gs, *we = wc + xs[e] * wst;
                for (int k = 0; k < nv; k++) a[k] += ld16(we + 16 * k) * ld16(ge + 16 * k);
            }
            for (int k = 0; k < nv; k++) st16(dx + i * ds + 16 * k, a[k]);
        }
    }
}

#define DW_SAMPLE_NV(NV_EXPR, ...)                                  \
    switch (NV_EXPR) {                                              \
    case 1: dw_sample(__VA_ARGS__, 1); break;                       \
    case 2: dw_sample(__VA_ARGS__, 2); break;                       \
    case 3: dw_sample(__VA_ARGS__, 3); break;                       \
    default: dw_sample(__VA_ARGS__, MAXV); break;                   \
    }

/* Blocks of channels: 64 at a time, then one block of the rest rounded up to 16 lanes. A block whose lanes
 * pass C works on zero-padded copies (its extra lanes compute zeros that are never written out). */
static i64 n_blocks(i64 C) { return C / (16 * MAXV) + (C % (16 * MAXV) != 0); }

/* A block's coarse kernels wc[s, c] = sum_t fold[s, t] W[c, t] and its slot sums, both [S, lanes] in buf;
 * lanes past C hold zeros. W: [C, T] (NULL when dx is not needed); fold: [S, T]; wt: [T, lanes] scratch for
 * the block's weights, transposed. */
typedef struct { float *wc, *dws; i64 lanes, nb; } block_view;

static block_view block_setup(i64 b, i64 C, i64 S, i64 T, const float *W, const float *fold, int need_w,
                              float *buf, float *wt) {
    block_view v;
    i64 c0 = b * 16 * MAXV;
    v.nb = MIN(16 * MAXV, C - c0);
    v.lanes = 16 * cdiv(v.nb, 16);
    memset(buf, 0, sizeof(float) * 2 * S * v.lanes);
    v.wc = W ? buf : NULL;
    v.dws = need_w ? buf + S * v.lanes : NULL;
    if (W) {
        for (i64 c = 0; c < v.nb; c++)
            for (i64 t = 0; t < T; t++) wt[t * v.lanes + c] = W[(c0 + c) * T + t];
        for (i64 s = 0; s < S; s++)
            for (i64 t = 0; t < T; t++) {
                float f = fold[s * T + t], *o = v.wc + s * v.lanes;
                const float *w = wt + t * v.lanes;
                if (f != 0.0f)
                    for (i64 c = 0; c < v.nb; c++) o[c] += f * w[c];
            }
    }
    return v;
}

/* The weight gradient of the block's channels: gw[c, t] = sum_s fold[s, t] dws[s, c]; acc: lanes floats. */
static void block_finish(const block_view *v, i64 b, i64 S, i64 T, const float *fold, float *gw, float *acc) {
    if (!gw) return;
    i64 c0 = b * 16 * MAXV;
    for (i64 t = 0; t < T; t++) {
        memset(acc, 0, sizeof(float) * v->lanes);
        for (i64 s = 0; s < S; s++) {
            float f = fold[s * T + t];
            const float *d = v->dws + s * v->lanes;
            if (f != 0.0f)
                for (i64 c = 0; c < v->lanes; c++) acc[c] += f * d[c];
        }
        for (i64 c = 0; c < v->nb; c++) gw[(c0 + c) * T + t] = acc[c];
    }
}

/* X rows of sample n for block b: the tensor itself, or a zero-padded copy in xbuf. */
static const float *block_x(const block_view *v, const float *X, i64 n, i64 b, i64 C, i64 Li, float *xbuf,
                            i64 *xst) {
    const float *x = X + n * Li * C + b * 16 * MAXV;
    if (v->nb % 16 == 0) { *xst = C; return x; }
    for (i64 i = 0; i < Li; i++) {
        memcpy(xbuf + i * v->lanes, x + i * C, sizeof(float) * v->nb);
        memset(xbuf + i * v->lanes + v->nb, 0, sizeof(float) * (v->lanes - v->nb));
    }
    *xst = v->lanes;
    return xbuf;
}

/* Depthwise backward on pooled maps, channels innermost. G: [N, Lo, C], X: [N, Li, C], both contiguous.
 * An entry (slot, out, in) says: coarse output position `out` reads coarse input position `in` through
 * `slot` (one coarse kernel tap of one kind of patch row and column); fold[s, t] says how much kernel tap
 * t counts in slot s. Two orderings of the same entries:
 *   by slot (wo, wi; slot s owns [woff[s], woff[s+1]) ):
 *     gw[c, t] = sum_s fold[s, t] sum_n sum_{e of s} G[n, wo e, c] X[n, wi e, c]       (when gw != NULL)
 *   by input position (xs, xo; position i owns [xoff[i], xoff[i+1]) ):
 *     dx[n, i, c] = sum_{e of i} wc[xs e, c] G[n, xo e, c], wc = fold W^T             (when dx != NULL)
 * W: [C, T] weights (NULL when dx is not needed); gw: [C, T] and dx: [N, Li, C] are written whole. */
int et_dw_core(const float *G, const float *X, const float *W, const float *fold, float *gw, float *dx, i64 N,
               i64 C, i64 Lo, i64 Li, i64 S, i64 T, const i64 *wo, const i64 *wi, const i64 *woff,
               const i64 *xs, const i64 *xo, const i64 *xoff, int threads) {
    int fail = 0;
#pragma omp parallel num_threads(threads) reduction(| : fail)
    {
        i64 lanes = 16 * MAXV;
        float *buf = malloc(sizeof(float) * (2 * S + Lo + 2 * Li + 1 + T) * lanes);
        if (!buf) fail = 1;
        else {
#pragma omp for schedule(static)
            for (i64 b = 0; b < n_blocks(C); b++) {
                block_view v = block_setup(b, C, S, T, dx ? W : NULL, fold, gw != NULL, buf,
                                           buf + (2 * S + Lo + 2 * Li + 1) * lanes);
                float *gbuf = buf + 2 * S * lanes, *xbuf = gbuf + Lo * lanes, *dbuf = xbuf + Li * lanes;
                for (i64 n = 0; n < N; n++) {
                    const float *g = G + n * Lo * C + b * lanes;
                    i64 gs = C, xst = 0;
                    if (v.nb % 16) { /* padded copy of this sample's rows */
                        for (i64 l = 0; l < Lo; l++) {
                            memcpy(gbuf + l * v.lanes, g + l * C, sizeof(float) * v.nb);
                            memset(gbuf + l * v.lanes + v.nb, 0, sizeof(float) * (v.lanes - v.nb));
                        }
                        g = gbuf; gs = v.lanes;
                    }
                    const float *x = gw ? block_x(&v, X, n, b, C, Li, xbuf, &xst) : NULL;
                    float *d = dx ? (v.nb % 16 ? dbuf : dx + n * Li * C + b * lanes) : NULL;
                    i64 ds = v.nb % 16 ? v.lanes : C;
                    DW_SAMPLE_NV(v.lanes / 16, g, gs, x, xst, v.wc, v.lanes, v.dws, v.lanes, d, ds, S, Li, wo, wi,
                                 woff, xs, xo, xoff)
                    if (dx && v.nb % 16)
                        for (i64 i = 0; i < Li; i++)
                            memcpy(dx + (n * Li + i) * C + b * lanes, dbuf + i * v.lanes, sizeof(float) * v.nb);
                }
                block_finish(&v, b, S, T, fold, gw, dbuf + Li * lanes);
            }
            free(buf);
        }
    }
    return fail;
}

/* The same backward fused with pooling dL/dy and unpooling dL/dx, for planes with contiguous rows (NCHW):
 * one pass over each block of channels, sample by sample, with the pooled maps in L1-sized buffers.
 * gy: [N, C, Ho, Wo] (strides gsn, gsc, gsh, 1); gx: [N, C, H, W] (strides xsn, xsc, xsh, 1) or NULL. */
int et_dw_fused(const float *gy, const float *X, const float *W, const float *fold, float *gw, float *gx, i64 N,
                i64 C, i64 Ho, i64 Wo, i64 H, i64 Wd, i64 r, i64 gsn, i64 gsc, i64 gsh, i64 xsn, i64 xsc,
                i64 xsh, i64 S, i64 T, const i64 *wo, const i64 *wi, const i64 *woff, const i64 *xs,
                const i64 *xo, const i64 *xoff, int threads) {
    i64 Lo = cdiv(Ho, r) * cdiv(Wo, r), Li = cdiv(H, r) * cdiv(Wd, r);
    float *inv_o = malloc(sizeof(float) * Lo), *inv_i = malloc(sizeof(float) * Li);
    if (!inv_o || !inv_i) { free(inv_o); free(inv_i); return 1; }
    inv_counts(inv_o, Ho, Wo, r, 1.0f);
    inv_counts(inv_i, H, Wd, r, 1.0f);
    int fail = 0;
#pragma omp parallel num_threads(threads) reduction(| : fail)
    {
        i64 lanes = 16 * MAXV;
        float *buf = malloc(sizeof(float) * ((2 * S + Lo + 2 * Li + 1 + T) * lanes + Wo + Wd));
        if (!buf) fail = 1;
        else {
#pragma omp for schedule(static)
            for (i64 b = 0; b < n_blocks(C); b++) {
                block_view v = block_setup(b, C, S, T, gx ? W : NULL, fold, gw != NULL, buf,
                                           buf + (2 * S + Lo + 2 * Li + 1) * lanes + Wo + Wd);
                float *gbuf = buf + 2 * S * lanes, *xbuf = gbuf + Lo * lanes, *dbuf = xbuf + Li * lanes;
                float *fin = dbuf + Li * lanes, *acc = fin + lanes, *row = acc + Wo;
                i64 c0 = b * lanes;
                if (v.nb % 16) memset(gbuf, 0, sizeof(float) * Lo * v.lanes);
                for (i64 n = 0; n < N; n++) {
                    for (i64 c = 0; c < v.nb; c++)
                        pool_plane_any(gy + n * gsn + (c0 + c) * gsc, gbuf + c, Ho, Wo, r, gsh, v.lanes, inv_o, acc);
                    i64 xst = 0;
                    const float *x = gw ? block_x(&v, X, n, b, C, Li, xbuf, &xst) : NULL;
                    DW_SAMPLE_NV(v.lanes / 16, gbuf, v.lanes, x, xst, v.wc, v.lanes, v.dws, v.lanes,
                                 gx ? dbuf : NULL, v.lanes, S, Li, wo, wi, woff, xs, xo, xoff)
                    if (gx)
                        for (i64 c = 0; c < v.nb; c++)
                            unpool_plane_any(dbuf + c, gx + n * xsn + (c0 + c) * xsc, H, Wd, r, v.lanes, xsh, inv_i,
                                             row);
                }
                block_finish(&v, b, S, T, fold, gw, fin);
            }
            free(buf);
        }
    }
    free(inv_o);
    free(inv_i);
    return fail;
}
