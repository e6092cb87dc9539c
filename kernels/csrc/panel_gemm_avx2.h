/* panel_gemm.c's three GEMMs for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2 and 3, Intel
 * client cores), and its bf16 and int8 ones for AVX-512 CPUs without its BF16: the same packed
 * panels, read with 8-lane vectors, a panel's 48 columns six of them. Past 2 rows k goes in
 * blocks of KBLOCK steps, as in the AVX-512 code, so the other tiles re-read a block from L1.
 *
 * bf16 weights become fp32 in registers: a k pair of a column is one 32-bit word, its high half
 * the odd k's bf16 (the word masked) and its low half the even k's (the word shifted left 16),
 * both exact fp32. The rows stay fp32, so each product is fp32 x an exact weight, and each output
 * is one fused multiply-add chain over k in order (a row's result does not depend on its batch).
 * int8 weights take the rows as int16 with a scale per row and 32 k, as the AVX-512 code does off
 * the tiles; vpmaddwd (two products of int16 summed in int32) then vpaddd stands for vpdpwssd.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>

/* PANEL: panel_gemm.c's, which includes this header. */
enum { ROWS = 6, KBLOCK = 64, GROUP2 = 16 /* k2 steps of an int8 scale group (32 k) */ };

/* A register tile: `rows` rows (1..ROWS) by `vecs` vectors of 8 columns (6: the whole panel, for
 * 1 or 2 rows; 3: half of it, for up to 4 rows), from the panel's vector j0: at most 12
 * accumulators of the 16 registers. One or two rows take the panel whole, so its stream is read
 * once in order; more rows take 4 x 3 tiles, each weight vector loaded serving 4 rows (2 x 6
 * spilled accumulators in the bf16 form and left 65 % of the FMA rate unused at 16 rows). */

/* How panels are shared out: panel_gemm.c's runs_contiguous, fp32 too on an AVX2 CPU. */
static inline int panel_runs_contiguous(int64_t m_dim)
{
    return runs_contiguous(m_dim);
}

/* The first `count` of 8 lanes, as vmaskmov takes it. */
static inline __m256i lanes8(int64_t count)
{
    const int c = count >= 8 ? 8 : count <= 0 ? 0 : (int)count;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* A tile's column masks (of the panel's first `cols`) and accumulators: zero when k0 == 0, else
 * what y holds (the k blocks before); y points at the tile's first row and column. */
static inline __attribute__((always_inline)) void start_tile(__m256 (*acc)[6], __m256i mask[6], int rows, int vecs,
                                                            int j0, int64_t cols, int64_t k0, const float *y,
                                                            int64_t n)
{
    for (int j = 0; j < vecs; j++)
        mask[j] = lanes8(cols - 8 * (j0 + j));
    const int whole = cols >= 8 * (j0 + vecs);
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < vecs; j++)
            acc[m][j] = k0 == 0 ? _mm256_setzero_ps()
                        : whole ? _mm256_loadu_ps(y + m * n + 8 * j)
                                : _mm256_maskload_ps(y + m * n + 8 * j, mask[j]);
}

/* vmaskmovps stores are slow on AMD (a tile's 12 of them per k block cost more than its FMAs):
 * whole vectors take plain stores. */
static inline __attribute__((always_inline)) void store_tile(__m256 (*acc)[6], const __m256i mask[6], int rows,
                                                            int vecs, int j0, int64_t cols, float *y, int64_t n)
{
    const int whole = cols >= 8 * (j0 + vecs);
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < vecs; j++)
            if (whole)
                _mm256_storeu_ps(y + m * n + 8 * j, acc[m][j]);
            else
                _mm256_maskstore_ps(y + m * n + 8 * j, mask[j], acc[m][j]);
}

/* ahead 0: none (one or two rows stream the panel in order, which the hardware prefetcher follows:
 * software prefetches there cost 1 row 12-23 % in fp32). */
static inline void prefetch_step(const char *w, int64_t bytes, int64_t ahead)
{
    for (int64_t b = 0; ahead && b < bytes; b += 64)
        __builtin_prefetch(w + b, 0, 3);
}

/* fp32 panel, k in [k0, k1); rows, vecs and j0 constants after inlining. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t ldx, const float *w, int64_t n,
                                                          int64_t k0, int64_t k1, int64_t cols, int rows, int vecs,
                                                          int j0, int64_t ahead, float *y)
{
    __m256 acc[ROWS][6];
    __m256i mask[6];
    start_tile(acc, mask, rows, vecs, j0, cols, k0, y, n);
    const float *wk = w + k0 * PANEL + 8 * j0;
    for (int64_t k = k0; k < k1; k++, wk += PANEL) {
        prefetch_step((const char *)(wk + ahead * PANEL), vecs * 32, ahead);
        __m256 wj[6];
        for (int j = 0; j < vecs; j++)
            wj[j] = _mm256_loadu_ps(wk + 8 * j);
        for (int m = 0; m < rows; m++) {
            const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k);
            for (int j = 0; j < vecs; j++)
                acc[m][j] = _mm256_fmadd_ps(xv, wj[j], acc[m][j]);
        }
    }
    store_tile(acc, mask, rows, vecs, j0, cols, y, n);
}

/* bf16 panel ([K2][48][2]), k2 steps [k0, k1); k_dim: the rows' k (an odd last k has no pair). */
static inline __attribute__((always_inline)) void tile_bf16(const float *x, int64_t ldx, const uint16_t *w,
                                                           int64_t n, int64_t k_dim, int64_t k0, int64_t k1,
                                                           int64_t cols, int rows, int vecs, int j0, int64_t ahead,
                                                           float *y)
{
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 acc[ROWS][6];
    __m256i mask[6];
    start_tile(acc, mask, rows, vecs, j0, cols, k0, y, n);
    const uint16_t *wk = w + k0 * 2 * PANEL + 16 * j0;
    for (int64_t k = k0; k < k1; k++, wk += 2 * PANEL) {
        prefetch_step((const char *)(wk + ahead * 2 * PANEL), vecs * 32, ahead);
        const int pair = 2 * k + 1 < k_dim;
        __m256 w_even[6], w_odd[6];
        for (int j = 0; j < vecs; j++) {
            const __m256i pairs = _mm256_loadu_si256((const __m256i *)(wk + 16 * j));
            w_even[j] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
            w_odd[j] = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
        }
        for (int m = 0; m < rows; m++) {
            const float *xm = x + m * ldx + 2 * k;
            const __m256 even = _mm256_broadcast_ss(xm), odd = _mm256_set1_ps(pair ? xm[1] : 0.f);
            for (int j = 0; j < vecs; j++)
                acc[m][j] = _mm256_fmadd_ps(odd, w_odd[j], _mm256_fmadd_ps(even, w_even[j], acc[m][j]));
        }
    }
    store_tile(acc, mask, rows, vecs, j0, cols, y, n);
}

/* Eight fp16 scales as fp32 (F16C: every AVX2 CPU has it). */
static inline __m256 half8(const uint16_t *h)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* int8 panel ([K2][48][2], fp16 scales [groups][48]) on int16 rows xq [M, K2] with scales xs [M, groups]:
 * k2 steps [k0, k1), whole groups but for the last. */
static inline __attribute__((always_inline)) void tile_i16(const uint32_t *xq, const float *xs, int64_t k2_dim,
                                                          const int8_t *w, const uint16_t *scale, int64_t n,
                                                          int64_t k0, int64_t k1, int64_t cols, int rows, int vecs,
                                                          int j0, int64_t ahead, float *y)
{
    const int64_t groups = (k2_dim + GROUP2 - 1) / GROUP2;
    __m256 acc[ROWS][6];
    __m256i mask[6];
    start_tile(acc, mask, rows, vecs, j0, cols, k0, y, n);
    const int8_t *wk = w + k0 * 2 * PANEL + 16 * j0;
    for (int64_t g0 = k0; g0 < k1; g0 += GROUP2) {
        const int64_t g1 = k1 - g0 < GROUP2 ? k1 : g0 + GROUP2, g = g0 / GROUP2;
        __m256i sum[ROWS][6];
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < vecs; j++)
                sum[m][j] = _mm256_setzero_si256();
        for (int64_t k = g0; k < g1; k++, wk += 2 * PANEL) {
            prefetch_step((const char *)(wk + ahead * 2 * PANEL), vecs * 16, ahead);
            __m256i wj[6];
            for (int j = 0; j < vecs; j++)
                wj[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wk + 16 * j)));
            for (int m = 0; m < rows; m++) {
                const __m256i xv = _mm256_set1_epi32((int)xq[m * k2_dim + k]);
                for (int j = 0; j < vecs; j++)
                    sum[m][j] = _mm256_add_epi32(sum[m][j], _mm256_madd_epi16(xv, wj[j]));
            }
        }
        for (int m = 0; m < rows; m++) {
            const __m256 row_scale = _mm256_set1_ps(xs[m * groups + g]);
            for (int j = 0; j < vecs; j++) {
                const __m256 both = _mm256_mul_ps(half8(scale + g * PANEL + 8 * (j0 + j)), row_scale);
                acc[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m][j]), both, acc[m][j]);
            }
        }
    }
    store_tile(acc, mask, rows, vecs, j0, cols, y, n);
}

/* A panel's every row tile over k blocks (a block: k steps for fp32, k2 steps for bf16 and int8):
 * the first tile of a block streams it in AHEAD steps ahead (6 KB: 32 steps of fp32 or bf16, 64 of
 * int8; 3 KB measured no different within this machine's noise), the others re-read it from L1
 * and fetch the next. Past 2 rows the tiles are TR rows by TV vectors, the panel in 6 / TV strips.
 * TILE(R, V, J0) runs one tile at row `row`. */
#define STRIPS(R, V)                                                                                           \
    for (int j0 = 0; j0 < 6; j0 += (V))                                                                        \
        TILE(R, V, j0);
#define EACH_TILE(K_DIM, AHEAD, TR, TV, TILE)                                                                  \
    const int64_t cols = n - col < PANEL ? n - col : PANEL;                                                   \
    const int wide = m_dim <= 2;                                                                              \
    const int64_t kblock = wide ? (K_DIM) : KBLOCK;                                                           \
    for (int64_t k0 = 0; k0 < (K_DIM); k0 += kblock) {                                                        \
        const int64_t k1 = (K_DIM) - k0 < kblock ? (K_DIM) : k0 + kblock;                                     \
        for (int64_t row = 0; row < m_dim; row += (TR)) {                                                     \
            const int64_t ahead = wide ? 0 : row == 0 ? (AHEAD) : kblock;                                     \
            float *yr = y + row * n + col;                                                                    \
            switch (wide ? -(int)m_dim : m_dim - row < (TR) ? (int)(m_dim - row) : (TR)) {                    \
            case -1: TILE(1, 6, 0); break;                                                                    \
            case -2: TILE(2, 6, 0); break;                                                                    \
            case 1: STRIPS(1, TV) break;                                                                      \
            case 2: STRIPS(2, TV) break;                                                                      \
            case 3: STRIPS(3, TV) break;                                                                      \
            case 4: STRIPS(4, TV) break;                                                                      \
            case 5: STRIPS(5, TV) break;                                                                      \
            default: STRIPS(6, TV) break;                                                                     \
            }                                                                                                 \
        }                                                                                                     \
    }

static void panel_f32(const float *x, int64_t ldx, const float *w, int64_t m_dim, int64_t n, int64_t k_dim,
                      int64_t col, float *y)
{
#define TILE(R, V, J0) tile_f32(x + row * ldx, ldx, w, n, k0, k1, cols, R, V, J0, ahead, yr + 8 * (J0))
    if (m_dim <= 4) { /* 3 or 4 rows: 4 x 3 tiles (6 x 2 ones would be a third empty: 1.16x the time) */
        EACH_TILE(k_dim, 32, 4, 3, TILE)
    } else {
        EACH_TILE(k_dim, 32, 6, 2, TILE)
    }
#undef TILE
}

static void panel_bf16(const float *x, int64_t ldx, const uint16_t *w, int64_t m_dim, int64_t n, int64_t k_dim,
                       int64_t col, float *y)
{
    const int64_t k2_dim = (k_dim + 1) / 2;
#define TILE(R, V, J0) tile_bf16(x + row * ldx, ldx, w, n, k_dim, k0, k1, cols, R, V, J0, ahead, yr + 8 * (J0))
    EACH_TILE(k2_dim, 32, 4, 2, TILE)
#undef TILE
}

static void panel_i16(const uint32_t *xq, const float *xs, const int8_t *w, const uint16_t *scale, int64_t m_dim,
                      int64_t n, int64_t k2_dim, int64_t col, float *y)
{
    const int64_t groups = (k2_dim + GROUP2 - 1) / GROUP2;
#define TILE(R, V, J0)                                                                                         \
    tile_i16(xq + row * k2_dim, xs + row * groups, k2_dim, w, scale, n, k0, k1, cols, R, V, J0, ahead, yr + 8 * (J0))
    EACH_TILE(k2_dim, 64, 4, 2, TILE) /* KBLOCK: whole groups */
#undef TILE
}
#undef EACH_TILE
#undef STRIPS

/* Group i (row i / groups, its k from i % groups * 32) of x [M, K] as int16 pairs in xq [M, K2]
 * (zero past k_dim) and its scale xs[i], as the AVX-512 code's group_to_i16: the group's largest
 * |x| / 32767, round to nearest even; a NaN or an infinity in the group gives a NaN scale. */
static inline void group_to_i16(const float *x, int64_t ldx, int64_t k_dim, int64_t i, uint32_t *xq, float *xs)
{
    const int64_t k2_dim = (k_dim + 1) / 2, groups = (k2_dim + GROUP2 - 1) / GROUP2;
    const int64_t m = i / groups, k = i % groups * 2 * GROUP2;
    const int64_t end = k_dim - k < 2 * GROUP2 ? k_dim : k + 2 * GROUP2;
    const float *row = x + m * ldx;
    float top = 0.f;
    int finite = 1;
    for (int64_t j = k; j < end; j++) {
        finite &= isfinite(row[j]) != 0;
        top = fabsf(row[j]) > top ? fabsf(row[j]) : top;
    }
    const float inv = finite && top > 0 ? 32767.0f / top : 0.0f;
    xs[i] = finite ? top / 32767.0f : __builtin_nanf("");
    int16_t *q = (int16_t *)(xq + m * k2_dim);
    const int64_t pad = 2 * k2_dim - k < 2 * GROUP2 ? 2 * k2_dim : k + 2 * GROUP2;
    for (int64_t j = k; j < pad; j++) {
        const float v = j < end ? nearbyintf(row[j] * inv) : 0.f;
        q[j] = (int16_t)(v > 32767.f ? 32767 : v < -32768.f ? -32768 : v);
    }
}

/* xb: unused (the rows stay fp32). */
int panel_gemm_bf16(const float *x, int64_t ldx, const uint16_t *w, int64_t m_dim, int64_t n, int64_t k_dim,
                    float *y, uint32_t *xb)
{
    (void)xb;
    const int64_t panels = (n + PANEL - 1) / PANEL, k2_dim = (k_dim + 1) / 2;
    PANEL_RUNS(runs, threads, panels, panel_runs_contiguous(m_dim));
#pragma omp parallel
    for (int64_t p; (p = next_panel(runs, threads)) >= 0;)
        panel_bf16(x, ldx, w + p * PANEL * 2 * k2_dim, m_dim, n, k_dim, p * PANEL, y);
    return 0;
}

/* xb: the int16 rows, M * K2 words, then their scales, M * groups. */
int panel_gemm_i8(const float *x, int64_t ldx, const int8_t *w, int64_t m_dim, int64_t n, int64_t k_dim, float *y,
                  uint32_t *xb)
{
    const int64_t panels = (n + PANEL - 1) / PANEL, k2_dim = (k_dim + 1) / 2, groups = (k2_dim + GROUP2 - 1) / GROUP2;
    const uint16_t *scale = (const uint16_t *)(w + panels * PANEL * 2 * k2_dim);
    float *xs = (float *)(xb + m_dim * k2_dim);
    PANEL_RUNS(runs, threads, panels, panel_runs_contiguous(m_dim));
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m_dim * groups; i++)
            group_to_i16(x, ldx, k_dim, i, xb, xs);
        for (int64_t p; (p = next_panel(runs, threads)) >= 0;)
            panel_i16(xb, xs, w + p * PANEL * 2 * k2_dim, scale + p * groups * PANEL, m_dim, n, k2_dim, p * PANEL,
                      y);
    }
    return 0;
}
