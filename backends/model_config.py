"""What Tandem needs of a checkpoint's config.json, for the Llama family.

Reads the file as transformers 4 writes it (`rope_theta`, `rope_scaling`) and as
transformers 5 does (`rope_parameters`), and refuses any other architecture.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

# architecture name -> (q/k/v bias, per-head q/k RMSNorm)
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope: dict = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    # A block-diffusion LM (config.json's dllm_block_size and mask_token_id): 0 / None otherwise.
    dllm_block_size: int = 0
    mask_token_id: int | None = None

    @property
    def is_dllm(self) -> bool:
        return self.dllm_block_size > 0

    @staticmethod
    def load(path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        eos = generation_eos(path)
        if eos is not None:  # transformers' generate stops on generation_config.json's ids
            raw = {**raw, "eos_token_id": eos}
        return ModelConfig.from_dict(raw)

    @staticmethod
    def from_dict(raw: dict) -> "ModelConfig":
        arch = (raw.get("architectures") or ["<none>"])[0]
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}: Tandem serves {', '.join(ARCHITECTURES)}")
        qkv_bias, qk_norm = ARCHITECTURES[arch]
        heads = raw["num_attention_heads"]
        max_pos = raw.get("max_position_embeddings", 2048)
        if raw.get("sliding_window") and raw.get("use_sliding_window", arch == "MistralForCausalLM"):
            max_pos = min(max_pos, raw["sliding_window"])  # never attend past the window
        eos = raw.get("eos_token_id")
        block, mask = dllm_keys(raw)
        return ModelConfig(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position=max_pos,
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias", qkv_bias)),
            qk_norm=qk_norm,
            rope=rope_parameters(raw),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            dllm_block_size=block,
            mask_token_id=mask,
        )


def dllm_keys(raw: dict) -> tuple[int, int | None]:
    """(block size, mask id) of a block-diffusion checkpoint, (0, None) of an autoregressive one."""
    block, mask = raw.get("dllm_block_size"), raw.get("mask_token_id")
    if (block is None) != (mask is None):
        have, lack = ("dllm_block_size", "mask_token_id") if mask is None else ("mask_token_id", "dllm_block_size")
        raise UnsupportedModelError(f"config.json has {have} but not {lack}: a block-diffusion model needs both")
    if block is None:
        return 0, None
    if not isinstance(block, int) or block < 1 or not isinstance(mask, int) or not 0 <= mask < raw["vocab_size"]:
        raise UnsupportedModelError(f"dllm_block_size must be an integer >= 1 and mask_token_id an id of the "
                                    f"vocabulary, got {block!r} and {mask!r}")
    return block, mask


def generation_eos(path: str) -> int | list[int] | None:
    """`eos_token_id` of the checkpoint's generation_config.json, where it has one.

    Hugging Face `generate` takes its stop ids from there, and the file often lists more
    than config.json does (Llama-3-Instruct's <|eot_id|>, Qwen2.5-Instruct's <|endoftext|>)."""
    try:
        with open(os.path.join(path, "generation_config.json")) as f:
            return json.load(f).get("eos_token_id")
    except FileNotFoundError:
        return None


def rope_parameters(raw: dict) -> dict:
    """One dict with rope_type and rope_theta whichever transformers wrote the file."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    legacy = params.pop("type", None)
    params["rope_type"] = params.get("rope_type") or legacy or "default"
    return params


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with Llama-3 / linear scaling applied."""
    p, dim = cfg.rope, cfg.head_dim
    inv = 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = p["rope_type"]
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / p["factor"]
    if kind == "llama3":
        return _llama3_scale(inv, p)
    raise UnsupportedModelError(f"unsupported rope_type {kind!r} (supported: default, linear, llama3)")


def _llama3_scale(inv: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)
