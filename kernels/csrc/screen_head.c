/* The greedy token of each row of x [M, K] from a screen of the lm_head, on CPUs whose panel GEMM
 * keeps the rows fp32 under bf16 weights and int16 under int8 (panel_gemm_avx2.h's forms on AVX2
 * and on Skylake-SP; their 16-lane twins in panel_gemm.c on AVX-512 VNNI without its BF16, the
 * same chains): exactly argmax of the logits the full head gives, first index on ties, for half
 * of the head's weight stream.
 *
 * kernels/greedy_head.py's ScreenedHead computes the screen s = x @ W'.T with the panel GEMM on a
 * copy W' of the head in half its bytes (int8 groups of a bf16 head, bf16 of an fp32 one); this
 * file bounds each screen logit's distance to the exact one and computes again, exactly, only the
 * tokens whose interval reaches the best lower bound. "Exactly" is one fused multiply-add chain
 * over k in order, fp32 rows times the head's own weights: how panel_gemm_avx2.h computes an fp32
 * column, and a bf16 one (a k pair's even then odd product into the same chain), so the exact
 * values are bit for bit the full head's (the Python side checks that at load).
 *
 * The bound, per logit j, with E_j = ||W_j - W'_j||, N_j = ||W_j||, u = 2^-24:
 *   exact real value - screen real value = x . (W_j - W'_j) + (x - x') . W'_j
 * where x' is x as the screen GEMM reads it (int8 screens take x as int16 per 32 k, a step of
 * xs = max|x| / 32767 of the group, so |x_k - x'_k| <= 0.51 xs; a bf16 screen reads x itself),
 * so by Cauchy-Schwarz it is at most ||x|| E_j + ||x - x'|| (N_j + E_j). The fp32 chains add at
 * most 1.01 K u sum |x||W| (the exact one) and 1.01 (K + G + 2) u sum |x'||W'| (the screen's: K
 * terms for bf16; G groups, a product and a conversion for int8), both within
 * c (||x|| + ||x - x'||)(N_j + E_j), c = 1.01 (2K + G + 8) u. The bound is computed in fp32 from
 * terms rounded up, inflated by 2^-18, plus 2^-20 |s_j| for the comparisons' own rounding.
 * With lo/hi_j = s_j -/+ bound_j and LB = max_j lo_j, the exact argmax j* has hi_j* >= LB, and
 * every j with hi_j < LB is below it: the candidates {j : hi_j >= LB} hold j* and its ties.
 *
 * head_argmax, at the end, is the greedy token of heads with no such screen: the full logits and
 * their argmax in one call.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "panel_gemm.c"

enum { GROUP = 32, MAX_CANDIDATES = 1024 };  /* PANEL: panel_gemm.c's */

/* Where the exact weights are: the head's fp32 rows [N, K] (read as they are, or rounded to bf16
 * as torch rounds them: a bf16 head made from those rows), or the panel GEMM's packing of the head
 * ([N / 48][K][48] fp32, [N / 48][K2][48][2] bf16). */
enum { ROWS_F32 = 0, ROWS_AS_BF16 = 1, PANELS_F32 = 2, PANELS_BF16 = 3, PANELS_BF16_PAIRS = 4 };
/* PANELS_BF16_PAIRS: the bf16 packing read as the AVX-512 BF16 GEMM reads it (screen_head_pairs). */

static inline float bf16_round(float v)
{
    uint32_t b;
    memcpy(&b, &v, 4);
    if (isnan(v))
        b = 0x7FC00000u;  /* torch's NaN */
    else if ((b & 0x7F800000u) != 0x7F800000u)  /* infinities stay */
        b += 0x7FFFu + ((b >> 16) & 1u);
    b &= 0xFFFF0000u;
    memcpy(&v, &b, 4);
    return v;
}

static inline float bf16_value(uint16_t h)
{
    const uint32_t b = (uint32_t)h << 16;
    float v;
    memcpy(&v, &b, 4);
    return v;
}

static inline float weight_at(const void *w, int layout, int64_t n, int64_t k, int64_t k_dim)
{
    const int64_t panel = n / PANEL, col = n % PANEL;
    switch (layout) {
    case ROWS_F32: return ((const float *)w)[n * k_dim + k];
    case ROWS_AS_BF16: return bf16_round(((const float *)w)[n * k_dim + k]);
    case PANELS_F32: return ((const float *)w)[(panel * k_dim + k) * PANEL + col];
    default: {
        const int64_t k2_dim = (k_dim + 1) / 2;
        return bf16_value(((const uint16_t *)w)[((panel * k2_dim + k / 2) * PANEL + col) * 2 + k % 2]);
    }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <immintrin.h>
enum { PAIRS = 1 };

/* x . W_n as tile_pairs computes it (panel_gemm.c): the row rounded to bf16 as the GEMM rounds it
 * (row_to_bf16), then one vdpbf16ps chain over the k pairs of the 16 columns holding n, in order,
 * with the same operands (vdpbf16ps rounds as it rounds, so no scalar code can stand in for it). */
static float pairs_logit(const float *x, const void *w, int64_t n, int64_t k_dim)
{
    const int64_t k2_dim = (k_dim + 1) / 2;
    uint32_t xb[k2_dim];
    row_to_bf16(x, k_dim, xb);
    const char *wk = (const char *)w + (n / PANEL) * 4 * PANEL * k2_dim + (n % PANEL) / 16 * 64;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < k2_dim; k++, wk += 4 * PANEL)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)xb[k]), (__m512bh)_mm512_loadu_si512(wk));
    float out[16];
    _mm512_storeu_ps(out, acc);
    return out[n % 16];
}
#else
enum { PAIRS = 0 };

static float pairs_logit(const float *x, const void *w, int64_t n, int64_t k_dim)
{
    (void)x, (void)w, (void)n, (void)k_dim;
    return __builtin_nanf("");
}
#endif

/* x . W_n as the panel GEMM computes it: one FMA chain over k in order (the AVX-512 BF16 GEMM's
 * chain of k pairs for PANELS_BF16_PAIRS). */
static float exact_logit(const float *x, const void *w, int layout, int64_t n, int64_t k_dim)
{
    if (layout == PANELS_BF16_PAIRS)
        return pairs_logit(x, w, n, k_dim);
    float acc = 0.0f;
    for (int64_t k = 0; k < k_dim; k++)
        acc = fmaf(x[k], weight_at(w, layout, n, k, k_dim), acc);
    return acc;
}

/* The bound above holds for GEMMs that keep the rows fp32 under bf16 weights and int16 groups under
 * int8 (panel_gemm_avx2.h's, and panel_gemm.c's for AVX-512 VNNI without its BF16). The AVX-512 BF16
 * forms round the rows to bf16 and sum k pairs: there screen_head_pairs screens a bf16 head. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int screen_head_ready(void) { return !PAIRS; }

/* ||x - x'|| for the int16 rows of panel_gemm_avx2.h's group_to_i16 (an upper bound). */
static double int16_error(const float *x, int64_t k_dim)
{
    double sq = 0.0;
    for (int64_t k0 = 0; k0 < k_dim; k0 += GROUP) {
        const int64_t end = k_dim - k0 < GROUP ? k_dim : k0 + GROUP;
        float top = 0.0f;
        for (int64_t k = k0; k < end; k++)
            top = fabsf(x[k]) > top ? fabsf(x[k]) : top;
        const double step = 0.51 * top / 32767.0;
        sq += (double)(end - k0) * step * step;
    }
    return sqrt(sq);
}

/* Row m's token: the screen's bounds turned into hi_j (kept in s) and the best lower bound, the
 * candidates collected, then the winner among them. Returns the token, or -1 (no candidate: a
 * row that is not finite, or every token barred), or -2 (more than MAX_CANDIDATES: the full
 * logits are cheaper). */
static int64_t pick_row(const float *x, float *s, const float *norms, int64_t n_dim, int64_t k_dim, int64_t groups,
                        int int16_rows, const void *w, int layout, const int64_t *banned, int64_t nb,
                        int64_t *count)
{
    double xsq = 0.0;
    for (int64_t k = 0; k < k_dim; k++)
        xsq += (double)x[k] * x[k];
    const double xn = sqrt(xsq), dn = int16_rows ? int16_error(x, k_dim) : 0.0;
    const double c = 1.01 * (2.0 * k_dim + groups + 8) * 0x1p-24, inflate = 1.0 + 0x1p-18;
    /* bound_j = P E_j + Q N_j + 2^-20 |s_j| + A. A: vdpbf16ps flushes subnormal products and sums
     * and reads subnormal weights as zero, at most 2^-126 a term: (K + sum |x|) 2^-125 in all. */
    const float p = (float)((xn + dn + c * (xn + dn)) * inflate), q = (float)((dn + c * (xn + dn)) * inflate);
    double l1 = 0.0;
    for (int64_t k = 0; layout == PANELS_BF16_PAIRS && k < k_dim; k++)
        l1 += fabs((double)x[k]);
    const float a = layout == PANELS_BF16_PAIRS ? (float)((k_dim + l1) * 0x1p-124) : 0.0f;
    if (!isfinite(p) || !isfinite(q) || !isfinite(a))
        return -1;
    for (int64_t i = 0; i < nb; i++)
        if (banned[i] >= 0 && banned[i] < n_dim)
            s[banned[i]] = -INFINITY;
    const float *error = norms, *norm = norms + n_dim;
    const __m256 vp = _mm256_set1_ps(p), vq = _mm256_set1_ps(q), tiny = _mm256_set1_ps(0x1p-20f);
    const __m256 sign = _mm256_set1_ps(-0.0f), va = _mm256_set1_ps(a);
    __m256 lbv = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n_dim; j += 8) {
        const __m256 sv = _mm256_loadu_ps(s + j);
        const __m256 bound = _mm256_fmadd_ps(_mm256_andnot_ps(sign, sv), tiny,
                                             _mm256_fmadd_ps(vp, _mm256_loadu_ps(error + j),
                                                             _mm256_fmadd_ps(vq, _mm256_loadu_ps(norm + j), va)));
        lbv = _mm256_max_ps(_mm256_sub_ps(sv, bound), lbv);  /* a NaN lower bound keeps lbv */
        _mm256_storeu_ps(s + j, _mm256_add_ps(sv, bound));
    }
    float lanes[8], lb = -INFINITY;
    _mm256_storeu_ps(lanes, lbv);
    for (int i = 0; i < 8; i++)
        lb = lanes[i] > lb ? lanes[i] : lb;
    for (; j < n_dim; j++) {
        const float bound = fmaf(fabsf(s[j]), 0x1p-20f, fmaf(p, error[j], fmaf(q, norm[j], a)));
        lb = s[j] - bound > lb ? s[j] - bound : lb;
        s[j] += bound;
    }
    int64_t hits[MAX_CANDIDATES], n_hits = 0;
    const __m256 vlb = _mm256_set1_ps(lb);
    for (j = 0; j < n_dim; j += 8) {
        unsigned mask = 0;
        if (j + 8 <= n_dim)
            mask = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + j), vlb, _CMP_GE_OQ));
        else
            for (int64_t t = j; t < n_dim; t++)
                mask |= (unsigned)(s[t] >= lb) << (t - j);
        for (; mask; mask &= mask - 1) {
            if (n_hits == MAX_CANDIDATES)
                return -2;
            hits[n_hits++] = j + __builtin_ctz(mask);
        }
    }
    int64_t best = -1;
    float best_val = 0.0f;
    for (int64_t i = 0; i < n_hits; i++) {
        const float v = exact_logit(x, w, layout, hits[i], k_dim);
        if (best < 0 || v > best_val)
            best = hits[i], best_val = v;
    }
    *count += n_hits;
    return best;
}
#else
int screen_head_ready(void) { return 0; }

static int64_t pick_row(const float *x, float *s, const float *norms, int64_t n_dim, int64_t k_dim, int64_t groups,
                        int int16_rows, const void *w, int layout, const int64_t *banned, int64_t nb,
                        int64_t *count)
{
    (void)x, (void)s, (void)norms, (void)n_dim, (void)k_dim, (void)groups, (void)int16_rows, (void)w, (void)layout;
    (void)banned, (void)nb, (void)count;
    return -1;
}
#endif

/* Each row's token from its screen logits s [M, N] (pick_row); 0, or -2 where a row has none. */
static int pick_rows(const float *x, int64_t ldx, float *s, const float *norms, int64_t m_dim, int64_t n_dim,
                     int64_t k_dim, int int16_rows, const void *w, int layout, const int64_t *banned,
                     const int64_t *offsets, int64_t *tokens, int64_t *candidates)
{
    const int64_t groups = (k_dim + GROUP - 1) / GROUP;
    int64_t count = 0;
    int bad = 0;
#pragma omp parallel for schedule(dynamic) reduction(+ : count) reduction(| : bad) if (m_dim > 1)
    for (int64_t m = 0; m < m_dim; m++) {
        tokens[m] = pick_row(x + m * ldx, s + m * n_dim, norms, n_dim, k_dim, groups, int16_rows, w, layout,
                             banned + offsets[m], offsets[m + 1] - offsets[m], &count);
        bad |= tokens[m] < 0;
    }
    *candidates = count;
    return bad ? -2 : 0;
}

/* x [M, K] (row stride ldx); screen: the panel GEMM's packing of W' (kind 1 bf16, 2 int8); norms
 * [2][N]: every E_j, then every N_j (rounded up); w, layout: the exact weights; banned: row m's
 * barred ids at banned[offsets[m] .. offsets[m + 1]); s: scratch [M, N] (the screen logits); xb:
 * the GEMM's row scratch (kernels.linear.scratch_words); tokens [M]; candidates: exact logits
 * computed over all rows. Returns 0, or -2 when a row has no candidate or too many, or the library
 * was built without AVX2 and FMA (the caller takes the full logits). */
int screen_head(const float *x, int64_t ldx, const void *screen, int64_t kind, const float *norms, int64_t m_dim,
                int64_t n_dim, int64_t k_dim, const void *w, int64_t layout, const int64_t *banned,
                const int64_t *offsets, float *s, uint32_t *xb, int64_t *tokens, int64_t *candidates)
{
    const int rc = kind == 2 ? panel_gemm_i8(x, ldx, (const int8_t *)screen, m_dim, n_dim, k_dim, s, xb)
                             : panel_gemm_bf16(x, ldx, (const uint16_t *)screen, m_dim, n_dim, k_dim, s, xb);
    if (rc != 0)
        return -2;
    return pick_rows(x, ldx, s, norms, m_dim, n_dim, k_dim, kind == 2, w, (int)layout, banned, offsets, tokens,
                     candidates);
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
int screen_head_pairs_ready(void) { return 1; }

/* Whether the panel GEMM would take m rows of k to the AMX tiles, as a bf16 head or as its int8
 * screen (gemm_pairs' test): the tiles sum k in another order, and bf16 rows in the screen. */
static int pairs_on_tiles(int64_t m_dim, int64_t k_dim)
{
    const int bf16 = panel_amx_min_rows > 0 && m_dim >= panel_amx_min_rows;
    const int i8 = panel_amx_min_rows_i8 > 0 && m_dim >= panel_amx_min_rows_i8;
    return (bf16 || i8) && (k_dim + 1) / 2 >= AMX_K2 && amx_permitted();
}

/* The rows as the AVX-512 BF16 GEMM reads them: each x rounded to bf16 (nearest even, subnormals
 * flushed, as row_to_bf16 rounds), kept as fp32. */
static void round_rows(const float *x, int64_t ldx, int64_t m_dim, int64_t k_dim, float *xr)
{
    for (int64_t m = 0; m < m_dim; m++)
        for (int64_t k = 0; k < k_dim; k += 16) {
            const __mmask16 mask = lanes(k_dim - k);
            const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + m * ldx + k));
            const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            _mm512_mask_storeu_ps(xr + m * k_dim + k, mask, v);
        }
}

/* The greedy token of each row of x [M, K] under a bf16 head on the AVX-512 BF16 GEMM (panel_gemm.c's
 * tile_pairs), from an int8 screen as screen_head's: the rows rounded to bf16 first (xr, [M, K]
 * scratch), so the screen bounds its distance to the real x_r . W_j; the full head's value is that
 * plus its chain's rounding, which the bound's K terms cover (a vdpbf16ps rounds at most twice a k
 * pair), and the exact values are the full head's chain (pairs_logit). screen: int8 groups of the
 * bf16 values (kind 2); w: the bf16 panels; the rest as screen_head's. Returns 0, -2 (a row with no
 * candidate or too many), or -3 where the GEMM would run these rows on the AMX tiles (another chain):
 * the caller takes the full head. */
int screen_head_pairs(const float *x, int64_t ldx, const int8_t *screen, const float *norms, int64_t m_dim,
                      int64_t n_dim, int64_t k_dim, const uint16_t *w, const int64_t *banned, const int64_t *offsets,
                      float *s, float *xr, uint32_t *xb, int64_t *tokens, int64_t *candidates)
{
    if (pairs_on_tiles(m_dim, k_dim))
        return -3;
    round_rows(x, ldx, m_dim, k_dim, xr);
    if (panel_gemm_i8(xr, k_dim, screen, m_dim, n_dim, k_dim, s, xb) != 0)
        return -2;
    return pick_rows(xr, k_dim, s, norms, m_dim, n_dim, k_dim, 1, w, PANELS_BF16_PAIRS, banned, offsets, tokens,
                     candidates);
}
#else
int screen_head_pairs_ready(void) { return 0; }

int screen_head_pairs(const float *x, int64_t ldx, const int8_t *screen, const float *norms, int64_t m_dim,
                      int64_t n_dim, int64_t k_dim, const uint16_t *w, const int64_t *banned, const int64_t *offsets,
                      float *s, float *xr, uint32_t *xb, int64_t *tokens, int64_t *candidates)
{
    (void)x, (void)ldx, (void)screen, (void)norms, (void)m_dim, (void)n_dim, (void)k_dim, (void)w, (void)banned;
    (void)offsets, (void)s, (void)xr, (void)xb, (void)tokens, (void)candidates;
    return -3;
}
#endif

/* out[m, u] = x[m] . W[ids[u]] for each of n_ids ids, bit for bit the full head's logit. */
int screen_head_logits(const float *x, int64_t ldx, const void *w, int64_t layout, int64_t m_dim, int64_t k_dim,
                       const int64_t *ids, int64_t n_ids, float *out)
{
#pragma omp parallel for schedule(static) if (m_dim * n_ids * k_dim >= 65536)
    for (int64_t i = 0; i < m_dim * n_ids; i++)
        out[i] = exact_logit(x + (i / n_ids) * ldx, w, (int)layout, ids[i % n_ids], k_dim);
    return 0;
}

/* Row m's argmax as torch's and numpy's: the first index of the largest value, the first NaN where
 * there is one; barred ids are -inf first (every id barred: 0, as the full logits give). */
static int64_t argmax_row(float *s, int64_t n_dim, const int64_t *banned, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++)
        if (banned[i] >= 0 && banned[i] < n_dim)
            s[banned[i]] = -INFINITY;
    float best = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t j = 0; j < n_dim; j++) {
        best = s[j] > best ? s[j] : best;
        nan |= s[j] != s[j];
    }
    /* the first hit, a block of 256 at a time (a loop that stops at its hit is not vectorized) */
    for (int64_t j0 = 0; j0 < n_dim; j0 += 256) {
        const int64_t j1 = n_dim - j0 < 256 ? n_dim : j0 + 256;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t j = j0; j < j1; j++)
            hit |= nan ? s[j] != s[j] : s[j] == best;
        if (hit)
            for (int64_t j = j0;; j++)
                if (nan ? s[j] != s[j] : s[j] == best)
                    return j;
    }
    return 0;
}

/* The greedy token of each row of x [M, K] from the full head's logits, for heads with no screen of
 * half their bytes (int8, kind 2) or where the screen's bound does not hold (bf16, kind 1, on
 * AVX-512 BF16): the logits and their argmax in one call, so a step's token costs no tensor
 * operations around the GEMM. w: the panel GEMM's packing; banned, offsets, s, xb, tokens as
 * screen_head's. Returns 0, or -2 (no such GEMM in this build). */
int head_argmax(const float *x, int64_t ldx, const void *w, int64_t kind, int64_t m_dim, int64_t n_dim,
                int64_t k_dim, const int64_t *banned, const int64_t *offsets, float *s, uint32_t *xb, int64_t *tokens)
{
    const int rc = kind == 2 ? panel_gemm_i8(x, ldx, (const int8_t *)w, m_dim, n_dim, k_dim, s, xb)
                 : kind == 1 ? panel_gemm_bf16(x, ldx, (const uint16_t *)w, m_dim, n_dim, k_dim, s, xb) : -1;
    if (rc != 0)
        return -2;
#pragma omp parallel for schedule(static) if (m_dim > 1)
    for (int64_t m = 0; m < m_dim; m++)
        tokens[m] = argmax_row(s + m * n_dim, n_dim, banned + offsets[m], offsets[m + 1] - offsets[m]);
    return 0;
}
