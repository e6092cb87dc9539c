"""Tandem's model against transformers on tiny random checkpoints of every
supported architecture: logits within 1e-4, greedy ids identical."""
import pytest
import torch

from backends.model import load_model
from backends.model_config import ModelConfig, UnsupportedModelError
from backends.request import SamplingParams
from kernels import AttentionMetadata
from kernels.torch_ref import TorchAttention
from tests.engine_utils import assert_pool_whole, collect, small_engine, token_ids

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
NEW_TOKENS = 32


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 37, 23, 50, 3, 17][:n]  # several are longer than the 16-token chunk
    return [torch.randint(3, 500, (length,), generator=g).tolist() for length in lengths]


def tandem_logits(model, ids: list[int], chunk: int, page_size: int = 4) -> torch.Tensor:
    """Logits of every position, computed chunk by chunk over the paged cache."""
    attn = TorchAttention()
    cfg = model.cfg
    kv = torch.zeros(cfg.num_layers, 2, 64, page_size, cfg.num_kv_heads, cfg.head_dim)
    pages = list(range(63, 63 - (len(ids) + page_size - 1) // page_size, -1))  # non-contiguous order
    out = []
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        meta = AttentionMetadata.build([end - start], [end], [pages], page_size)
        out.append(model.logits(model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), kv, attn,
                                              attn.plan(meta), torch.arange(end - start))))
    return torch.cat(out)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [64, 7])
def test_logits_match_transformers(checkpoint, arch, chunk):
    path = checkpoint(arch)
    ids = prompts(4)[3]
    expected = hf_model(path)(torch.tensor([ids])).logits[0]
    got = tandem_logits(load_model(path, torch.device("cpu"), torch.float32), ids, chunk)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_greedy_ids_match_transformers(checkpoint, arch, overlap):
    """Single and batched (all prompts at once, chunked prefill beside decodes), overlap off and on."""
    path = checkpoint(arch)
    hf = hf_model(path)
    batch = prompts(6)
    expected = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS,
                            min_new_tokens=NEW_TOKENS)[0, len(p):].tolist() for p in batch]
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    engine = small_engine(path, overlap=overlap)
    try:
        single = token_ids(collect(engine, [batch[1]], params)[0])
        batched = [token_ids(outs) for outs in collect(engine, batch, params)]
        assert_pool_whole(engine)
    finally:
        engine.stop()
    assert single == expected[1]
    assert batched == expected


def test_unsupported_architecture_is_refused():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]})


def test_reads_transformers5_rope_parameters():
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope["rope_type"] == "llama3" and cfg.rope["rope_theta"] == 500000.0
    old = ModelConfig.from_dict({**{k: v for k, v in raw.items() if k != "rope_parameters"},
                                 "rope_theta": 500000.0, "rope_scaling": {
                                     "type": "llama3", **{k: v for k, v in raw["rope_parameters"].items()
                                                          if k not in ("rope_type", "rope_theta")}}})
    assert old.rope == cfg.rope
