"""Block-diffusion serving against the plain definition (issue 24), on tiny random
checkpoints whose config.json has dllm_block_size and mask_token_id.

The reference is transformers' model with a dense block-causal mask over the whole
sequence, one request at a time, no paging: each step takes the logits of every
position, reveals in the current block every masked position whose fp32 softmax
probability of its argmax (mask id excluded) reaches the threshold, else the single most
confident one; when no mask is left the next block starts. Output: every position after
the prompt, cut after max_tokens and at the first end-of-sequence id."""
import json
import os
import queue

import pytest
import torch

from backends.config import EngineConfig
from backends.engine import Engine, InvalidRequest
from backends.model_config import ModelConfig, UnsupportedModelError
from backends.request import SamplingParams
from tests.checkpoints import make_checkpoint
from tests.engine_utils import assert_pool_whole, collect, token_ids

MASK = 511            # the last id of the tiny vocabulary
SHARPEN = 6.0         # final-norm gain: peaked distributions, so outputs vary with the threshold


@pytest.fixture(scope="module")
def dllm_path(tmp_path_factory):
    return dllm_checkpoint(str(tmp_path_factory.mktemp("dllm")), block_size=4)


def dllm_checkpoint(out: str, block_size: int, arch: str = "llama") -> str:
    from safetensors.torch import load_file, save_file
    make_checkpoint(arch, out)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config.update(dllm_block_size=block_size, mask_token_id=MASK)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    weights = load_file(os.path.join(out, "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * SHARPEN
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def with_block_size(path: str, block_size: int, out: str) -> str:
    import shutil
    shutil.copytree(path, out, dirs_exist_ok=True)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["dllm_block_size"] = block_size
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


_HF: dict = {}


def reference(path: str, prompt: list[int], threshold: float, max_tokens: int, eos: set[int]) -> list[int]:
    from transformers import AutoModelForCausalLM
    if path not in _HF:
        _HF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    model = _HF[path]
    with open(os.path.join(path, "config.json")) as f:
        block = json.load(f)["dllm_block_size"]
    seq = list(prompt) + [MASK] * (block - len(prompt) % block)
    start = len(prompt) // block * block
    while True:
        n = len(seq)
        pos = torch.arange(n) // block
        mask = torch.zeros(n, n).masked_fill_(pos[None, :] > pos[:, None], float("-inf"))[None, None]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq]), attention_mask=mask).logits[0].float()
        masked = [p for p in range(start, start + block) if seq[p] == MASK]
        if masked:
            rows = logits[masked].clone()
            rows[:, MASK] = float("-inf")
            probs = rows.softmax(-1)
            conf, choice = probs.max(-1)
            pick = [i for i in range(len(masked)) if conf[i] >= threshold] or [int(conf.argmax())]
            for i in pick:
                seq[masked[i]] = int(choice[i])
            continue
        out = seq[len(prompt):]
        if len(out) >= max_tokens or eos & set(out):
            out = out[:max_tokens]
            return out[:min([out.index(e) for e in eos if e in out], default=len(out))]
        seq += [MASK] * block
        start += block


def dllm_engine(path: str, threshold: float = 0.95, **knobs) -> Engine:
    cfg = dict(model_path=path, page_size=4, num_pages=256, chunk_size=16, max_batch_tokens=64,
               max_running_requests=16, threads=2, dllm_threshold=threshold)
    cfg.update(knobs)
    return Engine(EngineConfig(**cfg)).start()


def prompts(lengths) -> list[list[int]]:
    return [[(11 * i + 7 * k) % 400 + 3 for i in range(n)] for k, n in enumerate(lengths)]


@pytest.mark.parametrize("block_size", [1, 4, 8])
@pytest.mark.parametrize("threshold", [0.2, 0.5, 0.95, 1.0])
def test_served_output_equals_the_definition(dllm_path, tmp_path, block_size, threshold):
    path = dllm_path if block_size == 4 else with_block_size(dllm_path, block_size, str(tmp_path / "ckpt"))
    batch = prompts([3, 4, 8, 13, 21, 33])  # on and off block boundaries for every block size
    eos = set(ModelConfig.load(path).eos_token_ids)
    expected = [reference(path, p, threshold, 12, eos) for p in batch]
    engine = dllm_engine(path, threshold)
    try:
        got = [token_ids(o) for o in collect(engine, batch, SamplingParams(max_tokens=12))]
        assert_pool_whole(engine)
    finally:
        engine.stop()
    assert got == expected


def test_outputs_depend_on_the_threshold_and_block_size(dllm_path, tmp_path):
    """The checkpoint is sharp enough that the settings above are distinct cases."""
    p = prompts([13])[0]
    by_threshold = {t: tuple(reference(dllm_path, p, t, 12, set())) for t in (0.2, 0.5, 0.95, 1.0)}
    assert len(set(by_threshold.values())) >= 2
    other = with_block_size(dllm_path, 8, str(tmp_path / "b8"))
    assert reference(other, p, 0.5, 12, set()) != list(by_threshold[0.5])


def phases(monkeypatch, engine) -> list[set[str]]:
    """Per launched step, the kinds of work in it: prefill (whole prompt blocks) or denoise."""
    seen, launch = [], engine.scheduler._launch

    def record(batch):
        seen.append({"denoise" if r.num_computed + n == r.num_tokens else "prefill" for r, n in batch.items})
        return launch(batch)
    monkeypatch.setattr(engine.scheduler, "_launch", record)
    return seen


@pytest.mark.parametrize("mixed", ["off", "on"])
def test_prefill_and_denoising_never_share_a_step(dllm_path, monkeypatch, mixed):
    """16 requests of mixed lengths at once, 4 running at a time: every one finishes with
    the definition's output, and no step mixes the two kinds of work (unless asked to)."""
    batch = prompts([3, 40, 9, 64, 17, 5, 33, 48, 12, 7, 56, 21, 4, 30, 60, 2])
    engine = dllm_engine(dllm_path, 0.5, max_running_requests=4, dllm_mixed_batches=mixed)
    try:
        seen = phases(monkeypatch, engine)
        got = [token_ids(o) for o in collect(engine, batch, SamplingParams(max_tokens=10))]
        assert_pool_whole(engine)
    finally:
        engine.stop()
    eos = set(ModelConfig.load(dllm_path).eos_token_ids)
    assert got == [reference(dllm_path, p, 0.5, 10, eos) for p in batch]
    if mixed == "off":
        assert {"prefill"} in seen and {"denoise"} in seen and all(len(kinds) == 1 for kinds in seen)
    else:
        assert any(len(kinds) == 2 for kinds in seen)


def test_preemption_keeps_outputs_exact(dllm_path):
    batch = prompts([30, 41, 25, 37])
    eos = set(ModelConfig.load(dllm_path).eos_token_ids)
    engine = dllm_engine(dllm_path, 0.5, num_pages=24)  # 96 slots for ~190 tokens of work
    try:
        got = [token_ids(o) for o in collect(engine, batch, SamplingParams(max_tokens=16))]
        assert engine.stats()["preemptions"] > 0
        assert_pool_whole(engine)
    finally:
        engine.stop()
    assert got == [reference(dllm_path, p, 0.5, 16, eos) for p in batch]


def test_cancel_mid_block_frees_the_pages(dllm_path):
    engine = dllm_engine(dllm_path, 1.0)  # one position a step: a block takes four steps
    try:
        outs: queue.Queue = queue.Queue()
        rid = engine.generate(prompts([10])[0], SamplingParams(max_tokens=400, ignore_eos=True), outs.put)
        first = outs.get(timeout=30)  # the first block is out: the next one is being denoised
        assert not first.finished and len(first.token_ids) > 0
        engine.abort(rid)
        rest = []
        while not (rest and rest[-1].finished):
            rest.append(outs.get(timeout=30))
        assert rest[-1].finish_reason == "abort"
        assert_pool_whole(engine)
    finally:
        engine.stop()


def test_one_response_per_block_and_text_as_the_tokenizer_decodes(dllm_path):
    from transformers import AutoTokenizer
    engine = dllm_engine(dllm_path, 0.5)
    try:
        [outs] = collect(engine, prompts([6]), SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        engine.stop()
    assert [len(o.token_ids) for o in outs if o.token_ids] == [2, 4, 4, 2]  # prompt 6 ends mid-block
    ids = token_ids(outs)
    assert "".join(o.text for o in outs) == AutoTokenizer.from_pretrained(dllm_path).decode(ids)


def test_what_a_dllm_cannot_do_is_refused(dllm_path, tmp_path):
    from backends.disagg.config import DisaggConfig
    engine = dllm_engine(dllm_path)
    try:
        with pytest.raises(InvalidRequest, match="greedy"):
            engine.generate([5, 6], SamplingParams(temperature=0.7), lambda out: None)
    finally:
        engine.stop()
    with pytest.raises(ValueError, match="overlap"):
        Engine(EngineConfig(model_path=dllm_path, overlap="on"))
    with pytest.raises(ValueError, match="disaggregated"):
        Engine(EngineConfig(model_path=dllm_path, role="prefill"), disagg=DisaggConfig())
    with pytest.raises(ValueError, match="dllm_threshold"):
        EngineConfig(model_path=dllm_path, dllm_threshold=0)
    with open(os.path.join(dllm_path, "config.json")) as f:
        config = json.load(f)
    del config["mask_token_id"]
    with pytest.raises(UnsupportedModelError, match="dllm_block_size but not mask_token_id"):
        ModelConfig.from_dict(config)


@pytest.mark.server
def test_llm_serves_a_dllm_checkpoint_through_tritonserver(dllm_path, tmp_path_factory):
    """The client sees nothing new: the same tensors, a stream of new text only (one piece
    per block), the ids and text of the definition."""
    from transformers import AutoTokenizer

    from client.stream import stream_generate
    from client.triton_server import TritonServer
    tok = AutoTokenizer.from_pretrained(dllm_path)
    eos = set(ModelConfig.load(dllm_path).eos_token_ids)
    server = TritonServer(str(tmp_path_factory.mktemp("repo_dllm")), models=["llm"],
                          parameters={"llm": {"model_path": dllm_path, "dllm_threshold": "0.5", "page_size": "4",
                                              "num_pages": "256", "max_context": "512"}})
    with server:
        for prompt in ("in the", "123 45 a b c d and the"):  # ids inside the tiny vocabulary
            ids = tok(prompt).input_ids
            want = reference(dllm_path, ids, 0.5, 12, eos)
            got = stream_generate(server.grpc_url, "llm", prompt, max_tokens=12)
            assert got.error is None and got.token_ids == want, prompt
            assert got.text == tok.decode(want, skip_special_tokens=True)
            assert len(got.pieces) >= len(want) // 4
        refused = stream_generate(server.grpc_url, "llm", "in the", max_tokens=4, temperature=0.7)
        assert refused.error is not None and "greedy" in refused.error
        outside = stream_generate(server.grpc_url, "llm", "Hi", max_tokens=4)  # id 26843 of a 512-id model
        assert outside.error is not None and "vocabulary" in outside.error
        assert server.wait_kv_full("llm")


def test_an_end_id_inside_a_block_and_a_stop_string_cut_the_output(dllm_path):
    """The block is denoised to its end, then the output stops before the end id (not
    shown) or the stop string, at token granularity."""
    from transformers import AutoTokenizer
    p = prompts([13])[0]
    full = reference(dllm_path, p, 0.5, 12, set())
    end = full[5]  # inside the second block
    cut = full[:full.index(end)]
    engine = dllm_engine(dllm_path, 0.5)
    try:
        [outs] = collect(engine, [p], SamplingParams(max_tokens=12, end_id=end))
        assert token_ids(outs) == cut and outs[-1].finish_reason == "stop"
        assert reference(dllm_path, p, 0.5, 12, {end}) == cut
        text = AutoTokenizer.from_pretrained(dllm_path).decode(full)
        stop = text[len(text) // 2:len(text) // 2 + 2]
        [outs] = collect(engine, [p], SamplingParams(max_tokens=12, stop=(stop,)))
        assert "".join(o.text for o in outs) == text[:text.index(stop)] and outs[-1].finish_reason == "stop"
        assert_pool_whole(engine)
    finally:
        engine.stop()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "mistral"])
def test_other_architectures_equal_the_definition(tmp_path, arch):
    """The block-diffusion path is the model code's: q/k norms (qwen3), q/k/v biases (qwen2)."""
    path = dllm_checkpoint(str(tmp_path / arch), block_size=4, arch=arch)
    batch = prompts([5, 12, 19])
    eos = set(ModelConfig.load(path).eos_token_ids)
    engine = dllm_engine(path, 0.5)
    try:
        got = [token_ids(o) for o in collect(engine, batch, SamplingParams(max_tokens=10))]
    finally:
        engine.stop()
    assert got == [reference(path, p, 0.5, 10, eos) for p in batch]
