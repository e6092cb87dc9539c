"""The engine loop on a tiny checkpoint: preemption, aborts, failures and
sampling options; the KV pool is whole after every scenario. Every scenario on the
`engine` fixture runs with overlap off and on."""
import threading

import pytest
import torch

from backends.config import EngineConfig
from backends.engine import Engine, InvalidRequest
from backends.request import SamplingParams
from tests.engine_utils import assert_pool_whole, collect, small_engine, token_ids
from tests.test_model_parity import prompts

GREEDY = SamplingParams(max_tokens=24, min_tokens=24)


@pytest.fixture(scope="module", params=["off", "on"], ids=["overlap-off", "overlap-on"])
def engine(checkpoint, request):
    eng = small_engine(checkpoint("llama"), overlap=request.param)
    yield eng
    eng.stop()


def test_preemption_keeps_outputs_exact(checkpoint, engine):
    batch = prompts(6)
    expected = [token_ids(o) for o in collect(engine, batch, GREEDY)]
    tight = small_engine(checkpoint("llama"), num_pages=30,  # 120 token slots for ~300 tokens of work
                         overlap=engine.cfg.overlap)
    try:
        got = [token_ids(o) for o in collect(tight, batch, GREEDY)]
        assert tight.stats()["preemptions"] > 0
        assert_pool_whole(tight)
    finally:
        tight.stop()
    assert got == expected


def test_auto_cpu_budget_puts_128_prompt_tokens_beside_the_decodes(checkpoint):
    """A prompt of 128 tokens or fewer is one step whatever the number of decodes."""
    eng = Engine(EngineConfig(model_path=checkpoint("llama"), page_size=4, num_pages=256, threads=2))
    try:  # not started: the test turns the loop itself
        for ids in prompts(3):
            eng.generate(ids, GREEDY, lambda out: None)
        assert eng.scheduler.step()  # their prefills (65 tokens)
        assert [r.num_pending for r in eng.scheduler.running] == [1, 1, 1]
        eng.generate(list(range(3, 203)), GREEDY, lambda out: None)
        eng.scheduler._take_inbox()
        assert sorted(n for _, n in eng.scheduler.schedule().items) == [1, 1, 1, 128]
    finally:
        eng.stop()


def test_abort_mid_decode_frees_kv(engine):
    started = threading.Event()
    outs = []

    def sink(o):
        outs.append(o)
        started.set()
    rid = engine.generate(prompts(2)[1], SamplingParams(max_tokens=400, min_tokens=400), sink)
    assert started.wait(30)
    engine.abort(rid)
    for _ in range(100):
        if outs[-1].finished:
            break
        threading.Event().wait(0.05)
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(token_ids(outs)) < 400
    assert_pool_whole(engine)


def test_failed_step_ends_its_requests_and_engine_goes_on(engine, monkeypatch):
    real_run = engine.runner.forward
    calls = {"n": 0}

    def flaky(inputs, hook=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real_run(inputs, hook)
    monkeypatch.setattr(engine.runner, "forward", flaky)
    [outs] = collect(engine, [prompts(1)[0]], GREEDY)
    assert outs[-1].finish_reason == "error" and "injected failure" in outs[-1].error
    assert_pool_whole(engine)
    [again] = collect(engine, [prompts(1)[0]], GREEDY)
    assert again[-1].finish_reason == "length" and len(token_ids(again)) == 24


def test_finish_reasons_end_id_and_min_tokens(engine):
    p = prompts(1)[0]
    greedy = token_ids(collect(engine, [p], GREEDY)[0])
    end = greedy[5]
    first = greedy.index(end)
    [outs] = collect(engine, [p], SamplingParams(max_tokens=24, end_id=end))
    assert outs[-1].finish_reason == "stop" and token_ids(outs) == greedy[:first + 1]
    [outs] = collect(engine, [p], SamplingParams(max_tokens=24, end_id=end, min_tokens=first + 2))
    assert len(token_ids(outs)) > first + 1
    [outs] = collect(engine, [p], SamplingParams(max_tokens=3))
    assert outs[-1].finish_reason == "length" and len(token_ids(outs)) == 3
    assert outs[-1].num_output_tokens == 3 and outs[-1].num_prompt_tokens == len(p)


def test_stop_string_ends_the_request(engine):
    p = prompts(1)[0]
    full = collect(engine, [p], GREEDY)[0]
    text = "".join(o.text for o in full)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    [outs] = collect(engine, [p], SamplingParams(max_tokens=24, stop=(stop,)))
    got = "".join(o.text for o in outs)
    assert outs[-1].finish_reason == "stop" and got == text[:text.index(stop)]


def test_sampling_seed_top_k_top_p(engine):
    p = prompts(1)[0]
    sampled = lambda **kw: token_ids(collect(engine, [p], SamplingParams(max_tokens=16, temperature=1.0, **kw))[0])
    assert sampled(seed=7) == sampled(seed=7)
    assert sampled(seed=7) != sampled(seed=8)
    greedy = token_ids(collect(engine, [p], SamplingParams(max_tokens=16))[0])
    assert sampled(seed=3, top_k=1) == greedy
    assert sampled(seed=3, top_p=1e-6) == greedy  # the nucleus is the top token alone


def test_logprobs_only_where_a_hand_off_carries_them():
    from backends.disagg.decode import DecodeRole
    from backends.disagg.prefill import PrefillRole
    from backends.request import Request
    from backends.sampler import sample_logits
    from backends.role import ColocatedRole

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(max_tokens=4), None, None) for i in range(3)]
    tokens, logprobs = sample_logits(logits.clone(), reqs, [[], [], []], with_logprobs=True)
    assert tokens == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([lp.logprob for lp in logprobs]), want, atol=1e-5)
    assert sample_logits(logits.clone(), reqs, [[], [], []], with_logprobs=False) == (tokens, None)
    assert PrefillRole.carries_logprobs and not ColocatedRole.carries_logprobs
    assert not DecodeRole.carries_logprobs   # its first token's logprob arrives with the KV


def test_bad_prompts_are_refused(engine):
    with pytest.raises(InvalidRequest, match="empty"):
        engine.generate([], GREEDY, lambda o: None)
    with pytest.raises(InvalidRequest, match="context"):
        engine.generate([5] * engine.max_context, GREEDY, lambda o: None)
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.generate([5, engine.runner.model.cfg.vocab_size], GREEDY, lambda o: None)
    assert_pool_whole(engine)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_output_stops_at_the_context_limit(checkpoint, overlap):
    eng = small_engine(checkpoint("llama"), max_context=40, overlap=overlap)
    try:
        [outs] = collect(eng, [prompts(4)[3][:30]], SamplingParams(max_tokens=100, min_tokens=100))
        assert outs[-1].finish_reason == "length" and len(token_ids(outs)) == 10
        assert_pool_whole(eng)
    finally:
        eng.stop()
