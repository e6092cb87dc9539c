/* A Llama-family model's forward for one batch, fp32 (weights fp32, bf16 or int8), in one call:
 * the embedding rows, every decoder layer, and the final norm of the rows that sample.
 *
 * The ops are the other kernels of this directory, called in the model's order: this
 * file only replaces the Python that sequenced them. That Python (about ten ctypes
 * calls, tensor views and allocations a layer) ran on one thread while the other
 * OpenMP thread spun in its barrier: 2.5-3.4 ms of a 20 ms decode step at 8
 * sequences on the default model (perf: libpython, libtorch and libc on the engine
 * thread, libgomp's spin on the other). The embedding lookup, the rope tables' rows and
 * the final norm around the layers were six more torch calls a step (0.3-0.4 ms of a 13 ms
 * one-stream step, docs/cpu.md). Each op keeps its own parallel region, so the arithmetic,
 * and the output, are those of the per-op path bit for bit.
 *
 * Per layer (weights[l * 6 + i] holds the address of):
 *   x = rms_norm(residual += h) * input_norm[0]      (no add in layer 0)
 *   qkv = x @ qkv[1]; rope on its q and k heads; k, v stored in their slots
 *   h = attention(q over the pages) @ o_proj[2]
 *   x = rms_norm(residual += h) * post_norm[3]
 *   h = silu_mul(x @ gate_up[4]) @ down[5]
 * A call runs layers first .. first + layers - 1: from layer 0 it starts from the ids'
 * embedding rows, past it from the residual and h the previous call left; through the last
 * layer it ends with out = rms_norm(residual + h) * final_norm for each of the out_rows.
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

/* One call's range of layers and the model's tensors around them. */
struct decoder_step {
    int64_t first, last;     /* the call runs layers first .. first + shape.layers - 1; last: the model's count */
    const int64_t *ids;      /* [rows] token ids, read when first is 0 */
    const float *embed;      /* [vocab, hidden] */
    int64_t vocab;
    const int64_t *positions; /* [rows], each below max_position */
    const float *cos_table, *sin_table; /* [max_position, dim]: cos and signed sin */
    int64_t max_position;
    const float *final_norm; /* [hidden] */
    const int64_t *out_rows; /* [n_out] rows of the batch normed into out [n_out, hidden] by the last layer's call */
    int64_t n_out;
    float *out;
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
 * from one layer to the next and v_offset from a layer's K to its V; weights and kv point at the
 * call's first layer. Workspaces: residual and h [rows, hidden] (kept between the calls of one
 * forward), cos and sin [rows, dim], x [rows, hidden], qkv [rows, (heads + 2 kv_heads) dim], attn
 * [rows, heads dim], gate_up [rows, 2 inter], act [rows, inter], xb: panel_gemm_bf16's scratch for
 * rows of max(hidden, heads dim, inter) (bf16 and int8 weights).
 * Returns 0, -1 without AVX-512 or AVX2 and FMA (nothing done), -2 when the attention had no
 * memory for its scores; nothing done: -3 for a token id outside the vocabulary, -4 for a position
 * outside the rope tables, -5 for an out row outside the batch. */
int decoder_forward_f32(const struct decoder_shape *s, const struct decoder_step *step, float *residual,
                        const int64_t *weights, void *kv, int64_t kv_layer_stride, int64_t v_offset,
                        const int64_t *slots, const int64_t *pages, const int64_t *seqs, const int64_t *lens,
                        float *cos, float *sin, float *x, float *qkv, float *attn, float *h, float *gate_up,
                        float *act, uint32_t *xb)
{
    for (int64_t r = 0; r < s->rows; r++) {
        if (step->first == 0 && (step->ids[r] < 0 || step->ids[r] >= step->vocab))
            return -3;
        if (step->positions[r] < 0 || step->positions[r] >= step->max_position)
            return -4;
    }
    for (int64_t i = 0; i < step->n_out; i++)
        if (step->out_rows[i] < 0 || step->out_rows[i] >= s->rows)
            return -5;
    for (int64_t r = 0; r < s->rows; r++) {
        if (step->first == 0)
            memcpy(residual + r * s->hidden, step->embed + step->ids[r] * s->hidden, s->hidden * sizeof(float));
        memcpy(cos + r * s->dim, step->cos_table + step->positions[r] * s->dim, s->dim * sizeof(float));
        memcpy(sin + r * s->dim, step->sin_table + step->positions[r] * s->dim, s->dim * sizeof(float));
    }
    const int64_t q_size = s->heads * s->dim, kv_size = s->kv_heads * s->dim, width = q_size + 2 * kv_size;
    for (int64_t l = 0; l < s->layers; l++) {
        const float *const *w = (const float *const *)(weights + 6 * l); /* w[1, 2, 4, 5]: by s->weights */
        char *k_cache = (char *)kv + l * kv_layer_stride * kv_element_bytes(s->kv_bf16);
        char *v_cache = k_cache + v_offset * kv_element_bytes(s->kv_bf16);
        add_rms_norm_f32(residual, l || step->first ? h : NULL, w[0], x, s->rows, s->hidden, s->eps);
        if (gemm(s, x, s->hidden, w[1], width, s->hidden, qkv, xb) != 0)
            return -1;
        rope_f32(qkv, width, s->rows, s->heads + s->kv_heads, s->dim, cos, sin);
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
    if (step->first + s->layers == step->last)
        for (int64_t i = 0; i < step->n_out; i++) { /* the per-op path's gathered rows, one at a time */
            float *y = step->out + i * s->hidden;
            memcpy(y, residual + step->out_rows[i] * s->hidden, s->hidden * sizeof(float));
            add_rms_norm_f32(y, h + step->out_rows[i] * s->hidden, step->final_norm, y, 1, s->hidden, s->eps);
        }
    return 0;
}
