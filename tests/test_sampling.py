"""Sampling conformance, in-process: penalties, min_p, stop ids and logprobs, each against
its reference (transformers, or a loop written here), alone and in mixed batches, colocated
and through a prefill/decode hand-off."""
import collections

import pytest
import torch

from backends.request import Request, SamplingParams
from backends.sampler import LogitsRows, apply_penalties, argmax_rows, sample, sample_logits
from kernels.greedy_head import launch_argmax
from tests.engine_utils import assert_pool_whole, collect, small_engine, token_ids
from tests.test_model_parity import ARCHS, hf_model, prompts


def hf_generate(model, prompt: list[int], n: int, **kw) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def reference_penalised(model, prompt: list[int], n: int, presence: float, frequency: float,
                        eos: int = 2) -> list[int]:
    """Greedy with OpenAI's presence and frequency penalties over the output tokens, one full
    forward a token, the penalty applied id by id."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].clone()
        for token, count in collections.Counter(out).items():
            logits[token] -= frequency * count + presence
        out.append(int(logits.argmax()))
        if out[-1] == eos:
            break
    return out


# ---- against transformers and the reference loop ------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_repetition_penalty_equals_transformers(checkpoint, arch):
    path = checkpoint(arch)
    prompt = prompts(2)[1]
    model = hf_model(path)
    expected = hf_generate(model, prompt, 24, repetition_penalty=1.3)
    assert expected != hf_generate(model, prompt, 24), "the penalty must change this run for the test to mean anything"
    engine = small_engine(path)
    try:
        [outs] = collect(engine, [prompt], SamplingParams(max_tokens=24, repetition_penalty=1.3))
        assert token_ids(outs) == expected
        assert_pool_whole(engine)
    finally:
        engine.stop()


@pytest.mark.parametrize("presence, frequency", [(0.8, 0.0), (0.0, 0.6), (-0.5, 1.1)])
def test_greedy_presence_and_frequency_equal_the_reference_loop(checkpoint, presence, frequency):
    path = checkpoint("qwen2")
    prompt = prompts(3)[1]
    model = hf_model(path)
    expected = reference_penalised(model, prompt, 20, presence, frequency)
    assert expected != reference_penalised(model, prompt, 20, 0.0, 0.0)
    engine = small_engine(path)
    try:
        [outs] = collect(engine, [prompt], SamplingParams(max_tokens=20, presence_penalty=presence,
                                                          frequency_penalty=frequency))
    finally:
        engine.stop()
    assert token_ids(outs) == expected


MIXED = [SamplingParams(max_tokens=16, repetition_penalty=1.3),
         SamplingParams(max_tokens=16),
         SamplingParams(max_tokens=16, presence_penalty=0.7, frequency_penalty=0.4),
         SamplingParams(max_tokens=16, temperature=0.9, seed=11, repetition_penalty=1.2, min_p=0.05, logprobs=2),
         SamplingParams(max_tokens=16, temperature=0.9, seed=12),
         SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=13, frequency_penalty=1.0)]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_mixed_batch_gives_each_row_what_it_gets_alone(checkpoint, overlap):
    """Penalised, plain, greedy and sampled rows in one batch (and with overlap, a row's
    penalties read the token of the step still in flight) equal each row run alone."""
    engine = small_engine(checkpoint("llama"), overlap=overlap)
    try:
        batch = prompts(6)
        together = [token_ids(o) for o in collect(engine, batch, MIXED)]
        alone = [token_ids(collect(engine, [ids], [p])[0]) for ids, p in zip(batch, MIXED)]
        plain = [token_ids(collect(engine, [ids], [SamplingParams(max_tokens=16, temperature=p.temperature,
                                                                 top_k=p.top_k, seed=p.seed)])[0])
                 for ids, p in zip(batch, MIXED)]
        assert_pool_whole(engine)
    finally:
        engine.stop()
    assert together == alone
    # rows 2 and 3 repeat ids without their penalties (the others never meet an id they penalise)
    assert alone[2] != plain[2] and alone[3] != plain[3]


def test_logprobs_are_log_softmax_of_transformers_logits(checkpoint, default_model):
    """Raw logprobs (before penalties and temperature, vLLM's default) within 1e-4 of
    transformers' log-softmax at every position: the sampled token's, its rank, the top 5
    and their decoded text."""
    from transformers import AutoTokenizer
    path = checkpoint("qwen3")
    prompt = prompts(2)[1]
    engine = small_engine(path)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, repetition_penalty=1.2, logprobs=5)
        [outs] = collect(engine, [prompt], params)
        [plain] = collect(engine, [prompt], SamplingParams(max_tokens=4))
    finally:
        engine.stop()
    assert all(o.logprobs is None for o in plain)
    ids = token_ids(outs)
    entries = [e for o in outs for e in o.logprobs]
    assert len(entries) == len(ids) == 12
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    tok = AutoTokenizer.from_pretrained(path)
    for row, token, entry in zip(ref, ids, entries):
        lp, rank, text = entry[token]
        assert abs(lp - row[token].item()) < 1e-4
        assert (row > row[token] + 1e-4).sum() < rank <= (row >= row[token] - 1e-4).sum()
        assert list(entry)[0] == token   # the sampled token first, as vLLM orders them
        top5 = row.topk(5).indices.tolist()
        assert set(entry) == set(top5) | {token}
        assert sorted((v[1], t) for t, v in entry.items() if t in top5) == list(enumerate(top5, 1))
        assert all(abs(v[0] - row[t].item()) < 1e-4 and v[2] == tok.decode([t]) for t, v in entry.items())


def test_logprobs_through_a_hand_off_equal_colocated(checkpoint):
    """The first token's logprob, rank and top N travel with the KV: decode's stream carries
    the same logprobs as a colocated engine, penalties applied on decode from the prompt and
    the first token it was handed."""
    from backends.disagg.local import Pair
    path = checkpoint("llama")
    batch = prompts(3)
    params = SamplingParams(max_tokens=10, logprobs=3, repetition_penalty=1.4, frequency_penalty=0.3)
    engine = small_engine(path)
    try:
        want = collect(engine, batch, params)
    finally:
        engine.stop()
    pair = Pair(path, pipeline_min_tokens=8, transfer_timeout_s=5)
    try:
        got = pair.run(batch, params)
        assert pair.kv_whole()
    finally:
        pair.close()
    for (dec, pre), ref in zip(got, want):
        assert token_ids(dec) == token_ids(ref)
        for d, r in zip([e for o in dec for e in o.logprobs], [e for o in ref for e in o.logprobs]):
            assert list(d) == list(r) and all(abs(d[t][0] - r[t][0]) < 1e-4 and d[t][1:] == r[t][1:] for t in d)
        assert [e for o in pre for e in o.logprobs][0].keys() == [e for o in ref for e in o.logprobs][0].keys()


# ---- stop ids ---------------------------------------------------------------------------
def test_stop_token_ids(checkpoint, default_model):
    """A stop id ends the request where it is sampled (finish_reason stop; its id sent, its
    text only with include_stop_str_in_output), ignore_eos keeps it, and min_tokens holds it
    back as it holds EOS."""
    from transformers import AutoTokenizer
    path = checkpoint("mistral")
    tok = AutoTokenizer.from_pretrained(path)
    prompt = prompts(2)[1]
    engine = small_engine(path)
    try:
        [free] = collect(engine, [prompt], SamplingParams(max_tokens=24, ignore_eos=True))
        ids = token_ids(free)
        at = next(i for i, t in enumerate(ids) if i >= 3 and t not in ids[:i] and tok.decode([t]).strip())
        runs = collect(engine, [prompt] * 4, [
            SamplingParams(max_tokens=24, stop_token_ids=(ids[at],)),
            SamplingParams(max_tokens=24, stop_token_ids=(ids[at],), include_stop_str_in_output=True),
            SamplingParams(max_tokens=24, stop_token_ids=(ids[at],), ignore_eos=True),
            SamplingParams(max_tokens=24, stop_token_ids=(ids[at],), min_tokens=at + 1, ignore_eos=True)])
        assert_pool_whole(engine)
    finally:
        engine.stop()
    text = lambda outs: "".join(o.text for o in outs)
    for outs in runs[:3]:
        assert token_ids(outs) == ids[:at + 1] and outs[-1].finish_reason == "stop"
    assert text(runs[0]) == tok.decode(ids[:at], skip_special_tokens=True)
    assert text(runs[1]) == tok.decode(ids[:at + 1], skip_special_tokens=True)
    held = token_ids(runs[3])
    assert len(held) > at + 1 and ids[at] not in held[:at + 1]


def test_skip_special_tokens_and_stop_strings_kept(default_model):
    from transformers import AutoTokenizer

    from backends.detokenizer import IncrementalDetokenizer
    tok = AutoTokenizer.from_pretrained(default_model)
    ids = tok("Hello world, bye now").input_ids
    special = tok.convert_tokens_to_ids("<|im_start|>")
    out = ids[:2] + [special] + ids[2:]
    for skip in (True, False):
        d = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens=skip)
        for t in out:
            d.add(t)
        assert d.take(final=True) == tok.decode(out, skip_special_tokens=skip)
        assert ("<|im_start|>" in tok.decode(out, skip_special_tokens=skip)) != skip
    for include, want in ((False, "Hello world"), (True, "Hello world, bye")):
        d = IncrementalDetokenizer(tok, [1], stop=(", bye",), include_stop=include)
        for t in ids:
            d.add(t)
            if d.stopped:
                break
        assert d.stopped and d.take(final=True) == want


# ---- the sampler's pieces -----------------------------------------------------------------
def _request(prompt, output, **kw) -> Request:
    req = Request("r", prompt, SamplingParams(max_tokens=32, **kw), None, None)
    req.output_ids = list(output)
    return req


def test_penalties_equal_a_loop_over_ids_with_padding_and_repeats():
    """Rows of different lengths (one with no output yet), repeated ids, negative and banned
    logits: the vectorised penalties equal transformers' and vLLM's definitions id by id,
    and rows that are not passed are untouched."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 40, generator=g) * 3
    logits[1, 5] = float("-inf")
    reqs = [_request([1, 2, 2, 7], [3, 3, 3, 9, 1], repetition_penalty=1.5, frequency_penalty=0.5,
                     presence_penalty=0.25),
            _request([5, 6], [], repetition_penalty=0.7, presence_penalty=1.0, frequency_penalty=-0.3),
            _request([8], [8, 8, 30], frequency_penalty=2.0)]
    want = logits.clone()
    for row, req in enumerate(reqs):
        p = req.params
        for t in set(req.prompt_ids + req.output_ids):
            v = want[row, t]
            want[row, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t, n in collections.Counter(req.output_ids).items():
            want[row, t] -= p.frequency_penalty * n + p.presence_penalty
    got = logits.clone()
    apply_penalties(got, [0, 1, 2], reqs)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[torch.isfinite(got)], want[torch.isfinite(want)], atol=1e-6)
    assert torch.equal(got[3], logits[3])


def test_the_history_counts_every_sampled_token():
    """Penalties read what the sampler itself sampled, so a token still in flight (overlap)
    is counted before the scheduler appends it."""
    req = _request([4, 5], [], frequency_penalty=1.0)
    logits = torch.zeros(1, 10)
    logits[0, 7] = 2.5
    picks = [sample_logits(logits.clone(), [req], [[]], with_logprobs=False)[0][0] for _ in range(4)]
    assert picks == [7, 7, 7, 0]   # 2.5 - 1 - 1 - 1 < 0: the third 7 made it fall behind id 0
    assert req.output_ids == [] and req.history.outputs.tolist() == [7, 7, 7, 0]


def test_min_p_keeps_only_ids_near_the_most_likely():
    logits = torch.log(torch.tensor([[0.40, 0.25, 0.19, 0.10, 0.06]]))
    allowed = {0, 1}   # p >= 0.5 * 0.40
    seen = set()
    for seed in range(200):
        req = _request([1], [], temperature=1.0, min_p=0.5, seed=seed)
        token = sample_logits(logits.clone(), [req], [[]], with_logprobs=False)[0][0]
        seen.add(token)
    assert seen == allowed
    greedy = _request([1], [], min_p=0.9)
    assert sample_logits(logits.clone(), [greedy], [[]], with_logprobs=False)[0] == [0]



def test_argmax_rows_is_torchs_argmax():
    """The CPU's numpy argmax picks what torch's does: the first of tied ids, a NaN over any
    number, the first of several NaNs or infinities, row 0 of an all -inf row; strided rows too."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(300):
        x = torch.randint(-3, 3, (5, 40), generator=gen).float()
        x[1, [7, 20]] = float("nan")
        x[2, [3, 9]] = float("inf")
        x[3] = float("-inf")
        for rows in (x, x[:, ::2], x.T.contiguous().T):
            assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))


def test_a_graphs_argmax_is_taken_only_where_no_id_is_barred():
    """A decode graph's argmax (kernels.greedy_head.launch_argmax) stands for its logits' own only
    while no row bars an id; a barred row's logits are barred and argmaxed again."""
    logits = torch.tensor([[1.0, 5.0, 3.0], [4.0, 2.0, 4.0]])
    given = torch.tensor([1, 0])
    assert launch_argmax(logits.clone(), [[], []], given).device is given
    assert launch_argmax(logits.clone(), [[1], []], given).wait() == [2, 0]
    assert launch_argmax(logits.clone(), [[], [0]], given).wait() == [1, 2]
    assert launch_argmax(logits.clone()).wait() == [1, 0]


def test_sampling_a_graphs_logits_equals_sampling_the_heads():
    """LogitsRows (a step whose graph ran the lm_head) gives what the model's head gives: greedy,
    barred, penalised, seeded and with logprobs, in one step, then greedy rows alone."""
    model = CountingModel()
    hidden = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    params = [{}, dict(repetition_penalty=1.5), dict(temperature=0.7, seed=3), dict(logprobs=2)]
    banned = [[int((hidden[0] @ model.w.T).argmax())], [], [], []]
    for with_logprobs in (False, True):
        requests = lambda: [_request([1, 2, 3], [4], **p) for p in params]
        logits = model.logits(hidden)
        got = sample(LogitsRows(logits, logits.argmax(-1)), logits, requests(), banned, with_logprobs)
        assert got == sample(model, hidden, requests(), banned, with_logprobs)
    greedy = lambda: [_request([1], []), _request([2], [])]
    for barred in (banned[:2], [[], []]):  # the graph's argmax stands only where nothing is barred
        logits = model.logits(hidden[:2])  # barred in place: a step's scratch
        assert sample(LogitsRows(logits, logits.argmax(-1)), logits, greedy(), barred, False) == \
            sample(model, hidden[:2], greedy(), barred, False)
    marker = torch.tensor([7, 9])
    assert sample(LogitsRows(logits, marker), logits, greedy(), [[], []], False)[0] == [7, 9]


class CountingModel:
    """The greedy head and the full logits of a random lm_head, calls counted; logits at a few
    ids only where `exact` (else None, as on a GPU)."""

    def __init__(self, exact: bool = False, weight: torch.Tensor | None = None):
        self.w = torch.randn(30, 8, generator=torch.Generator().manual_seed(1)) if weight is None else weight
        self.exact, self.calls = exact, []

    def _head(self, hidden):
        # Row by row: torch's CPU matmul may round a row differently with another row count (its
        # kernel is picked by the shape; seen on an AMD Zen 4), and the sampler's callers pass
        # different row subsets of one step.
        return torch.cat([row[None] @ self.w.T for row in hidden]) if len(hidden) else hidden @ self.w.T

    def logits(self, hidden):
        self.calls.append(("logits", len(hidden)))
        return self._head(hidden)

    def greedy(self, hidden, banned):
        self.calls.append(("greedy", len(hidden)))
        logits = self._head(hidden)
        for row, ids in enumerate(banned):
            logits[row, torch.as_tensor(ids, dtype=torch.int64)] = float("-inf")
        return logits.argmax(-1).tolist()

    def logits_at(self, hidden, ids):
        self.calls.append(("logits_at", len(hidden)))
        return self._head(hidden)[:, ids] if self.exact else None


def test_rows_without_penalties_cost_nothing(monkeypatch):
    """Plain greedy rows keep the greedy head while a neighbour is penalised; a batch with
    no penalised row never enters the penalty code; a penalised greedy row takes the full
    logits only where the model gives no logits at a few ids."""
    import backends.sampler as sampler
    entered = []
    real = sampler.apply_penalties
    monkeypatch.setattr(sampler, "apply_penalties", lambda *a: (entered.append(a[1]), real(*a)))
    model, x = CountingModel(), torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    plain = [_request([1], []) for _ in range(3)]
    sample(model, x, plain, [[], [], []], with_logprobs=False)
    assert model.calls == [("greedy", 3)] and entered == []
    model.calls.clear()
    mixed = lambda: [_request([1], []), _request([1, 2], [], repetition_penalty=1.5), _request([1], [])]
    tokens, _ = sample(model, x, mixed(), [[], [], []], with_logprobs=False)
    assert model.calls == [("logits_at", 1), ("greedy", 2), ("logits", 1)] and entered == [[0]]
    assert [tokens[0], tokens[2]] == (x @ model.w.T).argmax(-1)[[0, 2]].tolist()
    exact = CountingModel(exact=True)
    assert sample(exact, x, mixed(), [[], [], []], with_logprobs=False)[0] == tokens
    assert exact.calls == [("logits_at", 1), ("greedy", 3), ("logits_at", 1)]


PENALTIES = [dict(repetition_penalty=2.0), dict(repetition_penalty=0.5), dict(presence_penalty=-1.0),
             dict(frequency_penalty=1.0), dict(presence_penalty=1.0, frequency_penalty=-0.5),
             dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5),
             dict(repetition_penalty=0.75, presence_penalty=-0.5, frequency_penalty=0.25)]


def _both_paths(model, hidden_of, prompts_, banned_of, steps: int) -> tuple[list[list[int]], int, int]:
    """Each PENALTIES row (several of each kind) `steps` tokens twice, through `sample` and
    through the full logits (sample_logits: banned, penalties, argmax), each path its own
    requests and histories; hidden_of and banned_of(step, seen ids of each row) give the rows
    and their banned ids. Asserts
    equal tokens every step, and that `sample` never took the full logits; returns the tokens,
    and how many were seen ids and unseen ids (both must occur for the run to mean anything)."""
    logits, full_rows = model.logits, []
    model.logits = lambda hidden: (full_rows.append(len(hidden)), logits(hidden))[1]  # the reference's alone
    params = [PENALTIES[row % len(PENALTIES)] for row in range(len(prompts_))]
    fast = [_request(p, [], **kw) for p, kw in zip(prompts_, params)]
    full = [_request(p, [], **kw) for p, kw in zip(prompts_, params)]
    out, seen_hits, unseen_hits = [[] for _ in prompts_], 0, 0
    for step in range(steps):
        seen = [p + o for p, o in zip(prompts_, out)]
        hidden, banned = hidden_of(step, seen), banned_of(step, seen)
        want = sample_logits(model.logits(hidden), full, banned, with_logprobs=False)[0]
        got = sample(model, hidden, fast, banned, with_logprobs=False)[0]
        assert got == want, f"step {step}"
        for row, token in enumerate(got):
            seen_hits += token in prompts_[row] + out[row]
            unseen_hits += token not in prompts_[row] + out[row]
            out[row].append(token)
    assert [r.history.outputs.tolist() for r in fast] == out == [r.history.outputs.tolist() for r in full]
    assert full_rows == [len(prompts_)] * steps
    return out, seen_hits, unseen_hits


def test_penalised_greedy_rows_equal_the_full_logits_with_ties():
    """Integer weights and rows, so penalised logits tie with others (repetition 2 halves 4 into
    2, a frequency of 1 takes 3 to 2): the head's path picks the first index as argmax does,
    banned ids stay banned, and every step equals the full logits'."""
    g = torch.Generator().manual_seed(5)
    model = CountingModel(exact=True, weight=torch.randint(-3, 4, (40, 6), generator=g).float())
    prompts_ = [torch.randint(0, 40, (n,), generator=g).tolist() for n in (1, 3, 6, 2, 9, 4, 5, 1, 7, 2, 3, 8, 6, 4)]
    hidden_of = lambda step, seen: torch.randint(-2, 3, (len(prompts_), 6), generator=g).float()
    banned_of = lambda step, seen: [[step % 40, 7] if row % 3 == 0 else [] for row in range(len(prompts_))]
    _, seen_hits, unseen_hits = _both_paths(model, hidden_of, prompts_, banned_of, 40)
    assert seen_hits > 50 and unseen_hits > 50


@pytest.mark.parametrize("arch", ["llama", "qwen2", "default"])
def test_penalised_greedy_rows_through_the_head_equal_the_full_logits(checkpoint, default_model, arch):
    """The real greedy head (tied embeddings: llama, the default model; an lm_head of its own:
    qwen2) on rows made to favour the ids each row has seen (their embeddings summed, plus
    noise), so its penalties decide between seen and unseen ids: 64 steps of 14 rows, every
    kind of penalty, with banned ids, equal the full logits' tokens each step."""
    from backends.config import EngineConfig
    from backends.engine import Engine

    path = default_model if arch == "default" else checkpoint(arch)
    model = Engine(EngineConfig(model_path=path)).runner.model
    if model.greedy_head is None:
        pytest.skip("no greedy head on this CPU (the panel GEMM and AVX-512 BF16)")
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(7)
    x, ids = torch.randn(19, model.cfg.hidden_size, generator=g), torch.randint(0, vocab, (300,), generator=g)
    assert torch.equal(model.logits_at(x, ids), model.logits(x)[:, ids])  # bit for bit, 2 blocks of rows
    prompts_ = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 40, 9, 1, 25, 12, 60, 5, 17, 30,
                                                                                 2, 8, 50, 11)]
    embed = model.embed

    def hidden_of(step, seen):
        rows = torch.stack([embed[torch.tensor(ids[-8:])].sum(0) for ids in seen])
        return rows + torch.randn(rows.shape, generator=g) * rows.norm(dim=-1, keepdim=True) / rows.shape[1] ** 0.5
    # a random id, and two the row has seen last (the rows favour them): banned, they must stay so
    banned_of = lambda step, seen: [[int(torch.randint(0, vocab, (1,), generator=g)), *ids[-2:]] if row % 4 == 1
                                    else [] for row, ids in enumerate(seen)]
    _, seen_hits, unseen_hits = _both_paths(model, hidden_of, prompts_, banned_of, 64)
    assert seen_hits > 20 and unseen_hits > 20
