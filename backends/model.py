"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Plain tensors and functional ops, no nn.Module tree: the per-layer Python work
is a handful of calls, which matters on a 2-core CPU. q/k/v and gate/up are
fused into one matmul each at load time; every matmul goes through the one
`linear` op the device and dtype get (kernels.linear), which also decides how
the weights are stored, and the ops between them (residual add + RMSNorm, rotary
embedding, SiLU gate) through `ops` (kernels.layer_ops): one C call each on a CPU.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors import safe_open

from backends.model_config import ModelConfig, rope_inv_freq
from kernels import AttentionBackend
from kernels.greedy_head import pick_greedy_head
from kernels.layer_ops import pick_ops, rms_norm
from kernels.linear import pick_linear


@dataclass
class LayerWeights:
    """Matmul weights (qkv, o_proj, gate_up, down) are as the linear op prepared them."""

    input_norm: torch.Tensor
    qkv: object                  # [(Hq + 2 Hkv) * D, hidden] before prepare
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None
    o_proj: object
    post_norm: torch.Tensor
    gate_up: object              # [2 * intermediate, hidden] before prepare
    down: object


@dataclass(frozen=True)
class LayerHook:
    """Work a forward runs between layers: `run(i)` once layer i's K/V is in the cache, for
    each i in `after` (ascending). The prefill side of a hand-off posts a layer group's KV
    writes from there; the layers between two of them run in one call where they can."""

    after: tuple[int, ...]
    run: Callable[[int], None]


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, weight_kind: str = "auto"):
        self.linear = pick_linear(device, dtype, weight_kind)
        # dtype is the weights'; a linear may keep the rest in another (bf16 or int8 weights, fp32 rows on a CPU)
        self.weight_dtype, dtype = dtype, getattr(self.linear, "activation_dtype", dtype)
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.ops = pick_ops(device, dtype)
        get = lambda name: weights.pop(name).to(device=device, dtype=dtype).contiguous()
        self.embed = get("model.embed_tokens.weight")
        self.layers = [self._layer(get, weights, i) for i in range(cfg.num_layers)]
        self.norm = get("model.norm.weight")
        head = self.embed if cfg.tie_embeddings or "lm_head.weight" not in weights else get("lm_head.weight")
        self.lm_head = self.linear.prepare(head)
        # None: greedy from full logits
        self.greedy_head = pick_greedy_head(self.linear, head, self.lm_head, tied=head is self.embed)
        self.inv_freq = rope_inv_freq(cfg).to(device)
        self.cos_table = self.sin_table = None  # [positions, D], build_rope_tables
        self.fused_kv = False  # rotate q, k and store k, v in one op (ops.rope_store), set by the runner
        self.scale = cfg.head_dim ** -0.5
        self.decoder = None  # the forward in one call (kernels.decoder), set by the runner where it applies
        self.mlp = None      # (layer, x) -> MLP output when it is not this model's alone (backends.dp)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def _layer(self, get, weights, i: int) -> LayerWeights:
        p, mm = f"model.layers.{i}.", self.linear.prepare
        qkv = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        bias = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) \
            if self.cfg.qkv_bias else None
        norm = (lambda n: get(p + f"self_attn.{n}_norm.weight")) if self.cfg.qk_norm else (lambda n: None)
        return LayerWeights(
            input_norm=get(p + "input_layernorm.weight"), qkv=mm(qkv), qkv_bias=bias,
            q_norm=norm("q"), k_norm=norm("k"), o_proj=mm(get(p + "self_attn.o_proj.weight")),
            post_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=mm(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])),
            down=mm(get(p + "mlp.down_proj.weight")))

    def build_rope_tables(self, positions: int) -> None:
        """cos and signed sin of every position below `positions`, once: a step looks its rows
        up instead of computing them (eight launches a step on a GPU)."""
        self.cos_table, self.sin_table = self._rope(torch.arange(positions, device=self.device))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed_sin [T, D] (sin with its first half negated: kernels.layer_ops.apply_rope)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, :freqs.shape[-1]].neg_()
        return emb.cos().to(self.dtype), sin.to(self.dtype)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed_sin [T, 1, D] of the positions, from the tables where they were built."""
        if self.cos_table is None:
            cos, sin = self._rope(positions)
        else:
            cos, sin = self.cos_table[positions], self.sin_table[positions]
        return cos[:, None, :], sin[:, None, :]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                attn: AttentionBackend, plan: object, logit_rows: torch.Tensor,
                hook: LayerHook | None = None) -> torch.Tensor:
        """input_ids, positions [T]; kv [L, 2, P, S, Hkv, D]; returns the final-norm hidden
        states of `logit_rows` [len(logit_rows), hidden], the lm_head's input (`logits`, `greedy`)."""
        if self.decoder is not None and self.mlp is None:  # set by the runner, which builds the rope tables
            return self.decoder(input_ids, positions, self.cos_table, self.sin_table, kv, plan, logit_rows, hook)
        eps, ops = self.cfg.rms_norm_eps, self.ops
        residual = F.embedding(input_ids, self.embed)  # this forward's own tensor: added to in place
        cos, sin = (None, None) if self.fused_kv else self.rope_tables(positions)
        h, after = None, set(hook.after) if hook is not None else set()
        for i, w in enumerate(self.layers):
            x = ops.add_rms_norm(residual, h, w.input_norm, eps)
            h = self._attention(x, w, kv[i], positions, cos, sin, attn, plan)
            x = ops.add_rms_norm(residual, h, w.post_norm, eps)
            h = self.mlp(i, x) if self.mlp is not None else \
                self.linear(ops.silu_mul(self.linear(x, w.gate_up)), w.down)
            if i in after:
                hook.run(i)
        return ops.add_rms_norm(residual[logit_rows], h[logit_rows], self.norm, eps)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] (forward's output) -> logits [n, V] in the activations' dtype."""
        return self.linear(hidden, self.lm_head)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] (forward's output) -> fp32 logits [n, V]."""
        return self.head_logits(hidden).float()

    def greedy(self, hidden: torch.Tensor, banned: list[list[int]] | None = None) -> list[int] | None:
        """argmax of `logits(hidden)` per row, row i never one of banned[i], exactly, without all
        the logits (kernels.greedy_head); None where this model has no such head."""
        return self.greedy_head(hidden, banned) if self.greedy_head is not None else None

    def logits_at(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """`logits(hidden)[:, ids]` bit for bit, without the other logits (kernels.greedy_head);
        None where this model cannot (the penalised greedy rows' seen ids: backends.sampler)."""
        return self.greedy_head.logits_at(hidden, ids) if self.greedy_head is not None else None

    def _attention(self, x, w: LayerWeights, kv_layer, positions, cos, sin, attn, plan) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        if t == 0:
            return x  # an idle batch (DP attention): no attention, only the MLP's collectives
        qkv = self.linear(x, w.qkv, w.qkv_bias)
        if self.fused_kv:  # the Triton backend's plan carries the slots
            self.ops.rope_store(qkv, cfg.num_heads, cfg.num_kv_heads, positions, self.cos_table, self.sin_table,
                                kv_layer[0], kv_layer[1], plan.meta.slot_mapping)
            q = qkv[:, :self.q_size].view(t, cfg.num_heads, cfg.head_dim)
            o = attn.attend(q, kv_layer[0], kv_layer[1], plan, self.scale)
            return self.linear(o.reshape(t, self.q_size), w.o_proj)
        v = qkv[:, self.q_size + self.kv_size:].view(t, cfg.num_kv_heads, cfg.head_dim)
        if w.q_norm is None:  # q and k heads share the rotation: one rope over both
            qk = self.ops.rope(qkv[:, :self.q_size + self.kv_size].view(t, -1, cfg.head_dim), cos, sin)
            q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
        else:
            q = rms_norm(qkv[:, :self.q_size].view(t, cfg.num_heads, cfg.head_dim), w.q_norm, cfg.rms_norm_eps)
            k = rms_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(t, cfg.num_kv_heads, cfg.head_dim),
                         w.k_norm, cfg.rms_norm_eps)
            q, k = self.ops.rope(q, cos, sin), self.ops.rope(k, cos, sin)
        o = attn.forward(q, k, v, kv_layer[0], kv_layer[1], plan, self.scale)
        return self.linear(o.reshape(t, self.q_size), w.o_proj)


def load_weights(path: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    weights = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name)
    return weights


def load_model(path: str, device: torch.device, dtype: torch.dtype, weight_kind: str = "auto") -> LlamaModel:
    """weight_kind: auto (weights in dtype) or int8 (kernels.linear)."""
    cfg = ModelConfig.load(path)
    return LlamaModel(cfg, load_weights(path), device, dtype, weight_kind)
