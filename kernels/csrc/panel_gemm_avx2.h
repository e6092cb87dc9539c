/* panel_gemm.c's three GEMMs for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2 and 3, Intel
 * client cores): the same packed panels, read with 8-lane vectors, a panel's 48 columns six of
 * them. A register tile is 2 rows (12 accumulators of the 16 registers); past 2 rows k goes in
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

enum { PANEL = 48, ROWS = 2, KBLOCK = 64, GROUP2 = 16 /* k2 steps of an int8 scale group (32 k) */ };

/* The first `count` of 8 lanes, as vmaskmov takes it. */
static inline __m256i lanes8(int64_t count)
{
    const int c = count >= 8 ? 8 : count <= 0 ? 0 : (int)count;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The masks of a panel's six parts of 8 columns for its first `cols`, and a tile's accumulators:
 * zero when k0 == 0, else what y holds (the k blocks before). */
static inline __attribute__((always_inline)) void start_tile(__m256 (*acc)[6], __m256i mask[6], int rows,
                                                            int64_t cols, int64_t k0, const float *y, int64_t n)
{
    for (int j = 0; j < 6; j++)
        mask[j] = lanes8(cols - 8 * j);
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 6; j++)
            acc[m][j] = k0 == 0 ? _mm256_setzero_ps() : _mm256_maskload_ps(y + m * n + 8 * j, mask[j]);
}

static inline __attribute__((always_inline)) void store_tile(__m256 (*acc)[6], const __m256i mask[6], int rows,
                                                            float *y, int64_t n)
{
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 6; j++)
            _mm256_maskstore_ps(y + m * n + 8 * j, mask[j], acc[m][j]);
}

static inline void prefetch_step(const char *w, int64_t bytes)
{
    for (int64_t b = 0; b < bytes; b += 64)
        _mm_prefetch(w + b, _MM_HINT_T0);
}

/* fp32 panel, k in [k0, k1), rows 1..ROWS (a constant after inlining). */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t ldx, const float *w, int64_t n,
                                                          int64_t k0, int64_t k1, int64_t cols, int rows,
                                                          int64_t ahead, float *y)
{
    __m256 acc[ROWS][6];
    __m256i mask[6];
    start_tile(acc, mask, rows, cols, k0, y, n);
    const float *wk = w + k0 * PANEL;
    for (int64_t k = k0; k < k1; k++, wk += PANEL) {
        prefetch_step((const char *)(wk + ahead * PANEL), PANEL * 4);
        __m256 xv[ROWS];
        for (int m = 0; m < rows; m++)
            xv[m] = _mm256_broadcast_ss(x + m * ldx + k);
        for (int j = 0; j < 6; j++) {
            const __m256 wj = _mm256_loadu_ps(wk + 8 * j);
            for (int m = 0; m < rows; m++)
                acc[m][j] = _mm256_fmadd_ps(xv[m], wj, acc[m][j]);
        }
    }
    store_tile(acc, mask, rows, y, n);
}

/* bf16 panel ([K2][48][2]), k2 steps [k0, k1); k_dim: the rows' k (an odd last k has no pair). */
static inline __attribute__((always_inline)) void tile_bf16(const float *x, int64_t ldx, const uint16_t *w,
                                                           int64_t n, int64_t k_dim, int64_t k0, int64_t k1,
                                                           int64_t cols, int rows, int64_t ahead, float *y)
{
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 acc[ROWS][6];
    __m256i mask[6];
    start_tile(acc, mask, rows, cols, k0, y, n);
    const uint16_t *wk = w + k0 * 2 * PANEL;
    for (int64_t k = k0; k < k1; k++, wk += 2 * PANEL) {
        prefetch_step((const char *)(wk + ahead * 2 * PANEL), PANEL * 4);
        __m256 even[ROWS], odd[ROWS];
        for (int m = 0; m < rows; m++) {
            even[m] = _mm256_broadcast_ss(x + m * ldx + 2 * k);
            odd[m] = 2 * k + 1 < k_dim ? _mm256_broadcast_ss(x + m * ldx + 2 * k + 1) : _mm256_setzero_ps();
        }
        for (int j = 0; j < 6; j++) {
            const __m256i pairs = _mm256_loadu_si256((const __m256i *)(wk + 16 * j));
            const __m256 w_even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
            const __m256 w_odd = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
            for (int m = 0; m < rows; m++) {
                acc[m][j] = _mm256_fmadd_ps(even[m], w_even, acc[m][j]);
                acc[m][j] = _mm256_fmadd_ps(odd[m], w_odd, acc[m][j]);
            }
        }
    }
    store_tile(acc, mask, rows, y, n);
}

/* int8 panel ([K2][48][2], scales [groups][48]) on int16 rows xq [M, K2] with scales xs [M, groups]:
 * k2 steps [k0, k1), whole groups but for the last. */
static inline __attribute__((always_inline)) void tile_i16(const uint32_t *xq, const float *xs, int64_t k2_dim,
                                                          const int8_t *w, const float *scale, int64_t n,
                                                          int64_t k0, int64_t k1, int64_t cols, int rows,
                                                          int64_t ahead, float *y)
{
    const int64_t groups = (k2_dim + GROUP2 - 1) / GROUP2;
    __m256 acc[ROWS][6];
    __m256i mask[6];
    start_tile(acc, mask, rows, cols, k0, y, n);
    const int8_t *wk = w + k0 * 2 * PANEL;
    for (int64_t g0 = k0; g0 < k1; g0 += GROUP2) {
        const int64_t g1 = k1 - g0 < GROUP2 ? k1 : g0 + GROUP2, g = g0 / GROUP2;
        __m256i sum[ROWS][6];
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < 6; j++)
                sum[m][j] = _mm256_setzero_si256();
        for (int64_t k = g0; k < g1; k++, wk += 2 * PANEL) {
            prefetch_step((const char *)(wk + ahead * 2 * PANEL), 2 * PANEL);
            __m256i xv[ROWS];
            for (int m = 0; m < rows; m++)
                xv[m] = _mm256_set1_epi32((int)xq[m * k2_dim + k]);
            for (int j = 0; j < 6; j++) {
                const __m256i wj = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wk + 16 * j)));
                for (int m = 0; m < rows; m++)
                    sum[m][j] = _mm256_add_epi32(sum[m][j], _mm256_madd_epi16(xv[m], wj));
            }
        }
        for (int m = 0; m < rows; m++) {
            const __m256 row_scale = _mm256_set1_ps(xs[m * groups + g]);
            for (int j = 0; j < 6; j++) {
                const __m256 both = _mm256_mul_ps(_mm256_loadu_ps(scale + g * PANEL + 8 * j), row_scale);
                acc[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m][j]), both, acc[m][j]);
            }
        }
    }
    store_tile(acc, mask, rows, y, n);
}

/* A panel's every row tile over k blocks (a block: k steps for fp32, k2 steps for bf16 and int8);
 * the first tile of a block streams it in AHEAD steps ahead (6 KB: 32 steps of fp32 or bf16, 64 of
 * int8; 3 KB measured no different within this machine's noise), the others re-read it from L1
 * and fetch the next. */
#define EACH_TILE(K_DIM, AHEAD, TILE)                                                                               \
    const int64_t cols = n - col < PANEL ? n - col : PANEL;                                                   \
    const int64_t kblock = m_dim > ROWS ? KBLOCK : (K_DIM);                                                   \
    for (int64_t k0 = 0; k0 < (K_DIM); k0 += kblock) {                                                        \
        const int64_t k1 = (K_DIM) - k0 < kblock ? (K_DIM) : k0 + kblock;                                     \
        for (int64_t row = 0; row < m_dim; row += ROWS) {                                                     \
            const int64_t ahead = row == 0 ? (AHEAD) : kblock;                                                \
            float *yr = y + row * n + col;                                                                    \
            if (m_dim - row >= 2)                                                                             \
                TILE(2);                                                                                      \
            else                                                                                              \
                TILE(1);                                                                                      \
        }                                                                                                     \
    }

static void panel_f32(const float *x, int64_t ldx, const float *w, int64_t m_dim, int64_t n, int64_t k_dim,
                      int64_t col, float *y)
{
#define TILE(R) tile_f32(x + row * ldx, ldx, w, n, k0, k1, cols, R, ahead, yr)
    EACH_TILE(k_dim, 32, TILE)
#undef TILE
}

static void panel_bf16(const float *x, int64_t ldx, const uint16_t *w, int64_t m_dim, int64_t n, int64_t k_dim,
                       int64_t col, float *y)
{
    const int64_t k2_dim = (k_dim + 1) / 2;
#define TILE(R) tile_bf16(x + row * ldx, ldx, w, n, k_dim, k0, k1, cols, R, ahead, yr)
    EACH_TILE(k2_dim, 32, TILE)
#undef TILE
}

static void panel_i16(const uint32_t *xq, const float *xs, const int8_t *w, const float *scale, int64_t m_dim,
                      int64_t n, int64_t k2_dim, int64_t col, float *y)
{
    const int64_t groups = (k2_dim + GROUP2 - 1) / GROUP2;
#define TILE(R) tile_i16(xq + row * k2_dim, xs + row * groups, k2_dim, w, scale, n, k0, k1, cols, R, ahead, yr)
    EACH_TILE(k2_dim, 64, TILE) /* KBLOCK: whole groups */
#undef TILE
}
#undef EACH_TILE

/* x [M, K] as int16 pairs xq [M, K2] (zero past k_dim) and their scales xs [M, groups], as the
 * AVX-512 code's rows_to_i16: a group's largest |x| / 32767, round to nearest even; a NaN or an
 * infinity in the group gives a NaN scale. */
static void rows_to_i16(const float *x, int64_t ldx, int64_t m_dim, int64_t k_dim, uint32_t *xq, float *xs)
{
    const int64_t k2_dim = (k_dim + 1) / 2, groups = (k2_dim + GROUP2 - 1) / GROUP2;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m_dim * groups; i++) {
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
}

int panel_gemm_f32(const float *x, int64_t ldx, const float *w, int64_t m_dim, int64_t n, int64_t k_dim,
                   float *y)
{
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(dynamic)
    for (int64_t p = 0; p < panels; p++)
        panel_f32(x, ldx, w + p * PANEL * k_dim, m_dim, n, k_dim, p * PANEL, y);
    return 0;
}

/* xb: unused (the rows stay fp32). */
int panel_gemm_bf16(const float *x, int64_t ldx, const uint16_t *w, int64_t m_dim, int64_t n, int64_t k_dim,
                    float *y, uint32_t *xb)
{
    (void)xb;
    const int64_t panels = (n + PANEL - 1) / PANEL, k2_dim = (k_dim + 1) / 2;
#pragma omp parallel for schedule(dynamic)
    for (int64_t p = 0; p < panels; p++)
        panel_bf16(x, ldx, w + p * PANEL * 2 * k2_dim, m_dim, n, k_dim, p * PANEL, y);
    return 0;
}

/* xb: the int16 rows, M * K2 words, then their scales, M * groups. */
int panel_gemm_i8(const float *x, int64_t ldx, const int8_t *w, int64_t m_dim, int64_t n, int64_t k_dim, float *y,
                  uint32_t *xb)
{
    const int64_t panels = (n + PANEL - 1) / PANEL, k2_dim = (k_dim + 1) / 2, groups = (k2_dim + GROUP2 - 1) / GROUP2;
    const float *scale = (const float *)(w + panels * PANEL * 2 * k2_dim);
    float *xs = (float *)(xb + m_dim * k2_dim);
#pragma omp parallel
    {
        rows_to_i16(x, ldx, m_dim, k_dim, xb, xs);
#pragma omp for schedule(dynamic)
        for (int64_t p = 0; p < panels; p++)
            panel_i16(xb, xs, w + p * PANEL * 2 * k2_dim, scale + p * groups * PANEL, m_dim, n, k2_dim, p * PANEL,
                      y);
    }
    return 0;
}
