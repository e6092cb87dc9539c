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
 * one-stream step, docs/cpu.md). A call of more than 16 rows keeps a parallel region per op
 * (layers_per_op); up to 16 rows the call is one team that runs the same ops in work items
 * (layers_as_team, below), its GEMM panels on AMX tiles where the per-op form's would be.
 * Either way the arithmetic, and the output, are those of the per-op path bit for bit.
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
#include <stdlib.h>
#include <unistd.h>

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

/* One call's shape, step and tensors (decoder_forward_f32's arguments). */
struct call {
    const struct decoder_shape *s;
    const struct decoder_step *step;
    float *residual;
    const int64_t *weights;
    char *kv;
    int64_t kv_layer_stride, v_offset;
    const int64_t *slots, *pages, *seqs, *lens;
    const float *cos, *sin;
    float *x, *qkv, *attn, *h, *gate_up, *act;
    uint32_t *xb;
    int64_t q_size, kv_size, width, group;
    int attn_rows; /* the team form's attention items: a row each (every KV head) or a KV head each */
};

static const float *const *layer_weights(const struct call *c, int64_t l)
{
    return (const float *const *)(c->weights + 6 * l);
}

/* Layer l's K (v 0) or V (v 1) cache. */
static char *layer_cache(const struct call *c, int64_t l, int v)
{
    return c->kv + (l * c->kv_layer_stride + (v ? c->v_offset : 0)) * kv_element_bytes(c->s->kv_bf16);
}

/* Every layer of the call, op after op, each op a parallel region of its own. */
static int layers_per_op(const struct call *c)
{
    const struct decoder_shape *s = c->s;
    const int64_t q_size = c->q_size, kv_size = c->kv_size, width = c->width;
    for (int64_t l = 0; l < s->layers; l++) {
        const float *const *w = layer_weights(c, l); /* w[1, 2, 4, 5]: by s->weights */
        char *k_cache = layer_cache(c, l, 0), *v_cache = layer_cache(c, l, 1);
        add_rms_norm_f32(c->residual, l || c->step->first ? c->h : NULL, w[0], c->x, s->rows, s->hidden, s->eps);
        if (gemm(s, c->x, s->hidden, w[1], width, s->hidden, c->qkv, c->xb) != 0)
            return -1;
        rope_f32(c->qkv, width, s->rows, s->heads + s->kv_heads, s->dim, c->cos, c->sin);
        if (s->kv_bf16)
            store_kv_bf16(c->qkv + q_size, width, c->qkv + q_size + kv_size, width, c->slots, s->rows, kv_size,
                          (uint16_t *)k_cache, (uint16_t *)v_cache);
        else
            store_kv_f32(c->qkv + q_size, width, c->qkv + q_size + kv_size, width, c->slots, s->rows, kv_size,
                         (float *)k_cache, (float *)v_cache);
        if (paged_attention_f32(c->qkv, width, k_cache, v_cache, c->pages, s->max_pages, c->seqs, c->lens, s->rows,
                                s->heads, s->kv_heads, s->dim, s->page_size, s->scale, s->kv_bf16, c->attn) != 0)
            return -2;
        gemm(s, c->attn, q_size, w[2], s->hidden, q_size, c->h, c->xb);
        add_rms_norm_f32(c->residual, c->h, w[3], c->x, s->rows, s->hidden, s->eps);
        gemm(s, c->x, s->hidden, w[4], 2 * s->inter, s->hidden, c->gate_up, c->xb);
        silu_mul_f32(c->gate_up, s->rows, s->inter, c->act);
        gemm(s, c->act, s->inter, w[5], s->hidden, s->inter, c->h, c->xb);
    }
    return 0;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <x86intrin.h>

/* Whether any of the call's GEMMs runs on AMX tiles (bf16 from 8 rows, int8 from 16: panel_gemm.c). */
static int tiles_would_run(const struct decoder_shape *s)
{
    return gemm_tiles(s->weights, s->rows, s->hidden) || gemm_tiles(s->weights, s->rows, s->heads * s->dim) ||
           gemm_tiles(s->weights, s->rows, s->inter);
}

/* ---- A step of up to 16 rows as one team ----
 *
 * Through tritonserver the server's own threads (the stub's sends, the server's, the client's:
 * about 1 ms of CPU a token on a 2-vCPU machine) preempt one thread of the step's team now and
 * then, and in the per-op form above each of the ~150 parallel regions of a step ends in a join:
 * the other thread waits there for the preempted one, so each ms taken from one costs the step
 * nearly a ms of both. Here the whole call is one parallel region, and every thread runs the
 * same program of phases (per layer: norm, qkv, rope and KV store, attention, o_proj, norm,
 * gate_up, SiLU, down). A phase is a list of items (a panel of a GEMM, a row's attention or one
 * of its KV heads, a row's norm, rope or SiLU), taken from per-thread runs as panel_gemm.c hands
 * out panels; a thread moves on when every item of the phase is done. An item is computed into
 * the thread's own buffer and published by compare-and-swap: the item's state goes from "taken
 * by t" to "being copied by t", then the copy, then "done". A thread that has waited too long for
 * another's item takes it over (the state from "taken by u" to "taken by t") and computes it
 * itself; the late thread's publish then fails and its result is dropped. So a preempted thread
 * holds up no one, and the one left carries on through the layers alone.
 *
 * Why that is safe: a phase reads only what earlier phases wrote and writes only what later
 * phases read, and a phase is done only when all its items are. A thread whose publish succeeds
 * held its item from before its computation began, so the phase was not done meanwhile, no later
 * phase had started, and every input it read was final. A late thread may read inputs that later
 * phases are rewriting, but what it computes from them goes only to its own buffer, and its
 * publish fails. Only a copy in progress is waited for (a few hundred bytes).
 *
 * Every item is computed by the functions the per-op form calls (none inlined where a vector
 * sum could be ordered otherwise), so both forms give the same bits (tests/test_kernels.py). */
int decoder_team_max_rows = 16;     /* rows up to which a call runs as a team; 0: never */
int decoder_team_test_stall_us = 0; /* tests: thread 1 sleeps this long holding a gate_up panel, once a call */
static _Atomic int64_t team_takeovers, team_dropped;

/* Since the library was loaded: which 0, the items a thread took over from another; 1, the results
 * a thread dropped because another had taken its item over. */
int64_t decoder_team_count(int which) { return atomic_load(which ? &team_dropped : &team_takeovers); }

enum { PH_NORM_IN, PH_QKV, PH_ROPE, PH_ATTN, PH_O, PH_NORM_POST, PH_GATE_UP, PH_SILU, PH_DOWN, PHASES };
enum { ITEM_FREE = 0u, ITEM_COPYING = 0x80000000u, ITEM_DONE = 0xFFFFFFFFu };
/* A thread waits for another's item this long before it takes it over, and at least 4 times its
 * own longest item of the phase: about 30 us at the 3-3.5 GHz of a TSC, where an item takes 1-10
 * us at the default model's shapes and a preempted thread is gone for 0.1-3 ms. */
enum { TAKEOVER_TICKS = 100000 };

/* The phases' shared state: each phase's runs of items and every item's state. */
struct phases {
    int64_t threads;
    struct panel_run *runs;  /* [phases][threads] */
    _Atomic uint32_t *state; /* every phase's items, phase after phase */
    int64_t *first_item;     /* [phases + 1]: where a phase's items start in state */
};

/* One thread's buffers: an item's result, the rows as its GEMM panels read them, attention's
 * scores and slot offsets, an int8 panel made bf16 for the tiles. */
struct scratch {
    float *out, *scores;
    uint32_t *xb;
    int64_t *offsets;
    char *panel;
    int stalled;
};

static int64_t phase_items(const struct call *c, int64_t kind)
{
    const struct decoder_shape *s = c->s;
    const int64_t m = s->rows;
    switch (kind) {
    case PH_QKV: return (c->width + PANEL - 1) / PANEL;
    case PH_ATTN: return c->attn_rows ? m : m * s->kv_heads;
    case PH_O: case PH_DOWN: return (s->hidden + PANEL - 1) / PANEL;
    case PH_GATE_UP: return (2 * s->inter + PANEL - 1) / PANEL;
    default: return m; /* the norms, rope and KV store, SiLU: a row each */
    }
}

/* A GEMM phase's y [rows, n] = x [rows, k] @ w (x's row stride k). */
struct gemm {
    const float *x;
    const void *w;
    float *y;
    int64_t k, n;
};

static struct gemm gemm_of(const struct call *c, int64_t kind, int64_t l)
{
    const struct decoder_shape *s = c->s;
    const float *const *lw = layer_weights(c, l);
    switch (kind) {
    case PH_QKV: return (struct gemm){c->x, lw[1], c->qkv, s->hidden, c->width};
    case PH_O: return (struct gemm){c->attn, lw[2], c->h, c->q_size, s->hidden};
    case PH_GATE_UP: return (struct gemm){c->x, lw[4], c->gate_up, s->hidden, 2 * s->inter};
    default: return (struct gemm){c->act, lw[5], c->h, s->inter, s->hidden};
    }
}

static int is_gemm(int64_t kind)
{
    return kind == PH_QKV || kind == PH_O || kind == PH_GATE_UP || kind == PH_DOWN;
}

/* A thread's inputs of a GEMM phase, made once it holds one of its items. */
static void prepare(const struct call *c, struct scratch *sc, int64_t kind, int64_t l)
{
    const struct gemm g = gemm_of(c, kind, l);
    const int tiles = gemm_tiles(c->s->weights, c->s->rows, g.k);
    gemm_rows_alone(c->s->weights, tiles, g.x, g.k, c->s->rows, g.k, sc->xb);
}

static void compute(const struct call *c, struct scratch *sc, int64_t kind, int64_t l, int64_t i)
{
    const struct decoder_shape *s = c->s;
    const float *const *lw = layer_weights(c, l);
    if (is_gemm(kind)) {
        const struct gemm g = gemm_of(c, kind, l);
        gemm_panel_alone(s->weights, gemm_tiles(s->weights, s->rows, g.k), g.x, g.k, sc->xb, g.w, s->rows, g.n, g.k,
                         i, sc->panel, sc->out);
    } else if (kind == PH_NORM_IN || kind == PH_NORM_POST) {
        const int add = kind == PH_NORM_POST || l || c->step->first;
        memcpy(sc->out, c->residual + i * s->hidden, s->hidden * sizeof(float));
        add_rms_norm_row(sc->out, add ? c->h + i * s->hidden : NULL, lw[kind == PH_NORM_IN ? 0 : 3],
                         sc->out + s->hidden, s->hidden, s->eps);
    } else if (kind == PH_SILU) {
        silu_mul_row(c->gate_up + i * 2 * s->inter, s->inter, sc->out);
    } else if (kind == PH_ROPE) {
        memcpy(sc->out, c->qkv + i * c->width, (c->q_size + c->kv_size) * sizeof(float));
        rope_row(sc->out, s->heads + s->kv_heads, s->dim, c->cos + i * s->dim, c->sin + i * s->dim);
    } else { /* PH_ATTN: row i's every KV head, or KV head i % kv_heads of row i / kv_heads */
        const int64_t b = c->attn_rows ? i : i / s->kv_heads, hd = c->attn_rows ? 0 : i % s->kv_heads;
        slot_offsets(c->pages + c->seqs[b] * s->max_pages, c->lens[b], s->page_size, c->kv_size, hd * s->dim,
                     sc->offsets);
        attend(c->qkv + b * c->width + hd * c->group * s->dim, layer_cache(c, l, 0), layer_cache(c, l, 1),
               sc->offsets, c->lens[b], s->dim, c->attn_rows ? s->kv_heads : 1, c->group, s->scale,
               s->kv_bf16 != 0, sc->scores, sc->out);
    }
}

static void publish(const struct call *c, struct scratch *sc, int64_t kind, int64_t l, int64_t i)
{
    const struct decoder_shape *s = c->s;
    if (is_gemm(kind)) {
        const struct gemm g = gemm_of(c, kind, l);
        const int64_t cols = g.n - i * PANEL < PANEL ? g.n - i * PANEL : PANEL;
        for (int64_t r = 0; r < s->rows; r++)
            memcpy(g.y + r * g.n + i * PANEL, sc->out + r * PANEL, cols * sizeof(float));
    } else if (kind == PH_NORM_IN || kind == PH_NORM_POST) {
        memcpy(c->residual + i * s->hidden, sc->out, s->hidden * sizeof(float));
        memcpy(c->x + i * s->hidden, sc->out + s->hidden, s->hidden * sizeof(float));
    } else if (kind == PH_SILU) {
        memcpy(c->act + i * s->inter, sc->out, s->inter * sizeof(float));
    } else if (kind == PH_ROPE) {
        float *row = c->qkv + i * c->width;
        memcpy(row, sc->out, (c->q_size + c->kv_size) * sizeof(float));
        if (s->kv_bf16)
            store_kv_row_bf16(row + c->q_size, row + c->q_size + c->kv_size, c->slots[i], c->kv_size,
                              (uint16_t *)layer_cache(c, l, 0), (uint16_t *)layer_cache(c, l, 1));
        else
            store_kv_row_f32(row + c->q_size, row + c->q_size + c->kv_size, c->slots[i], c->kv_size,
                             (float *)layer_cache(c, l, 0), (float *)layer_cache(c, l, 1));
    } else {
        const int64_t b = c->attn_rows ? i : i / s->kv_heads, hd = c->attn_rows ? 0 : i % s->kv_heads;
        const int64_t heads = c->attn_rows ? s->heads : c->group;
        memcpy(c->attn + (b * s->heads + hd * c->group) * s->dim, sc->out, heads * s->dim * sizeof(float));
    }
}

/* Computes an item this thread holds (state `mine`) and publishes it unless another took it over.
 * Returns the TSC ticks it took. */
static uint64_t run_item(const struct call *c, struct scratch *sc, _Atomic uint32_t *state, uint32_t mine,
                         int64_t kind, int64_t l, int64_t i)
{
    const uint64_t start = __rdtsc();
    compute(c, sc, kind, l, i);
    if (decoder_team_test_stall_us > 0 && mine == 2 && kind == PH_GATE_UP && !sc->stalled) {
        sc->stalled = 1;
        usleep((useconds_t)decoder_team_test_stall_us);
    }
    uint32_t held = mine;
    if (atomic_compare_exchange_strong_explicit(state, &held, ITEM_COPYING | mine, memory_order_acq_rel,
                                                memory_order_relaxed)) {
        publish(c, sc, kind, l, i);
        atomic_store_explicit(state, ITEM_DONE, memory_order_release);
    } else {
        atomic_fetch_add_explicit(&team_dropped, 1, memory_order_relaxed);
    }
    return __rdtsc() - start;
}

static void team_phase(const struct call *c, const struct phases *p, struct scratch *sc, int64_t me, int64_t ph)
{
    const int64_t kind = ph % PHASES, l = ph / PHASES, items = p->first_item[ph + 1] - p->first_item[ph];
    _Atomic uint32_t *state = p->state + p->first_item[ph];
    const uint32_t mine = (uint32_t)me + 1;
    int prepared = !is_gemm(kind);
    uint64_t longest = 0;
    for (int64_t i; (i = next_panel(p->runs + ph * p->threads, p->threads)) >= 0;) {
        uint32_t free_ = ITEM_FREE; /* taken from the runs: marked, unless another took it over first */
        if (!atomic_compare_exchange_strong_explicit(&state[i], &free_, mine, memory_order_acq_rel,
                                                     memory_order_relaxed))
            continue;
        if (!prepared)
            prepare(c, sc, kind, l), prepared = 1;
        const uint64_t took = run_item(c, sc, &state[i], mine, kind, l, i);
        longest = took > longest ? took : longest;
    }
    const uint64_t patience = 4 * longest > TAKEOVER_TICKS ? 4 * longest : TAKEOVER_TICKS;
    for (int64_t i = 0; i < items; i++) {
        uint64_t since = 0;
        for (uint32_t v; (v = atomic_load_explicit(&state[i], memory_order_acquire)) != ITEM_DONE; _mm_pause()) {
            if (v & ITEM_COPYING)
                continue;
            const uint64_t now = __rdtsc();
            if (!since) {
                since = now;
            } else if (now - since > patience &&
                       atomic_compare_exchange_strong_explicit(&state[i], &v, mine, memory_order_acq_rel,
                                                               memory_order_relaxed)) {
                atomic_fetch_add_explicit(&team_takeovers, 1, memory_order_relaxed);
                if (!prepared)
                    prepare(c, sc, kind, l), prepared = 1;
                run_item(c, sc, &state[i], mine, kind, l, i);
                since = 0;
            }
        }
    }
}

static int64_t round64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Every layer of the call as one team of `threads`; -2 without memory for the phases' state. */
static int layers_as_team(const struct call *c, int64_t threads)
{
    const struct decoder_shape *s = c->s;
    const int64_t m = s->rows, count = s->layers * PHASES;
    int64_t longest = 1;
    for (int64_t b = 0; b < m; b++)
        longest = c->lens[b] > longest ? c->lens[b] : longest;
    /* a thread's buffers, each a multiple of 64 bytes */
    const int64_t k2 = (max3(s->hidden, c->q_size, s->inter) + 1) / 2;
    const int64_t outs = max3(2 * s->hidden, c->q_size + c->kv_size, m * PANEL); /* >= heads * dim */
    const int64_t out_bytes = round64(4 * (outs > s->inter ? outs : s->inter));
    const int64_t xb_bytes = round64(4 * ((m + 15) / 16 * 16 * k2 + m * ((k2 + GROUP2 - 1) / GROUP2)));
    const int64_t score_bytes = round64(4 * s->heads * longest), offset_bytes = round64(8 * longest);
    const int tiles = tiles_would_run(s);
    const int64_t panel_bytes = tiles && s->weights == 2 ? round64(4 * PANEL * k2) : 0;
    const int64_t per_thread = out_bytes + xb_bytes + score_bytes + offset_bytes + panel_bytes;
    struct phases p = {.threads = threads, .first_item = malloc((count + 1) * sizeof(int64_t)),
                       .runs = aligned_alloc(64, round64(count * threads * sizeof(struct panel_run)))};
    char *buffers = aligned_alloc(64, threads * per_thread);
    if (p.first_item) {
        p.first_item[0] = 0;
        for (int64_t ph = 0; ph < count; ph++)
            p.first_item[ph + 1] = p.first_item[ph] + phase_items(c, ph % PHASES);
        p.state = calloc(p.first_item[count], sizeof(uint32_t));
    }
    int rc = -2;
    if (p.first_item && p.runs && buffers && p.state) {
        for (int64_t ph = 0; ph < count; ph++)
            init_runs(p.runs + ph * threads, threads, p.first_item[ph + 1] - p.first_item[ph], 1);
#pragma omp parallel num_threads(threads)
        {
            const int64_t me = omp_get_thread_num();
            char *own = buffers + me * per_thread;
            struct scratch sc = {.out = (float *)own, .xb = (uint32_t *)(own + out_bytes),
                                 .scores = (float *)(own + out_bytes + xb_bytes),
                                 .offsets = (int64_t *)(own + out_bytes + xb_bytes + score_bytes),
                                 .panel = own + out_bytes + xb_bytes + score_bytes + offset_bytes};
            gemm_tiles_configure(tiles);
            for (int64_t ph = 0; ph < count; ph++)
                team_phase(c, &p, &sc, me, ph);
            gemm_tiles_release(tiles);
        }
        rc = 0;
    }
    free(p.first_item), free(p.runs), free(buffers), free((void *)p.state);
    return rc;
}
#else
int decoder_team_max_rows = 0, decoder_team_test_stall_us = 0;
int64_t decoder_team_count(int which) { (void)which; return 0; }
static int layers_as_team(const struct call *c, int64_t threads) { (void)c, (void)threads; return -1; }
#endif

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
    const int64_t q_size = s->heads * s->dim, kv_size = s->kv_heads * s->dim, threads = omp_get_max_threads();
    /* As paged_attention_f32 splits a decode: with rows enough for every thread, a row a task */
    int alone = s->rows >= 2 * threads;
    for (int64_t b = 1; b < s->rows; b++)
        alone &= seqs[b - 1] != seqs[b];
    const struct call c = {s, step, residual, weights, kv, kv_layer_stride, v_offset, slots, pages, seqs, lens, cos,
                           sin, x, qkv, attn, h, gate_up, act, xb, q_size, kv_size, q_size + 2 * kv_size,
                           s->heads / s->kv_heads, alone};
    const int team = s->rows <= decoder_team_max_rows && threads > 1 && !omp_in_parallel();
    const int rc = team ? layers_as_team(&c, threads) : layers_per_op(&c);
    if (rc != 0)
        return rc;
    if (step->first + s->layers == step->last)
        for (int64_t i = 0; i < step->n_out; i++) { /* the per-op path's gathered rows, one at a time */
            float *y = step->out + i * s->hidden;
            memcpy(y, residual + step->out_rows[i] * s->hidden, s->hidden * sizeof(float));
            add_rms_norm_f32(y, h + step->out_rows[i] * s->hidden, step->final_norm, y, 1, s->hidden, s->eps);
        }
    return 0;
}
