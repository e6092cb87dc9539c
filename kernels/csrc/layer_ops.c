/* The small per-layer ops of a decoder between its matmuls, fp32, one call each.
 *
 * In a decode step each of these is a few thousand floats, so in torch their time
 * was dispatch, not arithmetic: about twenty ops a layer, 3.5 ms of a 26 ms step at
 * 16 sequences on the default model. Here the residual add and RMSNorm are one pass,
 * rotary embedding is done in place on the fused q|k|v rows, the K/V store is one
 * copy per token, and the SiLU gate is one pass writing the down projection's input.
 *
 * The arithmetic keeps transformers' order (x * rsqrt(mean(x^2) + eps), then * weight;
 * x * cos + rotate_half(x) * sin; silu(g) * u) and no multiply-add is fused into an FMA
 * (fp-contract off below): the matmuls and the attention are where rounding differs.
 * Reductions (the sum of squares) run in vector order, so a norm is within an ulp or two
 * of torch's, not bit-identical. Small inputs run on the calling thread: a parallel
 * region costs more than the work below about 64K floats.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vexp.h"

#define NOCONTRACT __attribute__((optimize("fp-contract=off")))
enum { PARALLEL_MIN = 1 << 16 };

/* One row of add_rms_norm_f32: x += h (h may be NULL), then y = rms_norm(x) * weight. Not inlined,
 * so the team decoder (decoder.c) runs the same instructions, and so the same vector sums. */
NOCONTRACT __attribute__((noinline)) static void add_rms_norm_row(float *x, const float *h, const float *weight,
                                                                   float *y, int64_t dim, float eps)
{
    if (h) {
#pragma omp simd
        for (int64_t d = 0; d < dim; d++)
            x[d] += h[d];
    }
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t d = 0; d < dim; d++)
        squares += x[d] * x[d];
    const float inv = 1.f / sqrtf(squares / (float)dim + eps);
#pragma omp simd
    for (int64_t d = 0; d < dim; d++)
        y[d] = weight[d] * (x[d] * inv);
}

/* residual += h (h may be NULL), then out = rms_norm(residual) * weight; all [rows, dim]
 * contiguous. */
int add_rms_norm_f32(float *residual, const float *h, const float *weight, float *out, int64_t rows, int64_t dim,
                     float eps)
{
#pragma omp parallel for if (rows * dim >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(residual + r * dim, h ? h + r * dim : NULL, weight, out + r * dim, dim, eps);
    return 0;
}

/* Rotary embedding in place on one row's `heads` heads (contiguous); c, s: its cos and signed sin. */
NOCONTRACT __attribute__((noinline)) static void rope_row(float *x, int64_t heads, int64_t dim, const float *c,
                                                           const float *s)
{
    const int64_t half = dim / 2;
    for (int64_t hd = 0; hd < heads; hd++) {
        float *v = x + hd * dim;
        float first[half];
        memcpy(first, v, half * sizeof(float));
#pragma omp simd
        for (int64_t d = 0; d < half; d++)
            v[d] = v[d] * c[d] + v[d + half] * s[d];
#pragma omp simd
        for (int64_t d = 0; d < half; d++)
            v[d + half] = v[d + half] * c[d + half] + first[d] * s[d + half];
    }
}

/* Rotary embedding in place on `heads` heads of each row: x [rows, heads, dim] with row
 * stride ld (floats; the heads of a row contiguous). cos, signed_sin [rows, dim], sin's
 * first half negated, so x * cos + rotate_half(x) * sin == x * cos + roll(x) * signed_sin. */
int rope_f32(float *x, int64_t ld, int64_t rows, int64_t heads, int64_t dim, const float *cos,
             const float *signed_sin)
{
#pragma omp parallel for if (rows * heads * dim >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        rope_row(x + r * ld, heads, dim, cos + r * dim, signed_sin + r * dim);
    return 0;
}

/* One token's K and V into fp32 caches at their slot (width floats each). */
static inline void store_kv_row_f32(const float *k, const float *v, int64_t slot, int64_t width, float *k_cache,
                                    float *v_cache)
{
    memcpy(k_cache + slot * width, k, width * sizeof(float));
    memcpy(v_cache + slot * width, v, width * sizeof(float));
}

/* k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t]: k, v [rows, width] with row strides
 * k_ld, v_ld; the caches [slots, width] contiguous. */
int store_kv_f32(const float *k, int64_t k_ld, const float *v, int64_t v_ld, const int64_t *slots, int64_t rows,
                 int64_t width, float *k_cache, float *v_cache)
{
#pragma omp parallel for if (rows * width >= PARALLEL_MIN) schedule(static)
    for (int64_t t = 0; t < rows; t++)
        store_kv_row_f32(k + t * k_ld, v + t * v_ld, slots[t], width, k_cache, v_cache);
    return 0;
}

/* fp32 -> bf16 as torch's .to(torch.bfloat16): round to nearest even; a NaN stays a NaN. */
static inline uint16_t float_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* One token's K and V into bf16 caches, each value rounded. */
static inline void store_kv_row_bf16(const float *k, const float *v, int64_t slot, int64_t width, uint16_t *k_cache,
                                     uint16_t *v_cache)
{
    uint16_t *kc = k_cache + slot * width, *vc = v_cache + slot * width;
    for (int64_t i = 0; i < width; i++) {
        kc[i] = float_bf16(k[i]);
        vc[i] = float_bf16(v[i]);
    }
}

/* store_kv_f32 into bf16 caches (kv_cache_dtype bfloat16). */
int store_kv_bf16(const float *k, int64_t k_ld, const float *v, int64_t v_ld, const int64_t *slots, int64_t rows,
                  int64_t width, uint16_t *k_cache, uint16_t *v_cache)
{
#pragma omp parallel for if (rows * width >= PARALLEL_MIN) schedule(static)
    for (int64_t t = 0; t < rows; t++)
        store_kv_row_bf16(k + t * k_ld, v + t * v_ld, slots[t], width, k_cache, v_cache);
    return 0;
}

/* One row of silu_mul_f32: y = silu(g[:inter]) * g[inter:]. Not inlined, as add_rms_norm_row. */
NOCONTRACT __attribute__((noinline)) static void silu_mul_row(const float *g, int64_t inter, float *y)
{
    const float *u = g + inter;
    /* Each lane's exp is a long dependent chain: 16 lanes an iteration (two AVX2 vectors) keep
     * more of them in flight than the 8 GCC picks on its own, 1536 gates 4.4 -> 2.4-3.0 us. */
#pragma omp simd simdlen(16)
    for (int64_t i = 0; i < inter; i++)
        y[i] = g[i] / (1.f + vexp(-g[i])) * u[i];
}

/* out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:]; gate_up [rows, 2 * inter],
 * out [rows, inter], both contiguous. From 4096 gates (three rows of the default model) both
 * threads take rows. */
int silu_mul_f32(const float *gate_up, int64_t rows, int64_t inter, float *out)
{
#pragma omp parallel for if (rows * inter >= PARALLEL_MIN / 16) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row(gate_up + r * 2 * inter, inter, out + r * inter);
    return 0;
}
