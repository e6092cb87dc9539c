/* y[M, N] = x[M, K] @ W for a weight packed in column panels, fp32, AVX-512.
 *
 * Decode steps multiply a handful of rows by every weight, so their time is the
 * weight stream; oneDNN's kernels read it at half the memory roofline for 2..16 rows
 * on the default model's shapes. The weight is packed once at load time into panels
 * of 48 columns, panel after panel, each [K, 48] contiguous (the last one zero-padded),
 * so a panel is one sequential, prefetched stream. Each thread takes whole panels and
 * walks k once per 8-row tile: 24 accumulators stay in registers, every weight vector
 * loaded serves all the rows, and x[m, k] is broadcast from memory. With more than
 * 8 rows k goes in blocks of 64 (12 KB of panel): every tile takes the block in turn,
 * the first from memory, the others from L1 while prefetching the next block, so the
 * weight stream overlaps the extra tiles' arithmetic instead of following it (16 rows,
 * all of the default model's matmuls: 18.1 -> 15.5 ms; 8 rows and fewer are one block).
 * Each output is one fused multiply-add chain over k in order, whatever the blocking.
 * Measured against oneDNN on the default model's shapes: 1.3-2x faster for 1..16 rows,
 * 5-10% for 128..2048.
 *
 * x has row stride ldx (floats); w is the packed weight; y is [M, N] contiguous.
 * A CPU with AVX2 and no AVX-512 runs the same packed panels through panel_gemm_avx2.h.
 */
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* The packing's width, the same in every build (kernels/linear.py's PANEL; screen_head.c reads
 * packed heads with it even where no GEMM below is built). */
enum { PANEL = 48 };

/* The row count from which a bf16 GEMM runs widened to fp32 FMAs (panel_wide) on a CPU with AVX-512
 * BF16, off the tiles; 0: never. Some cores run vdpbf16ps at a quarter of their FMA rate (a 2-vCPU
 * Xeon, family 6 model 207: 1.3 G a second a thread against 5.3; a Zen 4 runs both at one a cycle),
 * so panel_bf16_wide_choice times both once and kernels.cbuild sets its answer in every library
 * that holds this file. */
int panel_bf16_wide_min_rows = 0;

/* How the panels of the bf16 and int8 forms are shared out (vdpbf16ps and int16 rows, the AVX2
 * header's, AVX-512 without its BF16). One or two rows: a thread's share in one contiguous run,
 * which the hardware prefetcher follows across panels (one panel at a time, the two threads'
 * panels interleaved, a 1-row step's int8 matmuls took 5.5 ms against 4.8 on a 2-vCPU Zen 3,
 * medians of six alternated runs; its int8 matmuls and lm_head 9.3-9.5 against 8.3 on a 2-vCPU
 * Cascade Lake, bf16 15.3-15.7 against 14.2; on a 2-vCPU Zen 4, int8 7.07 against 6.10 ms and bf16
 * 11.55 against 10.81; docs/cpu.md). More rows: one panel at a time, their tiles are compute. */
static inline int runs_contiguous(int64_t m_dim)
{
    return m_dim <= 2;
}

/* A thread's run of panels [lo, hi) in one word (lo | hi << 32): its owner takes panels off the
 * front, and a thread that has finished its own run takes them off the back. The two threads of
 * a 2-vCPU Zen 4 finished their halves of a 1-row matmul 12-20 % of its span apart (which thread
 * at random): the memory does not share its bandwidth evenly, and a thread the OS preempts stops.
 * The rest of a slower thread's run is done by the other instead of waited for (docs/cpu.md). */
struct panel_run {
    _Alignas(64) _Atomic uint64_t span;
};

/* runs [threads]: contiguous, ceil(panels / threads) panels a run, or every panel in run 0 (taken
 * one at a time by whichever thread asks). Before the parallel region. */
static inline void init_runs(struct panel_run *runs, int64_t threads, int64_t panels, int contiguous)
{
    const int64_t each = contiguous ? (panels + threads - 1) / threads : panels;
    for (int64_t t = 0; t < threads; t++) {
        const int64_t lo = t * each < panels ? t * each : panels, hi = lo + each < panels ? lo + each : panels;
        atomic_init(&runs[t].span, (uint64_t)lo | (uint64_t)hi << 32);
    }
}

/* One panel off the front (or the back) of a run; -1 when it is empty. Relaxed: the panels'
 * inputs and outputs are ordered by the region's barriers, the word only hands out indices. */
static inline int64_t take_panel(struct panel_run *run, int front)
{
    uint64_t v = atomic_load_explicit(&run->span, memory_order_relaxed);
    for (;;) {
        const uint64_t lo = v & 0xFFFFFFFFu, hi = v >> 32;
        if (lo >= hi)
            return -1;
        const uint64_t next = front ? (lo + 1) | hi << 32 : lo | (hi - 1) << 32;
        if (atomic_compare_exchange_weak_explicit(&run->span, &v, next, memory_order_relaxed, memory_order_relaxed))
            return (int64_t)(front ? lo : hi - 1);
    }
}

/* The calling thread's next panel: its own run's front, else another run's back; -1: none left. A
 * team smaller than `threads` (a nested region runs alone) takes the missing threads' runs too. */
static inline int64_t next_panel(struct panel_run *runs, int64_t threads)
{
    const int64_t me = omp_get_thread_num();
    int64_t p = me < threads ? take_panel(&runs[me], 1) : -1;
    for (int64_t d = 1; p < 0 && d <= threads; d++)
        p = take_panel(&runs[(me + d) % threads], 0);
    return p;
}

/* The shared runs of a call's panels, declared where the parallel region starts. */
#define PANEL_RUNS(runs, threads, panels, contiguous)                                                         \
    const int64_t threads = omp_get_max_threads();                                                            \
    struct panel_run runs[threads];                                                                           \
    init_runs(runs, threads, panels, contiguous)

#if !(defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__))
/* Built without AMX tiles (or without the AVX-512 BF16 GEMM they serve): never tiles. */
int panel_amx_min_rows = 0, panel_amx_min_rows_i8 = 0;
int panel_gemm_amx_ready(void) { return 0; }
#endif

#ifdef __AVX512F__
#include <immintrin.h>

/* KBLOCK_PAIRS: the k2 steps of a block in the vdpbf16ps and int16-row forms (24 KB of a bf16 panel,
 * 12 KB of an int8 one); 128 against 64 on a 2-vCPU Zen 4, a step's matmuls at 16 / 32 / 128 rows:
 * bf16 3 / 7 / 9 % faster, int8 7 / 8 / 14 % (docs/cpu.md, session 42). */
enum { ROWS = 8, KBLOCK = 64, KBLOCK_PAIRS = 128, GROUP2 = 16 /* k2 steps of an int8 scale group (32 k) */ };

/* fp32 panels: one at a time (see panel_gemm_f32). */
static inline int panel_runs_contiguous(int64_t m_dim)
{
    (void)m_dim;
    return 0;
}

/* The first `count` of 16 lanes (none below 1, all from 16). */
static inline __mmask16 lanes(int64_t count)
{
    return count >= 16 ? 0xFFFF : count <= 0 ? 0 : (__mmask16)((1u << count) - 1);
}

/* The masks of a panel's three parts of 16 columns for its first `cols`, and a tile's
 * accumulators: zero when k0 == 0, else what y holds (the k blocks before). */
static inline __attribute__((always_inline)) void start_tile(__m512 (*acc)[3], __mmask16 mask[3], int rows,
                                                            int64_t cols, int64_t k0, const float *y, int64_t n)
{
    for (int j = 0; j < 3; j++)
        mask[j] = lanes(cols - 16 * j);
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 3; j++)
            acc[m][j] = k0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[j], y + m * n + 16 * j);
}

static inline __attribute__((always_inline)) void store_tile(__m512 (*acc)[3], const __mmask16 mask[3], int rows,
                                                            float *y, int64_t n)
{
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 3; j++)
            _mm512_mask_storeu_ps(y + m * n + 16 * j, mask[j], acc[m][j]);
}

/* Accumulates k in [k0, k1) of one 8-row tile into y (which it starts from zero when
 * k0 == 0). rows: 1..ROWS, a constant after inlining, so acc[][] lives in registers. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const float *w, int64_t n,
                                                      int64_t k0, int64_t k1, int64_t cols, int rows,
                                                      int64_t ahead, float *y)
{
    __m512 acc[ROWS][3];
    __mmask16 mask[3];
    start_tile(acc, mask, rows, cols, k0, y, n);
    const float *wk = w + k0 * PANEL;
    for (int64_t k = k0; k < k1; k++, wk += PANEL) {
        _mm_prefetch((const char *)(wk + ahead), _MM_HINT_T0);
        _mm_prefetch((const char *)(wk + ahead + 16), _MM_HINT_T0);
        _mm_prefetch((const char *)(wk + ahead + 32), _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(wk);
        const __m512 w1 = _mm512_loadu_ps(wk + 16);
        const __m512 w2 = _mm512_loadu_ps(wk + 32);
        for (int m = 0; m < rows; m++) {
            const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
            acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
            acc[m][2] = _mm512_fmadd_ps(xv, w2, acc[m][2]);
        }
    }
    store_tile(acc, mask, rows, y, n);
}

/* One panel (w points at it), all rows: k in blocks of KBLOCK, and within a block every
 * row tile, so a block is read from memory once and re-read from L1 by the other tiles
 * while the next block streams in. With one tile the block loop is a single pass. */
static void panel_f32(const float *x, int64_t ldx, const float *w, int64_t m_dim, int64_t n, int64_t k_dim,
                      int64_t col, float *y)
{
    const int64_t cols = n - col < PANEL ? n - col : PANEL;
    const int64_t kblock = m_dim > ROWS ? KBLOCK : k_dim;
    for (int64_t k0 = 0; k0 < k_dim; k0 += kblock) {
        const int64_t k1 = k_dim - k0 < kblock ? k_dim : k0 + kblock;
        for (int64_t row = 0; row < m_dim; row += ROWS) {
            /* The first tile streams the block in; the others, working from L1, fetch the next one. */
            const int64_t ahead = row == 0 ? 8 * PANEL : kblock * PANEL;
            const float *xr = x + row * ldx;
            float *yr = y + row * n + col;
            switch (m_dim - row < ROWS ? m_dim - row : ROWS) {
            case 1: tile(xr, ldx, w, n, k0, k1, cols, 1, ahead, yr); break;
            case 2: tile(xr, ldx, w, n, k0, k1, cols, 2, ahead, yr); break;
            case 3: tile(xr, ldx, w, n, k0, k1, cols, 3, ahead, yr); break;
            case 4: tile(xr, ldx, w, n, k0, k1, cols, 4, ahead, yr); break;
            case 5: tile(xr, ldx, w, n, k0, k1, cols, 5, ahead, yr); break;
            case 6: tile(xr, ldx, w, n, k0, k1, cols, 6, ahead, yr); break;
            case 7: tile(xr, ldx, w, n, k0, k1, cols, 7, ahead, yr); break;
            default: tile(xr, ldx, w, n, k0, k1, cols, 8, ahead, yr); break;
            }
        }
    }
}

/* Sixteen fp16 scales as fp32. */
static inline __m512 half16(const uint16_t *h)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
/* The same for bf16 or int8 weights: panels of 48 columns, each [K2][48][2] (K2 = ceil(K / 2), k
 * in pairs, the odd last k zero-padded), so a step of k2 is 16 columns x 2 k per vdpbf16ps
 * operand, three of them: 192 bytes in bf16 (as a step of k in fp32), 96 in int8. The rows are
 * rounded to bf16 (nearest even) once per call. int8 weights carry a scale per column and group
 * of 32 k (GROUP2 k2 steps), as llama.cpp's Q8_0 does: in registers each q becomes bf16(q * s),
 * the weight the scale stands for, rounded as a bf16 weight is. Every product of two bf16 is
 * exact in fp32 and the sums are fp32, as oneDNN's bf16 inner product does. */
static inline __attribute__((always_inline)) __m512bh load_pairs(const char *w, int i8, __m512 s_lo, __m512 s_hi)
{
    if (!i8)
        return (__m512bh)_mm512_loadu_si512(w);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 16))));
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s_hi), _mm512_mul_ps(lo, s_lo));
}

/* The fp16 scales of group g's 48 columns, as load_pairs takes them: a part's columns 0-7 (lo) and
 * 8-15 (hi), each twice (a column's two k of a pair). */
static inline __attribute__((always_inline)) void group_scales(const uint16_t *scale, int64_t g, __m512 s_lo[3],
                                                              __m512 s_hi[3])
{
    const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int j = 0; j < 3; j++) {
        const __m512 s = half16(scale + g * PANEL + 16 * j);
        s_lo[j] = _mm512_permutexvar_ps(lo, s);
        s_hi[j] = _mm512_permutexvar_ps(hi, s);
    }
}

/* step: bytes of one k2 step of a panel (192 bf16, 96 int8); w points at the panel, scale at its
 * int8 scales ([groups][48]). */
static inline __attribute__((always_inline)) void tile_pairs(const uint32_t *xb, int64_t k2_dim, const char *w,
                                                            int i8, const uint16_t *scale, int64_t n, int64_t k0, int64_t k1,
                                                            int64_t cols, int rows, int64_t ahead, float *y)
{
    const int64_t step = i8 ? 2 * PANEL : 4 * PANEL, part = step / 3;
    __m512 acc[ROWS][3];
    __mmask16 mask[3];
    start_tile(acc, mask, rows, cols, k0, y, n);
    __m512 s_lo[3], s_hi[3];
    for (int j = 0; j < 3; j++)
        s_lo[j] = s_hi[j] = _mm512_setzero_ps(); /* bf16 panels: never read */
    const char *wk = w + k0 * step;
    for (int64_t k = k0; k < k1; k++, wk += step) {
        for (int64_t b = 0; b < step; b += 64)
            _mm_prefetch(wk + ahead * step + b, _MM_HINT_T0);
        if (i8 && (k == k0 || k % GROUP2 == 0))
            group_scales(scale, k / GROUP2, s_lo, s_hi);
        const __m512bh w0 = load_pairs(wk, i8, s_lo[0], s_hi[0]), w1 = load_pairs(wk + part, i8, s_lo[1], s_hi[1]),
                       w2 = load_pairs(wk + 2 * part, i8, s_lo[2], s_hi[2]);
        for (int m = 0; m < rows; m++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xb[m * k2_dim + k]);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, w0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, w1);
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xv, w2);
        }
    }
    store_tile(acc, mask, rows, y, n);
}

#define TILE_CASES(I8)                                                                                         \
    switch (m_dim - row < ROWS ? m_dim - row : ROWS) {                                                         \
    case 1: tile_pairs(xr, k2_dim, w, I8, scale, n, k0, k1, cols, 1, ahead, yr); break;                        \
    case 2: tile_pairs(xr, k2_dim, w, I8, scale, n, k0, k1, cols, 2, ahead, yr); break;                        \
    case 3: tile_pairs(xr, k2_dim, w, I8, scale, n, k0, k1, cols, 3, ahead, yr); break;                        \
    case 4: tile_pairs(xr, k2_dim, w, I8, scale, n, k0, k1, cols, 4, ahead, yr); break;                        \
    case 5: tile_pairs(xr, k2_dim, w, I8, scale, n, k0, k1, cols, 5, ahead, yr); break;                        \
    case 6: tile_pairs(xr, k2_dim, w, I8, scale, n, k0, k1, cols, 6, ahead, yr); break;                        \
    case 7: tile_pairs(xr, k2_dim, w, I8, scale, n, k0, k1, cols, 7, ahead, yr); break;                        \
    default: tile_pairs(xr, k2_dim, w, I8, scale, n, k0, k1, cols, 8, ahead, yr); break;                       \
    }

/* One panel, all rows, as panel() does; scale: the panel's int8 scales, or NULL (bf16). */
static void panel_pairs(const uint32_t *xb, const char *w, const uint16_t *scale, int64_t m_dim, int64_t n,
                        int64_t k2_dim, int64_t col, float *y)
{
    const int64_t cols = n - col < PANEL ? n - col : PANEL;
    const int64_t kblock = m_dim > ROWS ? KBLOCK_PAIRS : k2_dim;
    for (int64_t k0 = 0; k0 < k2_dim; k0 += kblock) {
        const int64_t k1 = k2_dim - k0 < kblock ? k2_dim : k0 + kblock;
        for (int64_t row = 0; row < m_dim; row += ROWS) {
            /* k2 steps: 6 KB, as panel_i16 (8, 1.5 KB: 4-8 % slower at 1-2 rows on a Zen 4) */
            const int64_t ahead = row == 0 ? 32 : kblock;
            const uint32_t *xr = xb + row * k2_dim;
            float *yr = y + row * n + col;
            if (scale) {
                TILE_CASES(1)
            } else {
                TILE_CASES(0)
            }
        }
    }
}

/* One row x [K] in bf16 pairs, out [K2] uint32 (nearest even), zero past k_dim. */
static inline void row_to_bf16(const float *x, int64_t k_dim, uint32_t *out)
{
    const int64_t k2_dim = (k_dim + 1) / 2;
    uint16_t *row = (uint16_t *)out;
    for (int64_t k = 0; k < 2 * k2_dim; k += 16) { /* the tail's loads are masked, the pad zero */
        const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(lanes(k_dim - k), x + k));
        _mm256_mask_storeu_epi16(row + k, lanes(2 * k2_dim - k), v);
    }
}

/* The rows in bf16 pairs: xb [M, K2] uint32, zero past k_dim; rows M..pad_rows - 1 all zero. */
static void rows_to_bf16(const float *x, int64_t ldx, int64_t m_dim, int64_t pad_rows, int64_t k_dim, uint32_t *xb)
{
    const int64_t k2_dim = (k_dim + 1) / 2;
#pragma omp for schedule(static) nowait
    for (int64_t m = m_dim; m < pad_rows; m++)
        memset(xb + m * k2_dim, 0, k2_dim * sizeof(uint32_t));
#pragma omp for schedule(static)
    for (int64_t m = 0; m < m_dim; m++)
        row_to_bf16(x + m * ldx, k_dim, xb + m * k2_dim);
}

#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* int8 panels off the tiles take the rows as int16 instead, with a scale per row and group of 32 k
 * (the largest |x| / 32767, round to nearest): vpdpwssd multiplies 16 columns x 2 k of int16 rows
 * and sign-extended weights into int32 in one instruction, where making bf16(q * s) of them took
 * nine (docs/cpu.md: the 1-row step was bound by that arithmetic, not by the int8 it reads). A
 * group's int32 sums (at most 32 x 127 x 32768, exact) become fp32 once, times both scales. An
 * int16 row with a scale per 32 k errs by at most 1/65534 of its group's largest |x|, below bf16's
 * rounding of every element but the smallest; the weights are q * s exactly. */
enum { ROWS16 = 4 }; /* 12 int32 and 12 fp32 accumulators */

/* Group i of x [M, K] (row i / groups, its 32 k from i % groups * 32) as int16 pairs in xq [M, K2]
 * (zero past k_dim) and its scale xs[i]; a group holding a NaN or an infinity gets a NaN scale, so
 * its outputs are NaN as fp32's would be. */
static inline void group_to_i16(const float *x, int64_t ldx, int64_t k_dim, int64_t i, uint32_t *xq, float *xs)
{
    const int64_t k2_dim = (k_dim + 1) / 2, groups = (k2_dim + GROUP2 - 1) / GROUP2;
    const int64_t m = i / groups, k = i % groups * 2 * GROUP2;
    __m512 v[2];
    for (int h = 0; h < 2; h++)
        v[h] = _mm512_maskz_loadu_ps(lanes(k_dim - k - 16 * h), x + m * ldx + k + 16 * h);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const int nan = _mm512_cmp_ps_mask(v[0], v[0], _CMP_UNORD_Q) || _mm512_cmp_ps_mask(v[1], v[1], _CMP_UNORD_Q);
    const int finite = !nan && top <= 3.4028235e38f;
    const float inv = finite && top > 0 ? 32767.0f / top : 0.0f;
    xs[i] = finite ? top / 32767.0f : __builtin_nanf("");
    uint16_t *row = (uint16_t *)(xq + m * k2_dim);
    for (int h = 0; h < 2; h++) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)));
        _mm256_mask_storeu_epi16(row + k + 16 * h, lanes(2 * k2_dim - k - 16 * h), _mm512_cvtsepi32_epi16(q));
    }
}

/* Every group of x [M, K], shared by the team; xs [M, groups]. */
static void rows_to_i16(const float *x, int64_t ldx, int64_t m_dim, int64_t k_dim, uint32_t *xq, float *xs)
{
    const int64_t groups = ((k_dim + 1) / 2 + GROUP2 - 1) / GROUP2;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m_dim * groups; i++)
        group_to_i16(x, ldx, k_dim, i, xq, xs);
}

/* k2 steps [k0, k1) (whole groups but for the last) of one tile of up to ROWS16 rows, as tile_pairs. */
static inline __attribute__((always_inline)) void tile_i16(const uint32_t *xq, const float *xs, int64_t k2_dim,
                                                          const char *w, const uint16_t *scale, int64_t n, int64_t k0,
                                                          int64_t k1, int64_t cols, int rows, int64_t ahead, float *y)
{
    const int64_t step = 2 * PANEL, groups = (k2_dim + GROUP2 - 1) / GROUP2;
    __m512 acc[ROWS16][3];
    __mmask16 mask[3];
    start_tile(acc, mask, rows, cols, k0, y, n);
    const char *wk = w + k0 * step;
    for (int64_t g0 = k0; g0 < k1; g0 += GROUP2) {
        const int64_t g1 = k1 - g0 < GROUP2 ? k1 : g0 + GROUP2, g = g0 / GROUP2;
        __m512i sum[ROWS16][3];
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < 3; j++)
                sum[m][j] = _mm512_setzero_si512();
        for (int64_t k = g0; k < g1; k++, wk += step) {
            _mm_prefetch(wk + ahead * step, _MM_HINT_T0);
            _mm_prefetch(wk + ahead * step + 64, _MM_HINT_T0);
            __m512i wj[3];
            for (int j = 0; j < 3; j++)
                wj[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wk + 32 * j)));
            for (int m = 0; m < rows; m++) {
                const __m512i xv = _mm512_set1_epi32((int)xq[m * k2_dim + k]);
                for (int j = 0; j < 3; j++)
                    sum[m][j] = _mm512_dpwssd_epi32(sum[m][j], xv, wj[j]);
            }
        }
        for (int j = 0; j < 3; j++) {
            const __m512 s = half16(scale + g * PANEL + 16 * j);
            for (int m = 0; m < rows; m++) {
                const __m512 both = _mm512_mul_ps(s, _mm512_set1_ps(xs[m * groups + g]));
                acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m][j]), both, acc[m][j]);
            }
        }
    }
    store_tile(acc, mask, rows, y, n);
}

/* One int8 panel, all rows, on int16 rows: as panel_pairs. */
static void panel_i16(const uint32_t *xq, const float *xs, const char *w, const uint16_t *scale, int64_t m_dim,
                      int64_t n, int64_t k2_dim, int64_t col, float *y)
{
    const int64_t cols = n - col < PANEL ? n - col : PANEL, groups = (k2_dim + GROUP2 - 1) / GROUP2;
    const int64_t kblock = m_dim > ROWS16 ? KBLOCK_PAIRS : k2_dim; /* whole groups */
    for (int64_t k0 = 0; k0 < k2_dim; k0 += kblock) {
        const int64_t k1 = k2_dim - k0 < kblock ? k2_dim : k0 + kblock;
        for (int64_t row = 0; row < m_dim; row += ROWS16) {
            const int64_t ahead = row == 0 ? 64 : kblock; /* k2 steps: 6 KB (8 left 1 row waiting on memory) */
            const uint32_t *xr = xq + row * k2_dim;
            const float *sr = xs + row * groups;
            float *yr = y + row * n + col;
            switch (m_dim - row < ROWS16 ? m_dim - row : ROWS16) {
            case 1: tile_i16(xr, sr, k2_dim, w, scale, n, k0, k1, cols, 1, ahead, yr); break;
            case 2: tile_i16(xr, sr, k2_dim, w, scale, n, k0, k1, cols, 2, ahead, yr); break;
            case 3: tile_i16(xr, sr, k2_dim, w, scale, n, k0, k1, cols, 3, ahead, yr); break;
            default: tile_i16(xr, sr, k2_dim, w, scale, n, k0, k1, cols, 4, ahead, yr); break;
            }
        }
    }
}

/* bf16 panels widened to fp32 in registers under fp32 rows, as panel_gemm_avx2.h does, 16 lanes at
 * a time: a k pair of a column is one 32-bit word, the even k's bf16 its low half (the word shifted
 * left 16), the odd k's its high half (the word masked), both exact fp32. Each output is the same
 * fused multiply-add chain over k in order as the AVX2 forms', so both give the same bits
 * (kernels.greedy_head's screen relies on that). AVX-512 without its BF16 runs every bf16 GEMM so;
 * with it, a GEMM of panel_bf16_wide_min_rows rows or more, where vdpbf16ps is slow (below). */
enum { ROWS_WIDE = 6 }; /* 18 accumulators, 6 weight vectors, 2 broadcasts of the 32 registers */

static inline __attribute__((always_inline)) void tile_wide(const float *x, int64_t ldx, const uint16_t *w,
                                                           int64_t n, int64_t k_dim, int64_t k0, int64_t k1,
                                                           int64_t cols, int rows, int64_t ahead, float *y)
{
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 acc[ROWS_WIDE][3];
    __mmask16 mask[3];
    start_tile(acc, mask, rows, cols, k0, y, n);
    const uint16_t *wk = w + k0 * 2 * PANEL;
    for (int64_t k = k0; k < k1; k++, wk += 2 * PANEL) {
        for (int b = 0; b < 3; b++)
            _mm_prefetch((const char *)(wk + ahead * 2 * PANEL + 32 * b), _MM_HINT_T0);
        const int pair = 2 * k + 1 < k_dim;
        __m512 even[3], odd[3];
        for (int j = 0; j < 3; j++) {
            const __m512i pairs = _mm512_loadu_si512(wk + 32 * j);
            even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            odd[j] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
        }
        for (int m = 0; m < rows; m++) {
            const float *xm = x + m * ldx + 2 * k;
            const __m512 xe = _mm512_set1_ps(xm[0]), xo = _mm512_set1_ps(pair ? xm[1] : 0.f);
            for (int j = 0; j < 3; j++)
                acc[m][j] = _mm512_fmadd_ps(xo, odd[j], _mm512_fmadd_ps(xe, even[j], acc[m][j]));
        }
    }
    store_tile(acc, mask, rows, y, n);
}

/* One bf16 panel, all rows, as panel_f32. */
static void panel_wide(const float *x, int64_t ldx, const uint16_t *w, int64_t m_dim, int64_t n, int64_t k_dim,
                       int64_t col, float *y)
{
    const int64_t cols = n - col < PANEL ? n - col : PANEL, k2_dim = (k_dim + 1) / 2;
    const int64_t kblock = m_dim > ROWS_WIDE ? KBLOCK : k2_dim;
    for (int64_t k0 = 0; k0 < k2_dim; k0 += kblock) {
        const int64_t k1 = k2_dim - k0 < kblock ? k2_dim : k0 + kblock;
        for (int64_t row = 0; row < m_dim; row += ROWS_WIDE) {
            const int64_t ahead = row == 0 ? 8 : kblock; /* in k2 steps */
            const float *xr = x + row * ldx;
            float *yr = y + row * n + col;
            switch (m_dim - row < ROWS_WIDE ? m_dim - row : ROWS_WIDE) {
            case 1: tile_wide(xr, ldx, w, n, k_dim, k0, k1, cols, 1, ahead, yr); break;
            case 2: tile_wide(xr, ldx, w, n, k_dim, k0, k1, cols, 2, ahead, yr); break;
            case 3: tile_wide(xr, ldx, w, n, k_dim, k0, k1, cols, 3, ahead, yr); break;
            case 4: tile_wide(xr, ldx, w, n, k_dim, k0, k1, cols, 4, ahead, yr); break;
            case 5: tile_wide(xr, ldx, w, n, k_dim, k0, k1, cols, 5, ahead, yr); break;
            default: tile_wide(xr, ldx, w, n, k_dim, k0, k1, cols, 6, ahead, yr); break;
            }
        }
    }
}

/* Every panel of a bf16 weight in the widened form, the threads' runs as the other forms'. */
static int gemm_wide(const float *x, int64_t ldx, const uint16_t *w, int64_t m_dim, int64_t n, int64_t k_dim, float *y)
{
    const int64_t panels = (n + PANEL - 1) / PANEL, k2_dim = (k_dim + 1) / 2;
    PANEL_RUNS(runs, threads, panels, runs_contiguous(m_dim));
#pragma omp parallel
    for (int64_t p; (p = next_panel(runs, threads)) >= 0;)
        panel_wide(x, ldx, w + p * PANEL * 2 * k2_dim, m_dim, n, k_dim, p * PANEL, y);
    return 0;
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx.h"

enum { AMX_ROWS = 16, AMX_K2 = 16 };

/* The row counts from which bf16 and int8 panels run on the tiles (docs/cpu.md); client.bench_linear
 * sets them. int8 panels are made bf16 for the tiles, which the int16 rows' path need not do. */
int panel_amx_min_rows = 8, panel_amx_min_rows_i8 = 16;

int panel_gemm_amx_ready(void) { return amx_permitted(); }

/* Tiles 0-2: 16 rows x 16 fp32 outputs each (the panel's 48 columns); 3: 16 rows x 16 k pairs;
 * 4-6: 16 k pairs x 16 columns x 2 of the panel. */
static void amx_configure(void)
{
    struct tile_config cfg = {.palette = 1};
    for (int t = 0; t < 7; t++)
        cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

static void amx_release(void) { _tile_release(); }

/* One full panel (48 columns) on the tiles, all rows, 16 at a time: xb has M rounded up to 16
 * rows (zero rows); k2 past the last whole tile goes through tile_pairs, which adds to y. */
static void panel_amx(const uint32_t *xb, const char *w, int64_t m_total, int64_t n, int64_t k2_dim, int64_t col,
                      float *y)
{
    const int64_t k2_tiles = k2_dim / AMX_K2 * AMX_K2, cols = PANEL, k0 = k2_tiles, k1 = k2_dim, ahead = 8;
    float part[AMX_ROWS][PANEL];
    for (int64_t rows = 0; rows < m_total; rows += AMX_ROWS) {
        const uint32_t *x16 = xb + rows * k2_dim;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        for (int64_t k = 0; k < k2_tiles; k += AMX_K2) {
            const char *wk = w + k * 4 * PANEL;
            _tile_loadd(3, x16 + k, k2_dim * 4);
            _tile_loadd(4, wk, 4 * PANEL);
            _tile_loadd(5, wk + 64, 4 * PANEL);
            _tile_loadd(6, wk + 128, 4 * PANEL);
            _tile_dpbf16ps(0, 3, 4);
            _tile_dpbf16ps(1, 3, 5);
            _tile_dpbf16ps(2, 3, 6);
        }
        const int64_t valid = m_total - rows < AMX_ROWS ? m_total - rows : AMX_ROWS;
        float *out = y + rows * n + col;
        if (valid == AMX_ROWS) {
            _tile_stored(0, out, n * 4);
            _tile_stored(1, out + 16, n * 4);
            _tile_stored(2, out + 32, n * 4);
        } else { /* the zero rows past M stay in part */
            _tile_stored(0, &part[0][0], sizeof part[0]);
            _tile_stored(1, &part[0][16], sizeof part[0]);
            _tile_stored(2, &part[0][32], sizeof part[0]);
            for (int64_t m = 0; m < valid; m++)
                memcpy(out + m * n, part[m], sizeof part[m]);
        }
        for (int64_t row = 0; k0 < k1 && row < valid; row += ROWS) { /* TILE_CASES' names */
            const uint32_t *xr = x16 + row * k2_dim;
            float *yr = out + row * n;
            const int64_t m_dim = valid;
            const uint16_t *scale = NULL;
            TILE_CASES(0)
        }
    }
}
#else
enum { AMX_ROWS = 1, AMX_K2 = 1 };
static int amx_permitted(void) { return 0; }
static void amx_configure(void) {}
static void amx_release(void) {}
static void panel_amx(const uint32_t *xb, const char *w, int64_t m_dim, int64_t n, int64_t k2_dim, int64_t col,
                      float *y)
{
    (void)xb, (void)w, (void)m_dim, (void)n, (void)k2_dim, (void)col, (void)y;
}
#endif

/* An int8 panel as bf16(q * s) in the bf16 panels' layout, for the tiles: the same weights as
 * load_pairs makes of it in registers. */
static void dequantize_panel(const char *w, const uint16_t *scale, int64_t k2_dim, char *out)
{
    __m512 s_lo[3], s_hi[3];
    for (int64_t k = 0; k < k2_dim; k++) {
        if (k % GROUP2 == 0)
            group_scales(scale, k / GROUP2, s_lo, s_hi);
        for (int j = 0; j < 3; j++)
            _mm512_storeu_si512(out + k * 4 * PANEL + 64 * j,
                                (__m512i)load_pairs(w + k * 2 * PANEL + 32 * j, 1, s_lo[j], s_hi[j]));
    }
}

static int gemm_tiles(int64_t kind, int64_t m_dim, int64_t k_dim);
static int gemm_widens(int64_t kind, int64_t m_dim, int64_t k_dim);

/* xb: room for M rounded up to AMX_ROWS rows of K2 (the tiles read whole groups of 16), and M more
 * rows of ceil(K2 / GROUP2) (int16 rows' scales). */
static int gemm_pairs(const float *x, int64_t ldx, const char *w, const uint16_t *scale, int64_t m_dim, int64_t n,
                      int64_t k_dim, float *y, uint32_t *xb)
{
    const int64_t k2_dim = (k_dim + 1) / 2, panels = (n + PANEL - 1) / PANEL, groups = (k2_dim + GROUP2 - 1) / GROUP2;
    const int64_t panel_bytes = PANEL * 2 * k2_dim * (scale ? 1 : 2);
    const int tiles = gemm_tiles(scale ? 2 : 1, m_dim, k_dim);
    const int64_t pad_rows = tiles ? (m_dim + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : m_dim;
    const int i16 = scale && !tiles;
    float *xs = (float *)(xb + m_dim * k2_dim);
    PANEL_RUNS(runs, threads, panels, runs_contiguous(m_dim));
#pragma omp parallel
    {
        /* int8 panels go to the tiles as bf16, one panel at a time (without room: vdpbf16ps). */
        char *as_bf16 = tiles && scale ? malloc(4 * PANEL * k2_dim) : NULL;
        if (i16)
            rows_to_i16(x, ldx, m_dim, k_dim, xb, xs);
        else
            rows_to_bf16(x, ldx, m_dim, pad_rows, k_dim, xb);
        if (tiles)
            amx_configure();
        for (int64_t p; (p = next_panel(runs, threads)) >= 0;) {
            const char *panel_w = w + p * panel_bytes;
            const uint16_t *panel_scale = scale ? scale + p * groups * PANEL : NULL;
            if (i16) {
                panel_i16(xb, xs, panel_w, panel_scale, m_dim, n, k2_dim, p * PANEL, y);
            } else if (tiles && n - p * PANEL >= PANEL && (!scale || as_bf16)) {
                if (scale)
                    dequantize_panel(panel_w, panel_scale, k2_dim, as_bf16);
                panel_amx(xb, scale ? as_bf16 : panel_w, m_dim, n, k2_dim, p * PANEL, y);
            } else {
                panel_pairs(xb, panel_w, panel_scale, m_dim, n, k2_dim, p * PANEL, y);
            }
        }
        if (tiles)
            amx_release();
        free(as_bf16);
    }
    return 0;
}

/* x fp32 [M, K] (row stride ldx), w bf16 panels as above, y fp32 [M, N]. xb: the caller's scratch
 * for the rows, ceil(M / 16) * 16 * ceil(K / 2) + M * ceil(K / 32) uint32 (the tiles read whole
 * groups of 16 rows in bf16 pairs; int16 rows take M of them and their scales). */
int panel_gemm_bf16(const float *x, int64_t ldx, const uint16_t *w, int64_t m_dim, int64_t n, int64_t k_dim,
                    float *y, uint32_t *xb)
{
    if (gemm_widens(1, m_dim, k_dim))
        return gemm_wide(x, ldx, w, m_dim, n, k_dim, y);
    return gemm_pairs(x, ldx, (const char *)w, NULL, m_dim, n, k_dim, y, xb);
}

/* The same for int8 panels, followed in the same buffer by their fp16 scales [panels][groups][48]
 * (a scale per column and 32 k): on the tiles y[m, j] = sum_k bf16(x[m, k]) bf16(q[j, k] *
 * scale[j, k / 32]), elsewhere the int16 rows' sum (rows_to_i16). */
int panel_gemm_i8(const float *x, int64_t ldx, const int8_t *w, int64_t m_dim, int64_t n, int64_t k_dim, float *y,
                  uint32_t *xb)
{
    const int64_t panels = (n + PANEL - 1) / PANEL, k2_dim = (k_dim + 1) / 2;
    const uint16_t *scale = (const uint16_t *)(w + panels * PANEL * 2 * k2_dim);
    return gemm_pairs(x, ldx, (const char *)w, scale, m_dim, n, k_dim, y, xb);
}

/* ns per multiply-add of the compute-bound tile, best of five batches: one panel of 128 k in L1,
 * the pairs' 8 rows or the widened form's 6. */
static double tile_ns_per_mac(int wide)
{
    enum { K = 128, K2 = K / 2, CALLS = 100 };
    uint16_t w[K2 * 2 * PANEL]; /* 12 KB on the stack: threads opening libraries at once share nothing */
    uint32_t xb[ROWS * K2];
    float x[ROWS * K], y[ROWS * PANEL];
    for (int64_t i = 0; i < K2 * 2 * PANEL; i++)
        w[i] = 0x3c00 + (uint16_t)(i % 7); /* bf16 near 1/128 */
    for (int64_t i = 0; i < ROWS * K; i++)
        x[i] = 0.25f + 0.001f * (float)(i % 5);
    row_to_bf16(x, ROWS * K, xb);
    const int rows = wide ? ROWS_WIDE : ROWS;
    double best = 1e30;
    for (int batch = 0; batch < 5; batch++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (int c = 0; c < CALLS; c++) {
            if (wide)
                panel_wide(x, K, w, rows, PANEL, K, 0, y);
            else
                panel_pairs(xb, (const char *)w, NULL, rows, PANEL, K2, 0, y);
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        const double ns = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
        best = ns < best ? ns : best;
    }
    return best / ((double)CALLS * rows * PANEL * K);
}

/* The row count from which bf16 GEMMs here should run widened (panel_bf16_wide_min_rows): past the
 * pairs' one 8-row tile, where the widened form's multiply-adds run faster than vdpbf16ps's on this
 * core (docs/cpu.md, session 47: from 9 rows it is then faster, at 8 it takes two passes); else 0.
 * About a millisecond, on the calling thread. */
int panel_bf16_wide_choice(void)
{
    return tile_ns_per_mac(1) < tile_ns_per_mac(0) ? ROWS + 1 : 0;
}
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* AVX-512 with VNNI but not its BF16 (Cascade Lake, Ice Lake): int8 panels on the int16 rows above
 * (vpdpwssd), and bf16 panels widened to fp32 (panel_wide). xb: unused (the rows stay fp32). */
int panel_gemm_bf16(const float *x, int64_t ldx, const uint16_t *w, int64_t m_dim, int64_t n, int64_t k_dim,
                    float *y, uint32_t *xb)
{
    (void)xb;
    return gemm_wide(x, ldx, w, m_dim, n, k_dim, y);
}

/* xb: the int16 rows, M * K2 words, then their scales, M * groups. */
int panel_gemm_i8(const float *x, int64_t ldx, const int8_t *w, int64_t m_dim, int64_t n, int64_t k_dim, float *y,
                  uint32_t *xb)
{
    const int64_t panels = (n + PANEL - 1) / PANEL, k2_dim = (k_dim + 1) / 2, groups = (k2_dim + GROUP2 - 1) / GROUP2;
    const char *wc = (const char *)w;
    const uint16_t *scale = (const uint16_t *)(wc + panels * PANEL * 2 * k2_dim);
    float *xs = (float *)(xb + m_dim * k2_dim);
    PANEL_RUNS(runs, threads, panels, runs_contiguous(m_dim));
#pragma omp parallel
    {
        rows_to_i16(x, ldx, m_dim, k_dim, xb, xs);
        for (int64_t p; (p = next_panel(runs, threads)) >= 0;)
            panel_i16(xb, xs, wc + p * PANEL * 2 * k2_dim, scale + p * groups * PANEL, m_dim, n, k2_dim, p * PANEL,
                      y);
    }
    return 0;
}
#else
/* AVX-512 without VNNI or its BF16 (Skylake-SP): bf16 and int8 weights take the AVX2 forms, the
 * same panels read 8 lanes at a time (the rows stay fp32 and int16, as on an AVX2 CPU). The
 * header's names that this file's AVX-512 code also defines are renamed around it. */
#define ROWS AVX2_ROWS
#define KBLOCK AVX2_KBLOCK
#define GROUP2 AVX2_GROUP2
#define panel_runs_contiguous avx2_panel_runs_contiguous
#define start_tile avx2_start_tile
#define store_tile avx2_store_tile
#define panel_f32 avx2_panel_f32
#include "panel_gemm_avx2.h"
#undef ROWS
#undef KBLOCK
#undef GROUP2
#undef panel_runs_contiguous
#undef start_tile
#undef store_tile
#undef panel_f32
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#include "panel_gemm_avx2.h"
#else
/* Built without AVX-512 or AVX2: returns -1 and the caller keeps oneDNN. */
int panel_gemm_f32(const float *x, int64_t ldx, const float *w, int64_t m_dim, int64_t n, int64_t k_dim,
                   float *y)
{
    (void)x, (void)ldx, (void)w, (void)m_dim, (void)n, (void)k_dim, (void)y;
    return -1;
}

int panel_gemm_bf16(const float *x, int64_t ldx, const uint16_t *w, int64_t m_dim, int64_t n, int64_t k_dim,
                    float *y, uint32_t *xb)
{
    (void)x, (void)ldx, (void)w, (void)m_dim, (void)n, (void)k_dim, (void)y, (void)xb;
    return -1;
}
int panel_gemm_i8(const float *x, int64_t ldx, const int8_t *w, int64_t m_dim, int64_t n, int64_t k_dim, float *y,
                  uint32_t *xb)
{
    (void)x, (void)ldx, (void)w, (void)m_dim, (void)n, (void)k_dim, (void)y, (void)xb;
    return -1;
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
int panel_gemm_f32(const float *x, int64_t ldx, const float *w, int64_t m_dim, int64_t n, int64_t k_dim,
                   float *y)
{
    const int64_t panels = (n + PANEL - 1) / PANEL;
    /* Panels handed out as the threads ask (one at a time, or contiguous runs taken over from the
     * back: see panel_runs_contiguous): when the OS preempts one thread (the server's threads share
     * these cores), the other takes over the rest of its share instead of waiting. */
    PANEL_RUNS(runs, threads, panels, panel_runs_contiguous(m_dim));
#pragma omp parallel
    for (int64_t p; (p = next_panel(runs, threads)) >= 0;)
        panel_f32(x, ldx, w + p * PANEL * k_dim, m_dim, n, k_dim, p * PANEL, y);
    return 0;
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* decoder.c's team form takes a GEMM apart: each thread makes its own copy of the rows in the form
 * its panels read (bf16 pairs, int16 rows and their scales, or none: the fp32 rows as they are),
 * then computes single panels, each into a [M, PANEL] buffer of its own, with the same functions
 * (and so the same bits) as panel_gemm_f32 / _bf16 / _i8. No OpenMP here: the team is the
 * caller's. xb: as panel_gemm_bf16's, for this thread alone. tiles: the GEMM runs on AMX tiles
 * (gemm_tiles), in a thread that has configured them. */

/* Whether a GEMM of these weights (0 fp32, 1 bf16, 2 int8) and shape runs on AMX tiles: gemm_pairs'
 * choice, and the team form's. */
static int gemm_tiles(int64_t kind, int64_t m_dim, int64_t k_dim)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    const int from = kind == 1 ? panel_amx_min_rows : kind == 2 ? panel_amx_min_rows_i8 : 0;
    return from > 0 && m_dim >= from && (k_dim + 1) / 2 >= AMX_K2 && amx_permitted();
#else
    (void)kind, (void)m_dim, (void)k_dim;
    return 0;
#endif
}

/* Whether a GEMM of these weights and shape takes fp32 rows and bf16 weights widened to fp32
 * (panel_wide or the AVX2 header's panel_bf16): every bf16 GEMM without AVX-512 BF16, with it those
 * of panel_bf16_wide_min_rows rows or more that do not run on the tiles. */
static int gemm_widens(int64_t kind, int64_t m_dim, int64_t k_dim)
{
    if (kind != 1)
        return 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    const int from = panel_bf16_wide_min_rows;
    return from > 0 && m_dim >= from && !gemm_tiles(kind, m_dim, k_dim);
#else
    (void)m_dim, (void)k_dim;
    return 1;
#endif
}

/* A team thread's tile configuration, set before its first tile panel and released after its last. */
static void gemm_tiles_configure(int on)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    if (on)
        amx_configure();
#else
    (void)on;
#endif
}

static void gemm_tiles_release(int on)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    if (on)
        amx_release();
#else
    (void)on;
#endif
}

static void gemm_rows_alone(int64_t kind, int tiles, const float *x, int64_t ldx, int64_t m_dim, int64_t k_dim,
                            uint32_t *xb)
{
    const int64_t k2_dim = (k_dim + 1) / 2;
    if (kind == 2 && !tiles) {
        for (int64_t i = 0; i < m_dim * ((k2_dim + GROUP2 - 1) / GROUP2); i++)
            group_to_i16(x, ldx, k_dim, i, xb, (float *)(xb + m_dim * k2_dim));
        return;
    }
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    if (kind != 0 && !gemm_widens(kind, m_dim, k_dim)) {
        for (int64_t m = 0; m < m_dim; m++)
            row_to_bf16(x + m * ldx, k_dim, xb + m * k2_dim);
        if (tiles) /* the tiles read whole groups of AMX_ROWS rows */
            memset(xb + m_dim * k2_dim, 0, ((m_dim + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS - m_dim) * k2_dim * 4);
    }
#endif
}

/* Panel p of y = x @ w (w as panel_gemm_*'s, n its columns) into out [M, PANEL]: the panel's padding
 * columns come out zero. as_bf16: room for an int8 panel made bf16 for the tiles. */
static void gemm_panel_alone(int64_t kind, int tiles, const float *x, int64_t ldx, const uint32_t *xb,
                             const void *w, int64_t m_dim, int64_t n, int64_t k_dim, int64_t p, char *as_bf16,
                             float *out)
{
    const int64_t k2_dim = (k_dim + 1) / 2, panels = (n + PANEL - 1) / PANEL, groups = (k2_dim + GROUP2 - 1) / GROUP2;
    const char *wc = (const char *)w;
    const uint16_t *scale = kind == 2 ? (const uint16_t *)(wc + panels * PANEL * 2 * k2_dim) + p * groups * PANEL
                                      : NULL;
    if (kind == 0) {
        panel_f32(x, ldx, (const float *)w + p * PANEL * k_dim, m_dim, PANEL, k_dim, 0, out);
        return;
    }
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    const char *panel_w = wc + p * PANEL * 2 * k2_dim * (kind == 2 ? 1 : 2);
    if (gemm_widens(kind, m_dim, k_dim)) {
        panel_wide(x, ldx, (const uint16_t *)w + p * PANEL * 2 * k2_dim, m_dim, PANEL, k_dim, 0, out);
    } else if (tiles && n - p * PANEL >= PANEL) { /* gemm_pairs' tile branch, one panel */
        if (scale)
            dequantize_panel(panel_w, scale, k2_dim, as_bf16);
        panel_amx(xb, scale ? as_bf16 : panel_w, m_dim, PANEL, k2_dim, 0, out);
    } else if (kind == 1 || tiles) {
        panel_pairs(xb, panel_w, scale, m_dim, PANEL, k2_dim, 0, out);
    } else {
        panel_i16(xb, (const float *)(xb + m_dim * k2_dim), panel_w, scale, m_dim, PANEL, k2_dim, 0, out);
    }
#else
    (void)tiles, (void)as_bf16;
    if (gemm_widens(kind, m_dim, k_dim)) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
        (void)xb;
        panel_wide(x, ldx, (const uint16_t *)w + p * PANEL * 2 * k2_dim, m_dim, PANEL, k_dim, 0, out);
#else
        (void)xb;
        panel_bf16(x, ldx, (const uint16_t *)w + p * PANEL * 2 * k2_dim, m_dim, PANEL, k_dim, 0, out);
#endif
    } else {
        panel_i16(xb, (const float *)(xb + m_dim * k2_dim), (const void *)(wc + p * PANEL * 2 * k2_dim), scale, m_dim,
                  PANEL, k2_dim, 0, out);
    }
#endif
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__))
int panel_bf16_wide_choice(void) { return 0; }
#endif
