"""The conventions users rely on, in-process: stop ids resolved as transformers resolves
them, the last bytes of a cut character, one bad request never failing its neighbours,
and no noise at exit."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from backends.model_config import ModelConfig
from backends.request import SamplingParams
from tests.engine_utils import collect, idle_pages, small_engine, token_ids
from client.triton_server import ROOT
from tests.test_model_parity import hf_model, prompts

GREEDY = SamplingParams(max_tokens=24)


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)


@pytest.fixture(scope="module")
def greedy_run(checkpoint):
    """The tiny llama's greedy ids for one prompt, with only config.json's eos (id 2)."""
    engine = small_engine(checkpoint("llama"))
    try:
        return token_ids(collect(engine, [prompts(1)[0]], SamplingParams(max_tokens=24, ignore_eos=True))[0])
    finally:
        engine.stop()


def test_stop_ids_come_from_generation_config_as_in_transformers(checkpoint, greedy_run, tmp_path):
    """generation_config.json lists a stop id that config.json does not: generation stops there,
    token for token as transformers' generate does."""
    path = shutil.copytree(checkpoint("llama"), tmp_path / "ckpt")
    stop = next(t for i, t in enumerate(greedy_run) if i >= 4 and t not in greedy_run[:i] and t != 2)
    write_json(path / "generation_config.json", {"bos_token_id": 1, "eos_token_id": [2, stop]})
    assert json.load(open(path / "config.json"))["eos_token_id"] == 2
    prompt = prompts(1)[0]
    expected = hf_model(str(path)).generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24,
                                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                            pad_token_id=0)[0, len(prompt):].tolist()
    assert expected[-1] == stop and len(expected) < 24
    engine = small_engine(str(path))
    try:
        [outs] = collect(engine, [prompt], GREEDY)
    finally:
        engine.stop()
    assert token_ids(outs) == expected and outs[-1].finish_reason == "stop"


def test_stop_id_resolution_order(checkpoint, tmp_path):
    """generation_config.json first, then config.json; a generation config without
    eos_token_id falls back to config.json (the tokenizer's eos comes last, in Engine)."""
    path = shutil.copytree(checkpoint("qwen2"), tmp_path / "ckpt")
    raw = json.load(open(path / "config.json"))
    write_json(path / "config.json", {**raw, "eos_token_id": [2, 7]})
    write_json(path / "generation_config.json", {"eos_token_id": [9, 2, 11]})
    assert ModelConfig.load(str(path)).eos_token_ids == (9, 2, 11)
    write_json(path / "generation_config.json", {"bos_token_id": 1})
    assert ModelConfig.load(str(path)).eos_token_ids == (2, 7)
    os.remove(path / "generation_config.json")
    assert ModelConfig.load(str(path)).eos_token_ids == (2, 7)


def test_last_bytes_are_flushed_as_decode_shows_them(default_model):
    """max_tokens ends inside a multi-byte character: the final text ends as
    tokenizer.decode(ids) does (U+FFFD), no earlier piece carries a broken character."""
    from transformers import AutoTokenizer

    from backends.detokenizer import IncrementalDetokenizer
    tok = AutoTokenizer.from_pretrained(default_model)
    out = tok("Rocket: 🚀 and 🙂").input_ids
    cut = next(n for n in range(1, len(out)) if tok.decode(out[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, tok("Say:").input_ids)
    pieces = []
    for t in out[:cut]:
        detok.add(t)
        pieces.append(detok.take(final=False))
    pieces.append(detok.take(final=True))
    assert "".join(pieces) == tok.decode(out[:cut], skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces[:-1]) and pieces[-1].endswith("\ufffd")


def test_prefill_half_of_a_hand_off_does_not_flush(default_model):
    """The prefill engine's last output is not the end of the text (decode streams the rest):
    a cut character there stays unsent."""
    from transformers import AutoTokenizer

    from backends.detokenizer import IncrementalDetokenizer
    tok = AutoTokenizer.from_pretrained(default_model)
    first = tok("🚀").input_ids[0]
    detok = IncrementalDetokenizer(tok, tok("Say:").input_ids)
    detok.add(first)
    assert detok.take(final=True, flush=False) == ""


def poisoned(params: SamplingParams, **fields) -> SamplingParams:
    """Params that slipped past validation (the door refuses them; the step must survive them)."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def test_one_poisoned_request_fails_alone(checkpoint, greedy_run):
    """A request whose sampling raises inside the step fails; every request batched with it
    gets exactly what it gets alone."""
    engine = small_engine(checkpoint("llama"))
    try:
        batch = prompts(5)
        alone = [token_ids(collect(engine, [p], GREEDY)[0]) for p in batch]
        seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=3)
        alone_seeded = token_ids(collect(engine, [batch[0]], seeded)[0])
        bad = poisoned(SamplingParams(max_tokens=24, temperature=0.5), temperature=float("nan"))
        results = collect(engine, batch + [batch[0], batch[1]], [GREEDY] * 5 + [seeded, bad])
        assert [token_ids(o) for o in results[:5]] == alone
        assert token_ids(results[5]) == alone_seeded
        assert results[6][-1].finish_reason == "error" and "sampling this request failed" in results[6][-1].error
        assert idle_pages(engine.stats()) == engine.stats()["kv_pages_total"]
    finally:
        engine.stop()


def test_a_request_failing_after_its_sample_fails_alone(checkpoint):
    """An exception in one request's detokenization or stop check ends that request only."""
    engine = small_engine(checkpoint("llama"))
    try:
        batch = prompts(3)
        alone = [token_ids(collect(engine, [p], GREEDY)[0]) for p in batch]
        outs = [[] for _ in batch]
        reqs = [engine.make_request(p, GREEDY, o.append) for p, o in zip(batch, outs)]

        def broken(token_id):
            raise UnicodeError("injected detokenizer failure")
        reqs[1].detok.add = broken
        for r in reqs:
            engine.scheduler.submit(r)
        end = time.monotonic() + 60
        while not all(o and o[-1].finished for o in outs) and time.monotonic() < end:
            time.sleep(0.05)
        assert token_ids(outs[0]) == alone[0] and token_ids(outs[2]) == alone[2]
        assert outs[1][-1].finish_reason == "error" and "injected" in outs[1][-1].error
        assert idle_pages(engine.stats()) == engine.stats()["kv_pages_total"]
    finally:
        engine.stop()


def test_no_nanobind_leak_report_at_exit(checkpoint):
    """A process that ran an engine exits quietly (torch imports triton, whose nanobind
    bindings list every object still alive at exit)."""
    code = ("from tests.engine_utils import small_engine, collect\n"
            "from backends.request import SamplingParams\n"
            f"e = small_engine({checkpoint('llama')!r})\n"
            "collect(e, [[5, 6, 7]], SamplingParams(max_tokens=3))\n"
            "e.stop()\nprint('done')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr[-2000:]
    assert "nanobind" not in proc.stderr, proc.stderr[:2000]


def _requests(*params):
    from backends.request import Request
    return [Request(f"r{i}", [1, 2], p, None, None) for i, p in enumerate(params)]


def test_sampled_rows_follow_softmax_with_top_k_and_top_p():
    """Gumbel-max draws, many rows at once, have the frequencies of the (truncated) softmax."""
    from backends.sampler import sample_logits
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    cases = {  # params -> the distribution the draws must follow
        SamplingParams(temperature=1.0): torch.softmax(logits, -1),
        SamplingParams(temperature=0.5): torch.softmax(logits / 0.5, -1),
        SamplingParams(temperature=1.0, top_k=2): torch.softmax(logits[:2], -1),
        SamplingParams(temperature=1.0, top_p=0.8): torch.softmax(logits[:3], -1),  # 0.57 + 0.21 < 0.8
    }
    n = 4000
    for params, want in cases.items():
        torch.manual_seed(0)
        tokens, _ = sample_logits(logits.repeat(n, 1), _requests(*[params] * n), [[]] * n, with_logprobs=False)
        freq = torch.bincount(torch.tensor(tokens), minlength=6)[:len(want)].float() / n
        assert sum(tokens.count(t) for t in range(len(want))) == n, params
        assert torch.allclose(freq, want, atol=0.03), (params, freq, want)


def test_a_seeded_row_draws_the_same_whatever_its_neighbours():
    """Each seeded row has its own generator on the logits' device (never a CPU generator fed
    a CUDA tensor), so its draws are the same alone and in any batch."""
    from backends.sampler import sample_logits
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))

    def draws(reqs, rows):
        out = []
        for _ in range(6):
            tokens, _ = sample_logits(logits[rows].clone(), reqs, [[]] * len(reqs), with_logprobs=False)
            out.append(tokens)
        return out
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [t[0] for t in draws(_requests(seeded), [2])]
    other = SamplingParams(temperature=0.7, top_k=20)
    reqs = _requests(other, seeded, SamplingParams(), other)
    batched = [t[1] for t in draws(reqs, [0, 2, 3, 4])]
    assert alone == batched and len(set(alone)) > 1
    assert reqs[1].generator.device == logits.device
