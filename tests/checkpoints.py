"""Tiny random Hugging Face checkpoints of every supported architecture, made
with transformers from a fixed seed, with the default model's tokenizer (their
vocabularies are its first ids, so generated ids always decode)."""
from __future__ import annotations

import os
import shutil

import torch

from client.triton_server import DEFAULT_MODEL

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, initializer_range=0.3)


def configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    return {
        # Llama-3 rope scaling, explicit head_dim (not hidden / heads), tied embeddings
        "llama": lambda: LlamaConfig(**COMMON, head_dim=32, tie_word_embeddings=True, rope_theta=50000.0,
                                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "mistral": lambda: MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False),
        "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False),  # q/k/v bias
        "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),  # q/k norm
    }


def make_checkpoint(arch: str, out_dir: str, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    config = configs()[arch]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases and norm weights too, so those paths are tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        src = os.path.join(DEFAULT_MODEL, name)
        if os.path.exists(src):
            shutil.copy(src, out_dir)
    return out_dir
