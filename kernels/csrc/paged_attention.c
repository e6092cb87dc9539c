/* Paged attention for the CPU, fp32: every query row of a batch over its sequence's pages.
 *
 * A row is one new token: a decode is one row, a prefill chunk of n tokens is n rows of
 * one sequence, row j attending to the positions up to its own (lens[row]). Its new K/V
 * are already in the pages, so every row is the same problem and one call covers a
 * mixed batch. K/V are read straight from the pages (no gather copy). A task is one
 * row's KV heads, all of them or one (see the driver below); the G query heads of a
 * KV head share every K and V row it loads. Two passes over the context: scores, then
 * a softmax-weighted sum of V. With AVX-512 and a head dim of 32, 64 or 128, the
 * scores are taken 16 tokens at a time and summed across lanes together, and the
 * outputs stay in registers through the pass over V (16 x 192 tokens, 30 layers: 6.0
 * -> 5.7 ms; 1 x 300: 0.63 -> 0.45 ms); with AVX2 alone the same for 8 tokens a time and
 * 8 output vectors in registers; other dims take a general loop. The rows of
 * a prefill chunk re-read their sequence's K/V from cache; against torch's SDPA (flash
 * attention for CPU) on the default model's heads that is 0.30 -> 0.15 ms for a
 * 128-token prompt, 3.7 -> 2.2 ms for 512, and no slower for 512 new tokens over 2048
 * or 4096 (15 -> 15 ms, 35 -> 34 ms). The OpenMP team is torch's (libgomp.so.1 is
 * already loaded by torch when this library is opened), so it never competes with a
 * second pool.
 *
 * The cache holds fp32 or bf16 (`kv_cache_dtype bfloat16`: half the bytes each pass reads; a
 * row widens to fp32 as it loads, so the arithmetic is the fp32 kernel's on the rounded K/V).
 *
 * Shapes: q [R, Hq, D] with q_stride floats between rows (heads contiguous); k_cache,
 * v_cache [P, S, Hkv, D] contiguous, fp32 or bf16; pages [B, max_pages] int64 (a page table per
 * sequence); seqs [R] int64 (each row's sequence); lens [R] int64 (positions the row
 * attends to, its own included); out [R, Hq, D] contiguous.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vexp.h"

/* Rows are fetched this many tokens ahead: a row is a head's slice of a slot, so the
 * hardware prefetcher sees a strided walk through scattered pages. 16 sequences x 192
 * tokens, 30 layers of K/V (141 MB): 12 -> 6 ms. */
enum { PREFETCH = 16 };

/* offsets[t]: where token t's row of this KV head starts, walking the pages one at a
 * time (no division per token, and both passes below reuse it). */
static void slot_offsets(const int64_t *pages, int64_t len, int64_t page_size, int64_t slot_stride,
                         int64_t head_offset, int64_t *offsets)
{
    for (int64_t first = 0, pg = 0; first < len; first += page_size, pg++) {
        const int64_t base = pages[pg] * page_size * slot_stride + head_offset;
        const int64_t in_page = len - first < page_size ? len - first : page_size;
        for (int64_t j = 0; j < in_page; j++)
            offsets[first + j] = base + j * slot_stride;
    }
}

/* A cache element's bytes: 4 (fp32) or 2 (bf16); offsets count elements. */
static inline int64_t kv_element_bytes(int bf16) { return bf16 ? 2 : 4; }

/* Element `offset` of a cache. */
static inline const void *kv_at(const void *cache, int64_t offset, int bf16)
{
    return (const char *)cache + offset * kv_element_bytes(bf16);
}

/* A row as fp32: itself, or its bf16 widened into `wide` (exact), so the loops below sum in
 * the same order over either cache. */
static inline const float *row_f32(const void *row, int64_t dim, int bf16, float *wide)
{
    if (!bf16)
        return row;
    for (int64_t d = 0; d < dim; d++) {
        const uint32_t bits = (uint32_t)((const uint16_t *)row)[d] << 16;
        memcpy(wide + d, &bits, sizeof bits);
    }
    return wide;
}

/* Token t's row (dim elements at offsets[t]) on its way to L1, if there is a token t. */
static inline void prefetch_row(const void *cache, const int64_t *offsets, int64_t t, int64_t len, int64_t dim,
                                int bf16)
{
    if (t < len)
        for (int64_t b = 0; b < dim * kv_element_bytes(bf16); b += 64)
            __builtin_prefetch((const char *)kv_at(cache, offsets[t], bf16) + b);
}

/* scores[g * len + t] = scale * q[g] . k[t] for the group's query heads. */
static void scores_scalar(const float *q, const void *k_cache, const int64_t *offsets, int64_t len, int64_t dim,
                          int64_t group, float scale, int bf16, float *scores)
{
    float wide[dim];
    for (int64_t t = 0; t < len; t++) {
        const float *k = row_f32(kv_at(k_cache, offsets[t], bf16), dim, bf16, wide);
        prefetch_row(k_cache, offsets, t + PREFETCH, len, dim, bf16);
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * dim;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < dim; d++)
                acc += qg[d] * k[d];
            scores[g * len + t] = acc * scale;
        }
    }
}

/* out[g] = sum over t of scores[g * len + t] * v[t]. */
static void weighted_sum_scalar(const void *v_cache, const int64_t *offsets, int64_t len, int64_t dim,
                                int64_t group, const float *scores, int bf16, float *out)
{
    float wide[dim];
    memset(out, 0, group * dim * sizeof(float));
    for (int64_t t = 0; t < len; t++) {
        const float *v = row_f32(kv_at(v_cache, offsets[t], bf16), dim, bf16, wide);
        prefetch_row(v_cache, offsets, t + PREFETCH, len, dim, bf16);
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * len + t];
            float *o = out + g * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++)
                o[d] += p * v[d];
        }
    }
}

/* Each row of scores: softmax in place. */
static void softmax_rows(float *scores, int64_t rows, int64_t len)
{
    for (int64_t g = 0; g < rows; g++) {
        float *s = scores + g * len;
        float max = -INFINITY, sum = 0.f;
        /* The largest is the same in any order; scalar, this loop was 13 % of a decode's attention. */
#pragma omp simd reduction(max : max)
        for (int64_t t = 0; t < len; t++)
            max = s[t] > max ? s[t] : max;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            s[t] = vexp(s[t] - max);
            sum += s[t];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; t++)
            s[t] *= inv;
    }
}

#ifdef __AVX512F__
#include <immintrin.h>

/* Lane j of the result: the sum of v[j]'s lanes. Four rounds of pairwise shuffles and
 * adds (15 adds for 16 dot products, where 16 horizontal sums take 64), then one
 * permute to put the sums in order. */
static inline __m512 sum16(const __m512 v[16])
{
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* 256-bit halves: lanes 0-7 v[i], 8-15 v[i + 8] */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit blocks: v[i], v[i + 8], v[i + 4], v[i + 12] */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
    for (int i = 0; i < 2; i++) /* pairs within a block: b[i]'s, b[i + 2]'s */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[i], b[i + 2], 0x44), _mm512_shuffle_ps(b[i], b[i + 2], 0xEE));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
    return _mm512_permutexvar_ps(order, sums);
}

/* Elements 16c .. 16c + 15 of a K or V row as fp32. */
static inline __attribute__((always_inline)) __m512 kv_load16(const void *row, int c, int bf16)
{
    if (!bf16)
        return _mm512_loadu_ps((const float *)row + 16 * c);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + 16 * c));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* scores_scalar for dim = 16 * DV over `heads` KV heads of each slot, 16 tokens at a time: a
 * block's K rows are widened once (bf16) into `block` and every query head of the KV head reads
 * them there, the 16 dot products in registers; rows past the end are zeros whose scores are
 * never stored. Each score is the same chain of multiply-adds over the row as before, so the
 * output does not depend on how the rows were loaded. */
static inline __attribute__((always_inline)) void scores_avx512(const float *q, const void *k_cache,
                                                               const int64_t *offsets, int64_t len, const int DV,
                                                               int64_t heads, int64_t group, float scale,
                                                               const int bf16, float *scores)
{
    static const float zeros[128] __attribute__((aligned(64)));
    float block[16 * 128] __attribute__((aligned(64)));
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int n = len - t0 < 16 ? (int)(len - t0) : 16;
        for (int64_t t = t0 + PREFETCH; t < t0 + PREFETCH + 16; t++)
            prefetch_row(k_cache, offsets, t, len, heads * 16 * DV, bf16);
        for (int64_t h = 0; h < heads; h++) {
            const float *rows[16];
            for (int j = 0; j < 16; j++) {
                if (j >= n) {
                    rows[j] = zeros;
                    continue;
                }
                const void *k = kv_at(k_cache, offsets[t0 + j] + h * 16 * DV, bf16);
                if (!bf16) {
                    rows[j] = k;
                    continue;
                }
                for (int c = 0; c < DV; c++)
                    _mm512_store_ps(block + (j * DV + c) * 16, kv_load16(k, c, 1));
                rows[j] = block + j * DV * 16;
            }
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + (h * group + g) * 16 * DV;
                __m512 qv[8], acc[16];
                for (int c = 0; c < DV; c++)
                    qv[c] = _mm512_loadu_ps(qg + 16 * c);
#pragma GCC unroll 16
                for (int j = 0; j < 16; j++) {
                    acc[j] = _mm512_setzero_ps();
                    for (int c = 0; c < DV; c++)
                        acc[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows[j] + 16 * c), acc[j]);
                }
                _mm512_mask_storeu_ps(scores + (h * group + g) * len + t0, (__mmask16)((1u << n) - 1),
                                      _mm512_mul_ps(sum16(acc), scale_v));
            }
        }
    }
}

/* weighted_sum_scalar for dim = 16 * DV: the outputs of up to 16 / DV query heads stay
 * in registers through the pass over V. */
static inline __attribute__((always_inline)) void weighted_sum_avx512(const void *v_cache, const int64_t *offsets,
                                                                     int64_t len, const int DV, int64_t group,
                                                                     const float *scores, const int bf16,
                                                                     float *out)
{
    const int per_pass = 16 / DV;
    for (int64_t g0 = 0; g0 < group; g0 += per_pass) {
        const int heads = group - g0 < per_pass ? (int)(group - g0) : per_pass;
        __m512 acc[16];
        for (int i = 0; i < 16; i++)
            acc[i] = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t++) {
            const void *v = kv_at(v_cache, offsets[t], bf16);
            prefetch_row(v_cache, offsets, t + PREFETCH, len, 16 * DV, bf16);
            __m512 vv[8];
            for (int c = 0; c < DV; c++)
                vv[c] = kv_load16(v, c, bf16);
            for (int h = 0; h < per_pass; h++)
                if (h < heads) {
                    const __m512 p = _mm512_set1_ps(scores[(g0 + h) * len + t]);
                    for (int c = 0; c < DV; c++)
                        acc[h * DV + c] = _mm512_fmadd_ps(p, vv[c], acc[h * DV + c]);
                }
        }
        for (int h = 0; h < heads; h++)
            for (int c = 0; c < DV; c++)
                _mm512_storeu_ps(out + (g0 + h) * 16 * DV + 16 * c, acc[h * DV + c]);
    }
}

/* A task's heads with a head dim of 16 * DV, DV a constant after inlining. */
static inline __attribute__((always_inline)) void attend_avx512(const float *q, const void *k_cache,
                                                               const void *v_cache, const int64_t *offsets,
                                                               int64_t len, const int DV, int64_t heads,
                                                               int64_t group, float scale, const int bf16,
                                                               float *scores, float *out)
{
    scores_avx512(q, k_cache, offsets, len, DV, heads, group, scale, bf16, scores);
    softmax_rows(scores, heads * group, len);
    /* V head by head: reading a slot's heads together here measured slower (7.3 ms at 16
     * x 192 against 6.9), and cost prefill chunks 5 % (their outputs left the registers
     * at every block). */
    for (int64_t h = 0; h < heads; h++)
        weighted_sum_avx512(kv_at(v_cache, h * 16 * DV, bf16), offsets, len, DV, group, scores + h * group * len,
                            bf16, out + h * group * 16 * DV);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Lane j of the result: the sum of v[j]'s lanes (three rounds of pairwise adds for 8 dot products). */
static inline __m256 sum8(const __m256 v[8])
{
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3); /* 128-bit halves: lo, hi sums */
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* Elements 8c .. 8c + 7 of a K or V row as fp32. */
static inline __attribute__((always_inline)) __m256 kv_load8(const void *row, int c, int bf16)
{
    if (!bf16)
        return _mm256_loadu_ps((const float *)row + 8 * c);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + 8 * c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* scores_scalar for dim = 8 * DV, 8 tokens at a time: a token's dot product is summed across
 * lanes with seven others' (the general loop summed each token's alone). As in scores_avx512, a
 * block's rows are widened once for all the query heads, past the end zeros. */
static inline __attribute__((always_inline)) void scores_avx2(const float *q, const void *k_cache,
                                                             const int64_t *offsets, int64_t len, const int DV,
                                                             int64_t group, float scale, const int bf16,
                                                             float *scores)
{
    static const float zeros[128] __attribute__((aligned(32)));
    float block[8 * 128] __attribute__((aligned(32)));
    const __m256 scale_v = _mm256_set1_ps(scale);
    for (int64_t t0 = 0; t0 < len; t0 += 8) {
        const int n = len - t0 < 8 ? (int)(len - t0) : 8;
        for (int64_t t = t0 + PREFETCH; t < t0 + PREFETCH + 8; t++)
            prefetch_row(k_cache, offsets, t, len, 8 * DV, bf16);
        const float *rows[8];
        for (int j = 0; j < 8; j++) {
            if (j >= n) {
                rows[j] = zeros;
                continue;
            }
            const void *k = kv_at(k_cache, offsets[t0 + j], bf16);
            if (!bf16) {
                rows[j] = k;
                continue;
            }
            for (int c = 0; c < DV; c++)
                _mm256_store_ps(block + (j * DV + c) * 8, kv_load8(k, c, 1));
            rows[j] = block + j * DV * 8;
        }
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * 8 * DV;
            __m256 acc[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                acc[j] = _mm256_setzero_ps();
                for (int c = 0; c < DV; c++)
                    acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), _mm256_loadu_ps(rows[j] + 8 * c), acc[j]);
            }
            float out[8];
            _mm256_storeu_ps(out, _mm256_mul_ps(sum8(acc), scale_v));
            memcpy(scores + g * len + t0, out, n * sizeof(float));
        }
    }
}

/* weighted_sum_scalar for dim = 8 * DV with the outputs in registers through the pass over V:
 * 8 vectors of them a pass (two heads of dim 32, one of 64, half of one of 128). Each output
 * is the same multiply-add chain over the tokens in order. */
static inline __attribute__((always_inline)) void weighted_sum_avx2(const void *v_cache, const int64_t *offsets,
                                                                   int64_t len, const int DV, int64_t group,
                                                                   const float *scores, const int bf16, float *out)
{
    const int cols = DV < 8 ? DV : 8, per_pass = 8 / cols;
    for (int64_t g0 = 0; g0 < group; g0 += per_pass)
        for (int c0 = 0; c0 < DV; c0 += cols) {
            const int heads = group - g0 < per_pass ? (int)(group - g0) : per_pass;
            __m256 acc[8];
            for (int i = 0; i < 8; i++)
                acc[i] = _mm256_setzero_ps();
            for (int64_t t = 0; t < len; t++) {
                const void *v = kv_at(v_cache, offsets[t] + 8 * c0, bf16);
                if (c0 == 0)
                    prefetch_row(v_cache, offsets, t + PREFETCH, len, 8 * DV, bf16);
                for (int h = 0; h < per_pass; h++)
                    if (h < heads) {
                        const __m256 p = _mm256_set1_ps(scores[(g0 + h) * len + t]);
                        for (int c = 0; c < cols; c++)
                            acc[h * cols + c] = _mm256_fmadd_ps(p, kv_load8(v, c, bf16), acc[h * cols + c]);
                    }
            }
            for (int h = 0; h < heads; h++)
                for (int c = 0; c < cols; c++)
                    _mm256_storeu_ps(out + (g0 + h) * 8 * DV + 8 * (c0 + c), acc[h * cols + c]);
        }
}

/* One KV head's query heads with a head dim of 8 * DV. */
static inline __attribute__((always_inline)) void attend_avx2(const float *q, const void *k_cache,
                                                             const void *v_cache, const int64_t *offsets,
                                                             int64_t len, const int DV, int64_t group, float scale,
                                                             const int bf16, float *scores, float *out)
{
    scores_avx2(q, k_cache, offsets, len, DV, group, scale, bf16, scores);
    softmax_rows(scores, group, len);
    weighted_sum_avx2(v_cache, offsets, len, DV, group, scores, bf16, out);
}
#endif

/* One task: `heads` KV heads of one row, each with its `group` query heads; q and out
 * [heads * group, dim], offsets pointing at the first head's row of each slot. bf16: the
 * cache's elements, a constant after inlining. */
static inline __attribute__((always_inline)) void attend_kind(const float *q, const void *k_cache,
                                                             const void *v_cache, const int64_t *offsets,
                                                             int64_t len, int64_t dim, int64_t heads, int64_t group,
                                                             float scale, const int bf16, float *scores, float *out)
{
#ifdef __AVX512F__
    switch (dim) {
    case 32: attend_avx512(q, k_cache, v_cache, offsets, len, 2, heads, group, scale, bf16, scores, out); return;
    case 64: attend_avx512(q, k_cache, v_cache, offsets, len, 4, heads, group, scale, bf16, scores, out); return;
    case 128: attend_avx512(q, k_cache, v_cache, offsets, len, 8, heads, group, scale, bf16, scores, out); return;
    }
#endif
    for (int64_t h = 0; h < heads; h++) {
        const float *qh = q + h * group * dim;
        const void *kh = kv_at(k_cache, h * dim, bf16), *vh = kv_at(v_cache, h * dim, bf16);
        float *oh = out + h * group * dim;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        switch (dim) {
        case 32: attend_avx2(qh, kh, vh, offsets, len, 4, group, scale, bf16, scores, oh); continue;
        case 64: attend_avx2(qh, kh, vh, offsets, len, 8, group, scale, bf16, scores, oh); continue;
        case 128: attend_avx2(qh, kh, vh, offsets, len, 16, group, scale, bf16, scores, oh); continue;
        }
#endif
        scores_scalar(qh, kh, offsets, len, dim, group, scale, bf16, scores);
        softmax_rows(scores, group, len);
        weighted_sum_scalar(vh, offsets, len, dim, group, scores, bf16, oh);
    }
}

/* Not inlined: decoder.c's team form calls it too, and runs the same instructions. */
__attribute__((noinline)) static void attend(const float *q, const void *k_cache, const void *v_cache,
                                             const int64_t *offsets, int64_t len,
                   int64_t dim, int64_t heads, int64_t group, float scale, int bf16, float *scores, float *out)
{
    if (bf16)
        attend_kind(q, k_cache, v_cache, offsets, len, dim, heads, group, scale, 1, scores, out);
    else
        attend_kind(q, k_cache, v_cache, offsets, len, dim, heads, group, scale, 0, scores, out);
}

/* kv_bf16: the cache holds bf16 (else fp32). Returns 0, or -1 when a task list or scores buffer
 * could not be allocated. */
int paged_attention_f32(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                        const int64_t *pages, int64_t max_pages, const int64_t *seqs, const int64_t *lens,
                        int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t dim, int64_t page_size,
                        float scale, int64_t kv_bf16, float *out)
{
    /* A task is one KV head of a row, or all of them for a decode row (the only row of
     * its sequence) when there are rows enough to keep every thread busy: a slot's heads
     * are contiguous, so its pass over K streams whole pages in order (30 layers of 192
     * tokens: 16 decodes 8.1 -> 6.9 ms, 8 decodes 2.7 -> 2.2 ms). Rows of a prefill chunk
     * read their context from cache, where one head a task is faster (128 rows over 512
     * tokens: 45 -> 51 ms when each took every head). With fewer KV heads than threads, a
     * task is one query head, its KV head's rows re-read from cache. One decode's 3 KV heads
     * on 2 threads were split so too until its query heads shared their K/V loads: now one
     * thread doing two KV heads is faster (430 tokens, 30 layers: 94-100 -> 56-74 us a layer,
     * docs/cpu.md). The output is the same either way. */
    if (rows == 0) /* nothing to do, and malloc(0) may return NULL */
        return 0;
    const int64_t group = num_heads / num_kv_heads;
    const int whole = rows >= 2 * omp_get_max_threads();
    const int64_t per_head = rows * num_kv_heads < omp_get_max_threads() ? group : 1; /* tasks a KV head */
    int64_t *task_row = malloc(3 * rows * num_heads * sizeof(int64_t));
    if (!task_row)
        return -1;
    int64_t *task_head = task_row + rows * num_heads, *task_q = task_head + rows * num_heads;
    int64_t tasks = 0, longest = 1;
    for (int64_t b = 0; b < rows; b++) {
        longest = lens[b] > longest ? lens[b] : longest;
        const int alone = (b == 0 || seqs[b - 1] != seqs[b]) && (b == rows - 1 || seqs[b + 1] != seqs[b]);
        for (int64_t h = 0; h < num_kv_heads; h++)
            for (int64_t g = 0; g < per_head; g++)
                if (h == 0 || !(whole && alone)) {
                    task_row[tasks] = b;
                    task_head[tasks] = whole && alone ? -1 : h; /* -1: every head */
                    task_q[tasks++] = per_head == 1 ? -1 : g;  /* -1: every query head of the KV head */
                }
    }
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(num_heads * longest * sizeof(float));
        int64_t *offsets = malloc(longest * sizeof(int64_t));
        if (!scores || !offsets) {
#pragma omp atomic write
            failed = 1;
        }
        /* Tasks handed out one at a time: when the OS preempts one thread (the server's
         * threads share these cores), the other takes over the rest of its share. */
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < tasks; i++) {
            if (!scores || !offsets)
                continue;
            const int64_t b = task_row[i], h = task_head[i] < 0 ? 0 : task_head[i];
            const int64_t heads = task_head[i] < 0 ? num_kv_heads : 1;
            const int64_t first_q = h * group + (task_q[i] < 0 ? 0 : task_q[i]);
            slot_offsets(pages + seqs[b] * max_pages, lens[b], page_size, num_kv_heads * dim, h * dim, offsets);
            attend(q + b * q_stride + first_q * dim, k_cache, v_cache, offsets, lens[b], dim, heads,
                   task_q[i] < 0 ? group : 1, scale, kv_bf16 != 0, scores, out + (b * num_heads + first_q) * dim);
        }
        free(scores);
        free(offsets);
    }
    free(task_row);
    return failed ? -1 : 0;
}
