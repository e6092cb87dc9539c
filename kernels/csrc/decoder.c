/* Every decoder layer of a Llama-family model for one batch, fp32 (weights fp32, bf16 or int8), in one call.
 *
 * The ops are the other kernels of this directory, called in the model's order: this
 * file only replaces the Python that sequenced them. That Python (about ten ctypes
 * calls, tensor views and allocations a layer) ran on one thread while the other
 * OpenMP thread spun in its barrier: 2.5-3.4 ms of a 20 ms decode step at 8
 * sequences on the default model (perf: libpython, libtorch and libc on the engine
 * thread, libgomp's spin on the other). Each op keeps its own parallel region, so
 * the arithmetic, and the output, are those of the per-op path bit for bit.
 *
 * Per layer (weights[l * 6 + i] holds the address of):
 *   x = rms_norm(residual += h) * input_norm[0]      (no add in layer 0)
 *   qkv = x @ qkv[1]; rope on its q and k heads; k, v stored in their slots
 *   h = attention(q over the pages) @ o_proj[2]
 *   x = rms_norm(residual += h) * post_norm[3]
 *   h = silu_mul(x @ gate_up[4]) @ down[5]
 * and the last layer's h is left in `h`, not added, for the caller's final norm.
 * Models with a qkv bias or q/k norms keep the per-op path.
 */
#include "layer_ops.c"
#include "paged_attention.c"
#include "panel_gemm.c"

struct decoder_shape {
    int64_t rows, hidden, layers, heads, kv_heads, dim, inter, page_size, max_pages;
    int64_t weights; /* the matmul weights' panels: 0 fp32, 1 bf16, 2 int8 (panel_gemm.c) */
    int64_t kv_bf16; /* the KV cache's elements: 0 fp32, 1 bf16 */
    float eps, scale;
};

/* y = x @ w by the weights' kind; xb: the rows' bf16 scratch (bf16 and int8 weights). */
static int gemm(const struct decoder_shape *s, const float *x, int64_t ldx, const void *w, int64_t n, int64_t k,
                float *y, uint32_t *xb)
{
    switch (s->weights) {
    case 1: return panel_gemm_bf16(x, ldx, (const uint16_t *)w, s->rows, n, k, y, xb);
    case 2: return panel_gemm_i8(x, ldx, (const int8_t *)w, s->rows, n, k, y, xb);
    default: return panel_gemm_f32(x, ldx, (const float *)w, s->rows, n, k, y);
    }
}

/* kv: [layers, 2, P, S, Hkv, D] contiguous, fp32 or bf16 (s->kv_bf16), kv_layer_stride elements
 * from one layer to the next and v_offset from a layer's K to its V. Workspaces: x [rows, hidden], qkv [rows,
 * (heads + 2 kv_heads) dim], attn [rows, heads dim], h [rows, hidden], gate_up [rows,
 * 2 inter], act [rows, inter], xb: panel_gemm_bf16's scratch for rows of max(hidden, heads dim, inter)
 * (bf16 and int8 weights).
 * Returns 0, -1 without AVX-512 or AVX2 and FMA (nothing done), or -2 when
 * the attention had no memory for its scores. */
int decoder_layers_f32(const struct decoder_shape *s, float *residual, const int64_t *weights, const float *cos,
                       const float *signed_sin, void *kv, int64_t kv_layer_stride, int64_t v_offset,
                       const int64_t *slots, const int64_t *pages, const int64_t *seqs, const int64_t *lens,
                       float *x, float *qkv, float *attn, float *h, float *gate_up, float *act, uint32_t *xb)
{
    const int64_t q_size = s->heads * s->dim, kv_size = s->kv_heads * s->dim, width = q_size + 2 * kv_size;
    for (int64_t l = 0; l < s->layers; l++) {
        const float *const *w = (const float *const *)(weights + 6 * l); /* w[1, 2, 4, 5]: by s->weights */
        char *k_cache = (char *)kv + l * kv_layer_stride * kv_element_bytes(s->kv_bf16);
        char *v_cache = k_cache + v_offset * kv_element_bytes(s->kv_bf16);
        add_rms_norm_f32(residual, l ? h : NULL, w[0], x, s->rows, s->hidden, s->eps);
        if (gemm(s, x, s->hidden, w[1], width, s->hidden, qkv, xb) != 0)
            return -1;
        rope_f32(qkv, width, s->rows, s->heads + s->kv_heads, s->dim, cos, signed_sin);
        if (s->kv_bf16)
            store_kv_bf16(qkv + q_size, width, qkv + q_size + kv_size, width, slots, s->rows, kv_size,
                          (uint16_t *)k_cache, (uint16_t *)v_cache);
        else
            store_kv_f32(qkv + q_size, width, qkv + q_size + kv_size, width, slots, s->rows, kv_size,
                         (float *)k_cache, (float *)v_cache);
        if (paged_attention_f32(qkv, width, k_cache, v_cache, pages, s->max_pages, seqs, lens, s->rows, s->heads,
                                s->kv_heads, s->dim, s->page_size, s->scale, s->kv_bf16, attn) != 0)
            return -2;
        gemm(s, attn, q_size, w[2], s->hidden, q_size, h, xb);
        add_rms_norm_f32(residual, h, w[3], x, s->rows, s->hidden, s->eps);
        gemm(s, x, s->hidden, w[4], 2 * s->inter, s->hidden, gate_up, xb);
        silu_mul_f32(gate_up, s->rows, s->inter, act);
        gemm(s, act, s->inter, w[5], s->hidden, s->inter, h, xb);
    }
    return 0;
}
