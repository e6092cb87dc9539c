/* The greedy token of each row of x [M, K] under an fp32 lm_head, without computing every logit
 * in fp32: the exact answer of argmax(x @ W.T) as csrc/panel_gemm.c computes it, first index
 * on ties, for a fraction of the weight stream.
 *
 * A decode step multiplies a few rows by the whole vocabulary (49152 x 576 on the default
 * model: 113 MB of fp32, a sixth of the weights streamed per step). Here a bf16 copy of W
 * (half the bytes, and vdpbf16ps does two products per lane) gives every logit to within a
 * proven bound, and only the tokens whose interval reaches the best lower bound are computed
 * again in fp32, from the packed panels, as the same fused multiply-add chain over k in order
 * that panel_gemm.c runs: so the chosen token is the one the full fp32 logits give. On the
 * default model 2 candidates per row are typical (p90 6, max 24 over 320 greedy steps).
 *
 * The bound, per logit j of a row x, with u = 2^-8 (bf16, round to nearest) and g = K 2^-24
 * (an fp32 sum of K terms):  |screen_j - fp32_j| <= (2u + u^2 + 2.1 g) sum_k |x_k| |W_jk|
 * <= coef ||x|| ||W_j||  (Cauchy-Schwarz), coef = 1.01 (2u + u^2 + 3g), plus 2^-20 |screen_j|
 * for the rounding of the comparisons themselves. With lo/hi_j = screen_j -/+ bound_j and
 * LB = max_j lo_j, the true argmax j* has hi_j* >= fp32_j* >= LB, and every j with hi_j < LB
 * is below it: the candidates {j : hi_j >= LB} hold j* and all its ties.
 *
 * bf16 weight layout: panels of 16 outputs, [N16 / 16][K2][16][2] (K2 = ceil(K / 2) rounded up
 * to a multiple of 16, zero padded), so one 64-byte load is 16 outputs x 2 k, vdpbf16ps's
 * operand, and 16 of them in a row are an AMX tile of the panel.
 *
 * Where the CPU has AMX (and Linux grants this process its tile state) the screen runs on the
 * tiles: 16 rows x 32 outputs per k block of 32, where vdpbf16ps does 16 outputs of one row.
 * At 16 rows vdpbf16ps made the screen compute-bound, slower than the whole fp32 head; on the
 * tiles it is the bf16 stream again (default model, see kernels/greedy_head.py's main).
 * Each tile product adds exact bf16 products into fp32, as vdpbf16ps does: the same bound.
 *
 * Returns 0, or -1 without AVX-512 BF16, -2 when a row has no candidate (not finite, or a
 * screen buffer could not be allocated), or -3 when the bf16 rows could not be.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

enum { LANES = 16, ROWS = 8, F32_PANEL = 48 /* panel_gemm.c's PANEL */, KBLOCK2 = 16 /* k pairs a tile */ };

/* A logit's bound (see the top of this file), 16 at a time. */
static inline __m512 bound16(__m512 sv, __m512 coef, const float *wnorm)
{
    return _mm512_fmadd_ps(_mm512_abs_ps(sv), _mm512_set1_ps(0x1p-20f), _mm512_mul_ps(coef, _mm512_loadu_ps(wnorm)));
}

/* Screen of one bf16 panel (16 outputs) for rows [0, rows): s[m][col..col+16), and each row's
 * running max of the lower bounds of the valid (not padding) outputs in lbmax[m]. */
static inline __attribute__((always_inline)) void screen_tile(const uint32_t *xb, int64_t k2, const uint16_t *wp,
                                                              const float *coef, const float *wnorm, int rows,
                                                              __mmask16 valid, float *s, int64_t ns, __m512 *lbmax)
{
    __m512 acc[ROWS];
    for (int m = 0; m < rows; m++)
        acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k2; k++) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(wp + k * 2 * LANES);
        for (int m = 0; m < rows; m++)
            acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_set1_epi32((int)xb[m * k2 + k]));
    }
    for (int m = 0; m < rows; m++) {
        _mm512_storeu_ps(s + m * ns, acc[m]);
        const __m512 bound = bound16(acc[m], _mm512_set1_ps(coef[m]), wnorm);
        lbmax[m] = _mm512_mask_max_ps(lbmax[m], valid, lbmax[m], _mm512_sub_ps(acc[m], bound));
    }
}

/* rows as a constant, so the accumulators stay in registers. */
static void screen(const uint32_t *xb, int64_t k2, const uint16_t *wp, const float *coef, const float *wnorm,
                   int rows, __mmask16 valid, float *s, int64_t ns, __m512 *lbmax)
{
    switch (rows) {
    case 1: screen_tile(xb, k2, wp, coef, wnorm, 1, valid, s, ns, lbmax); break;
    case 2: screen_tile(xb, k2, wp, coef, wnorm, 2, valid, s, ns, lbmax); break;
    case 3: screen_tile(xb, k2, wp, coef, wnorm, 3, valid, s, ns, lbmax); break;
    case 4: screen_tile(xb, k2, wp, coef, wnorm, 4, valid, s, ns, lbmax); break;
    case 5: screen_tile(xb, k2, wp, coef, wnorm, 5, valid, s, ns, lbmax); break;
    case 6: screen_tile(xb, k2, wp, coef, wnorm, 6, valid, s, ns, lbmax); break;
    case 7: screen_tile(xb, k2, wp, coef, wnorm, 7, valid, s, ns, lbmax); break;
    default: screen_tile(xb, k2, wp, coef, wnorm, 8, valid, s, ns, lbmax); break;
    }
}

/* x[m, k] . W[n, k] in fp32, one FMA chain over k in order: bit for bit panel_gemm.c's output.
 * From W's row where the caller has W [N, K] (K floats in a row), else from the panels (one
 * float of each cache line: 16 times the bytes, which a row with many candidates feels). */
static float exact_logit(const float *x, const float *panels, const float *rows, int64_t k_dim, int64_t n)
{
    const float *w = rows ? rows + n * k_dim : panels + (n / F32_PANEL) * F32_PANEL * k_dim + n % F32_PANEL;
    const int64_t step = rows ? 1 : F32_PANEL;
    float acc = 0.0f;
    for (int64_t k = 0; k < k_dim; k++)
        acc = fmaf(x[k], w[k * step], acc);
    return acc;
}

/* max over j of the lower bound s_j - bound_j: the screen pass keeps it as it goes; this scan
 * is for a row that barred a token whose lower bound may have been that max. */
static float lower_max(const float *s, const float *wnorm, float coef, int64_t n_dim)
{
    const __m512 vc = _mm512_set1_ps(coef);
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t n0 = 0; n0 < n_dim; n0 += LANES) {
        const __mmask16 valid = n_dim - n0 >= LANES ? 0xFFFF : (__mmask16)((1u << (n_dim - n0)) - 1);
        const __m512 sv = _mm512_loadu_ps(s + n0);
        best = _mm512_mask_max_ps(best, valid, best, _mm512_sub_ps(sv, bound16(sv, vc, wnorm + n0)));
    }
    return _mm512_reduce_max_ps(best);
}

/* Row m's winner among its candidates, scanned in index order (first index wins ties). A barred
 * token's screen is -inf: its upper bound, -inf + inf, is NaN, never a candidate. */
static int64_t pick(const float *x, const float *s, const float *panels, const float *rows, const float *wnorm, float coef,
                    float lb, int64_t n_dim, int64_t k_dim, int64_t *count)
{
    const __m512 vc = _mm512_set1_ps(coef), vlb = _mm512_set1_ps(lb);
    int64_t best = -1;
    float best_val = 0.0f;
    for (int64_t n0 = 0; n0 < n_dim; n0 += LANES) {
        const __m512 sv = _mm512_loadu_ps(s + n0);
        uint32_t hits = _mm512_cmp_ps_mask(_mm512_add_ps(sv, bound16(sv, vc, wnorm + n0)), vlb, _CMP_GE_OQ);
        if (n_dim - n0 < LANES)
            hits &= (1u << (n_dim - n0)) - 1;
        for (; hits; hits &= hits - 1) {
            const int64_t n = n0 + __builtin_ctz(hits);
            const float v = exact_logit(x, panels, rows, k_dim, n);
            (*count)++;
            if (best < 0 || v > best_val)
                best = n, best_val = v;
        }
    }
    return best;
}

/* Bars row m's tokens banned[0..nb) (stop tokens before min_tokens): their screen becomes -inf,
 * and where one of them may have held the best lower bound, that is found again without them. */
static float bar(float *s, const float *wnorm, float coef, float lb, const int64_t *banned, int64_t nb,
                 int64_t n_dim)
{
    int rescan = 0;
    for (int64_t i = 0; i < nb; i++) {
        const int64_t n = banned[i];
        if (n < 0 || n >= n_dim)
            continue;
        const float bound = fmaf(fabsf(s[n]), 0x1p-20f, coef * wnorm[n]);  /* as bound16 rounds it */
        rescan |= s[n] - bound >= lb;
        s[n] = -INFINITY;
    }
    return rescan ? lower_max(s, wnorm, coef, n_dim) : lb;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx.h"

enum { TILE_ROWS = 16 };

/* This thread's share of the screen on AMX tiles (called by every thread of the team): pairs of
 * panels, and within a pair every group of 16 rows (xb has m_dim rounded up to 16, zero rows),
 * so a pair's bf16 slice comes from memory once. Tiles: 0, 1 the two panels' 16 x 16 fp32
 * logits, 2 the rows' k block, 3, 4 the panels' k block. The logits go through c to s, with
 * each row's running max of the lower bounds. */
static void screen_amx(const uint32_t *xb, int64_t k2, const uint16_t *wb, const float *coef, const float *wnorm,
                       int64_t m_dim, int64_t n_dim, int64_t n16, float *s, __m512 *lbmax)
{
    struct tile_config cfg = {.palette = 1};
    for (int t = 0; t < 5; t++)
        cfg.rows[t] = TILE_ROWS, cfg.colsb[t] = 4 * LANES;
    _tile_loadconfig(&cfg);
    float c[TILE_ROWS][2 * LANES] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic, 4)
    for (int64_t n0 = 0; n0 < n16; n0 += 2 * LANES) {
        const int panels = n16 - n0 > LANES ? 2 : 1;
        const uint16_t *w0 = wb + n0 * 2 * k2, *w1 = w0 + LANES * 2 * k2;
        for (int64_t row = 0; lbmax && row < m_dim; row += TILE_ROWS) {  /* no lbmax, no memory: -2 */
            const uint32_t *xr = xb + row * k2;
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t kb = 0; kb < k2; kb += KBLOCK2) {
                _tile_loadd(2, xr + kb, k2 * 4);
                _tile_loadd(3, w0 + kb * 2 * LANES, 4 * LANES);
                _tile_dpbf16ps(0, 2, 3);
                if (panels == 2) {
                    _tile_loadd(4, w1 + kb * 2 * LANES, 4 * LANES);
                    _tile_dpbf16ps(1, 2, 4);
                }
            }
            _tile_stored(0, &c[0][0], sizeof c[0]);
            _tile_stored(1, &c[0][LANES], sizeof c[0]);
            for (int64_t m = row; m < m_dim && m < row + TILE_ROWS; m++)
                for (int p = 0; p < panels; p++) {
                    const int64_t n = n0 + p * LANES;
                    const __mmask16 valid = n_dim - n >= LANES ? 0xFFFF
                                            : n_dim <= n ? 0 : (__mmask16)((1u << (n_dim - n)) - 1);
                    const __m512 sv = _mm512_load_ps(&c[m - row][p * LANES]);
                    _mm512_storeu_ps(s + m * n16 + n, sv);
                    const __m512 bound = bound16(sv, _mm512_set1_ps(coef[m]), wnorm + n);
                    lbmax[m] = _mm512_mask_max_ps(lbmax[m], valid, lbmax[m], _mm512_sub_ps(sv, bound));
                }
        }
    }
    _tile_release();
}

int greedy_head_amx_ready(void) { return amx_permitted(); }
#else
enum { TILE_ROWS = 1 };
static void screen_amx(const uint32_t *xb, int64_t k2, const uint16_t *wb, const float *coef, const float *wnorm,
                       int64_t m_dim, int64_t n_dim, int64_t n16, float *s, __m512 *lbmax)
{
    (void)xb, (void)k2, (void)wb, (void)coef, (void)wnorm, (void)m_dim, (void)n_dim, (void)n16, (void)s, (void)lbmax;
}

int greedy_head_amx_ready(void) { return 0; }
#endif

/* x [M, K] (row stride ldx); wb: the bf16 panels; panels: panel_gemm.c's fp32 packing of the
 * same W; rows: W [N, K] where the caller keeps it, else NULL; wnorm [N16]: ||W_j|| (0 past N);
 * s: scratch [M, N16]; banned: the barred token ids of row m at banned[offsets[m] ..
 * offsets[m + 1]); tokens [M]; candidates: the number of exact
 * logits computed, over all rows; amx: screen on the AMX tiles where greedy_head_amx_ready(). */
int greedy_head(const float *x, int64_t ldx, const uint16_t *wb, const float *panels, const float *rows,
                const float *wnorm, int64_t m_dim, int64_t n_dim, int64_t k_dim, const int64_t *banned, const int64_t *offsets,
                float *s, int64_t *tokens, int64_t *candidates, int64_t amx)
{
    const int64_t k2 = ((k_dim + 1) / 2 + KBLOCK2 - 1) / KBLOCK2 * KBLOCK2;
    const int64_t n16 = (n_dim + LANES - 1) / LANES * LANES;
    const float g = (float)k_dim * 0x1p-24f, u = 0x1p-8f;
    const int tiles = amx && greedy_head_amx_ready();
    /* The rows in bf16 pairs, zero past k_dim, and zero rows up to a whole tile. */
    uint32_t *xb = calloc((m_dim + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS * k2, sizeof(uint32_t));
    float *coef = malloc(m_dim * sizeof(float)), *lb = malloc(m_dim * sizeof(float));
    if (!xb || !coef || !lb) {
        free(xb), free(coef), free(lb);
        return -3;
    }
    for (int64_t m = 0; m < m_dim; m++) {
        const float *xm = x + m * ldx;
        uint16_t *dst = (uint16_t *)(xb + m * k2);
        double sq = 0.0;
        for (int64_t k = 0; k < k_dim; k++) {
            sq += (double)xm[k] * xm[k];
            dst[k] = _mm_cvtsi128_si32((__m128i)_mm_cvtneps_pbh(_mm_set1_ps(xm[k]))) & 0xFFFF;
        }
        coef[m] = (float)(1.01 * (2.0 * u + u * u + 3.0 * g) * sqrt(sq));
        lb[m] = -INFINITY;
    }
    /* Panels outermost and every row group within: a panel's bf16 slice (K x 16, 18 KB on the
     * default model) is read from memory once and from L1 for the later groups. */
#pragma omp parallel
    {
        __m512 *lbmax = aligned_alloc(64, (size_t)(m_dim + ROWS) * sizeof(__m512));
        for (int64_t m = 0; lbmax && m < m_dim + ROWS; m++)
            lbmax[m] = _mm512_set1_ps(-INFINITY);
        if (tiles) {
            screen_amx(xb, k2, wb, coef, wnorm, m_dim, n_dim, n16, s, lbmax);
        } else {
#pragma omp for schedule(dynamic, 8)
            for (int64_t n0 = 0; n0 < n16; n0 += LANES) {
                const __mmask16 valid = n_dim - n0 >= LANES ? 0xFFFF : (__mmask16)((1u << (n_dim - n0)) - 1);
                for (int64_t row = 0; lbmax && row < m_dim; row += ROWS)
                    screen(xb + row * k2, k2, wb + n0 * 2 * k2, coef + row, wnorm + n0, m_dim - row < ROWS ? (int)(m_dim - row)
                           : ROWS, valid, s + row * n16 + n0, n16, lbmax + row);
            }
        }
#pragma omp critical
        for (int64_t m = 0; m < m_dim; m++) {
            const float part = lbmax ? _mm512_reduce_max_ps(lbmax[m]) : INFINITY;  /* no memory: -2 below */
            lb[m] = part > lb[m] ? part : lb[m];
        }
        free(lbmax);
    }
    int bad = 0;
    int64_t count = 0;
#pragma omp parallel for schedule(dynamic) reduction(+ : count) reduction(| : bad)
    for (int64_t m = 0; m < m_dim; m++) {
        float *sm = s + m * n16;
        const float lbm = bar(sm, wnorm, coef[m], lb[m], banned + offsets[m], offsets[m + 1] - offsets[m], n_dim);
        tokens[m] = pick(x + m * ldx, sm, panels, rows, wnorm, coef[m], lbm, n_dim, k_dim, &count);
        bad |= tokens[m] < 0;
    }
    free(xb), free(coef), free(lb);
    *candidates = count;
    return bad ? -2 : 0;
}

/* out[m, u] = x[m] . W[ids[u]] for every row m and each of n_ids ids, exactly as panel_gemm.c
 * computes that logit (one FMA chain over k in order): the penalised greedy rows' logits at the
 * ids they have seen (backends/sampler.py). W is read from rows [N, K] where given (tied
 * embeddings: K floats an id in a row, 2.3 KB on the default model), else from the panels
 * (one float of each k's cache line: 36 KB an id). 16 rows a vector, 8 ids at a time (8
 * independent chains hide the FMA's latency); x goes through xt [K, 16] per row block. */
enum { IDS = 8 };
static void logits_block(const float *xt, const float *w, const int64_t *ids, int64_t n_ids, int64_t k_dim,
                         int has_rows, int64_t rows, float *out, int64_t ldo)
{
    const float *wn[IDS];
    const int64_t step = has_rows ? 1 : F32_PANEL;
    for (int i = 0; i < IDS; i++) {
        const int64_t n = ids[i < n_ids ? i : 0];
        wn[i] = has_rows ? w + n * k_dim : w + (n / F32_PANEL) * F32_PANEL * k_dim + n % F32_PANEL;
    }
    __m512 acc[IDS];
    for (int i = 0; i < IDS; i++)
        acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_dim; k++) {
        const __m512 xv = _mm512_loadu_ps(xt + k * LANES);
        for (int i = 0; i < IDS; i++)
            acc[i] = _mm512_fmadd_ps(xv, _mm512_set1_ps(wn[i][k * step]), acc[i]);
    }
    float v[IDS][LANES];
    for (int i = 0; i < IDS; i++)
        _mm512_storeu_ps(v[i], acc[i]);
    for (int64_t m = 0; m < rows; m++)
        for (int i = 0; i < IDS && i < n_ids; i++)
            out[m * ldo + i] = v[i][m];
}

/* x [M, K] (row stride ldx); w: W's rows [N, K] (has_rows) or panel_gemm.c's panels; out [M, n_ids]. */
int greedy_head_logits(const float *x, int64_t ldx, const float *w, int64_t has_rows, int64_t m_dim, int64_t k_dim,
                       const int64_t *ids, int64_t n_ids, float *out)
{
    float *xt = aligned_alloc(64, (size_t)k_dim * LANES * sizeof(float));
    if (!xt)
        return -3;
    for (int64_t row = 0; row < m_dim; row += LANES) {
        const int64_t rows = m_dim - row < LANES ? m_dim - row : LANES;
        for (int64_t k = 0; k < k_dim; k++)
            for (int64_t m = 0; m < LANES; m++)
                xt[k * LANES + m] = m < rows ? x[(row + m) * ldx + k] : 0.0f;
#pragma omp parallel for schedule(dynamic, 4) if (n_ids * k_dim >= 65536)  /* a team's start costs more below */
        for (int64_t u = 0; u < n_ids; u += IDS)
            logits_block(xt, w, ids + u, n_ids - u, k_dim, (int)has_rows, rows, out + row * n_ids + u, n_ids);
    }
    free(xt);
    return 0;
}

#else
int greedy_head(const float *x, int64_t ldx, const uint16_t *wb, const float *panels, const float *rows,
                const float *wnorm, int64_t m_dim, int64_t n_dim, int64_t k_dim, const int64_t *banned, const int64_t *offsets,
                float *s, int64_t *tokens, int64_t *candidates, int64_t amx)
{
    (void)x, (void)ldx, (void)wb, (void)panels, (void)rows, (void)wnorm, (void)m_dim, (void)n_dim, (void)k_dim;
    (void)banned, (void)offsets, (void)s, (void)tokens, (void)candidates, (void)amx;
    return -1;
}
int greedy_head_logits(const float *x, int64_t ldx, const float *w, int64_t has_rows, int64_t m_dim, int64_t k_dim,
                       const int64_t *ids, int64_t n_ids, float *out)
{
    (void)x, (void)ldx, (void)w, (void)has_rows, (void)m_dim, (void)k_dim, (void)ids, (void)n_ids, (void)out;
    return -1;
}
int greedy_head_amx_ready(void) { return 0; }
#endif
