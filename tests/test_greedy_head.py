"""kernels.greedy_head: the screened greedy head gives exactly argmax of the panel GEMM's fp32
logits (first index on ties), barred tokens excluded, on shapes that exercise the padding
(N not a multiple of 16 or 48, odd K) and the row tiles (1..33 rows), with the screen on
vdpbf16ps and on the AMX tiles (where the CPU has them)."""
import pytest
import torch

from backends.config import cpu_flags
from kernels.greedy_head import GreedyHead, pick_greedy_head
from kernels.linear import PanelLinear, pick_linear

CPU_FLAGS = cpu_flags()
HAS_BF16 = "avx512_bf16" in CPU_FLAGS
HAS_AMX = "amx_bf16" in CPU_FLAGS and "amx_tile" in CPU_FLAGS
pytestmark = pytest.mark.skipif(not HAS_BF16, reason="needs a CPU with AVX-512 BF16")


@pytest.fixture(scope="module")
def linear():
    lin = pick_linear(torch.device("cpu"), torch.float32)
    assert isinstance(lin, PanelLinear)  # an AVX-512 BF16 CPU has AVX-512: the panel GEMM
    return lin


@pytest.fixture(params=[False, pytest.param(True, marks=pytest.mark.skipif(not HAS_AMX, reason="no AMX"))],
                ids=["vdpbf16ps", "amx"])
def amx(request):
    return request.param


def make_head(linear, weight, amx=None):
    head = pick_greedy_head(linear, weight, linear.prepare(weight))
    assert isinstance(head, GreedyHead)  # this CPU can run it: the tests must not pass by skipping it
    return head if amx is None else GreedyHead(weight, head.packed, amx=amx)


def test_amx_is_the_default_where_the_cpu_has_it(linear):
    """The engine's head (pick_greedy_head) screens on the tiles on an AMX CPU: the path tested."""
    assert make_head(linear, torch.randn(64, 32)).amx == HAS_AMX


def reference(linear, head, x, banned=None):
    logits = linear(x, head.packed)
    for row, ids in enumerate(banned or []):
        logits[row, ids] = float("-inf")
    return logits.argmax(-1).tolist()


@pytest.mark.parametrize("n,k", [(1000, 150), (4099, 64), (48, 7), (1024, 40)])
def test_matches_fp32_argmax(linear, amx, n, k):
    g = torch.Generator().manual_seed(n + k)
    head = make_head(linear, torch.randn(n, k, generator=g), amx)
    rows = [1, 2, 7, 8, 9, 16, 17, 33]
    for m in rows:
        x = torch.randn(m, k, generator=g) * 2
        assert head(x) == reference(linear, head, x), m
    # Every row was screened: a row the screen missed would still get its token right, from
    # all n logits recomputed (1.2-2 candidates a row is typical here).
    assert head.candidates <= 4 * sum(rows)


def test_ties_and_near_ties_are_decided_in_fp32(linear, amx):
    """Rows equal to or within bf16's resolution of the winner: the screen cannot tell them
    apart, the fp32 recompute must, and an exact tie goes to the first index."""
    g = torch.Generator().manual_seed(1)
    n, k = 777, 96
    w = torch.randn(n, k, generator=g)
    x = torch.randn(4, k, generator=g)
    best = linear(x[:1], linear.prepare(w)).argmax().item()
    w[3] = w[best]                                                  # an exact tie, earlier index
    w[500:540] = w[best] + 1e-4 * torch.randn(40, k, generator=g)   # 40 near ties
    head = make_head(linear, w, amx)
    before = head.candidates
    got = head(x)
    assert got == reference(linear, head, x)
    assert got[0] in [3, *range(500, 540)]
    assert head.candidates - before > 40  # the near ties went through the fp32 recompute


def test_all_negative_logits_and_padding(linear, amx):
    """Padding outputs screen to 0: they must not set the bar when every real logit is < 0."""
    g = torch.Generator().manual_seed(2)
    w = -torch.rand(1001, 33, generator=g) - 0.1
    head = make_head(linear, w, amx)
    x = torch.rand(5, 33, generator=g) + 0.1
    assert max(linear(x, head.packed).max(-1).values.tolist()) < 0
    assert head(x) == reference(linear, head, x)


def test_barred_tokens_are_never_chosen(linear, amx):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(500, 40, generator=g)
    head = make_head(linear, w, amx)
    x = torch.randn(3, 40, generator=g)
    top = linear(x, head.packed).topk(3, dim=-1).indices.tolist()
    banned = [top[0][:1], top[1][:2], []]  # each barred row loses its best (and second) token
    got = head(x, banned)
    assert got == reference(linear, head, x, banned)
    assert got[0] == top[0][1] and got[1] == top[1][2] and got[2] == top[2][0]


def test_rows_it_cannot_answer_return_none(linear, amx):
    head = make_head(linear, torch.randn(100, 16), amx)
    assert head(torch.full((1, 16), float("nan"))) is None
    assert head(torch.randn(1, 16), [list(range(100))]) is None  # everything barred


def test_sampler_uses_it_only_where_no_logits_are_needed(linear, monkeypatch):
    """Greedy rows without logprobs take the head; sampled rows and logprob requests the logits;
    a mixed batch gives each row the token the full logits give."""
    from backends.request import Request, SamplingParams
    from backends.sampler import sample

    g = torch.Generator().manual_seed(4)
    w = torch.randn(300, 24, generator=g)

    class Model:
        greedy_head = make_head(linear, w)
        calls = []

        def logits(self, h):
            self.calls.append(("logits", h.shape[0]))
            return linear(h, self.greedy_head.packed)

        def greedy(self, h, banned=None):
            self.calls.append(("greedy", h.shape[0]))
            return self.greedy_head(h, banned)

    model, x = Model(), torch.randn(3, 24, generator=g)
    greedy = SamplingParams(max_tokens=8)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    reqs = [Request(f"r{i}", [1, 2], p, None, None) for i, p in enumerate([greedy, sampled, greedy])]
    full = linear(x, model.greedy_head.packed)
    tokens, logprobs = sample(model, x, reqs, [[], [], []], with_logprobs=False)
    assert model.calls == [("greedy", 2), ("logits", 1)] and logprobs is None
    assert tokens[0] == full[0].argmax().item() and tokens[2] == full[2].argmax().item()
    model.calls.clear()
    tokens2, logprobs = sample(model, x[:1], reqs[:1], [[]], with_logprobs=True)
    assert model.calls == [("logits", 1)] and len(logprobs) == 1 and tokens2 == tokens[:1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_head_matches_fp32_argmax_with_barred_tokens():
    """On a GPU: the argmax of the bf16 logits, barred ids never chosen, equals the sampler's
    argmax over their fp32 copy."""
    from kernels.greedy_head import DeviceGreedyHead
    from kernels.linear import TorchLinear

    g = torch.Generator(device="cuda").manual_seed(0)
    head = torch.randn(5000, 64, generator=g, device="cuda").to(torch.bfloat16)
    hidden = torch.randn(6, 64, generator=g, device="cuda").to(torch.bfloat16)
    logits = (hidden @ head.T).float()
    barred = [[], [int(logits[1].argmax())], [], [1, 2, 3], [], []]
    for row, ids in enumerate(barred):
        logits[row, ids] = float("-inf")
    assert DeviceGreedyHead(TorchLinear(), head)(hidden, barred) == logits.argmax(-1).tolist()


def test_ban_puts_minus_infinity_at_each_rows_ids_only():
    from kernels.greedy_head import ban
    logits = torch.randn(3, 10)
    want = logits.clone()
    want[0, [1, 4]] = float("-inf")
    want[2, [9]] = float("-inf")
    ban(logits, [[1, 4], [], [9]])
    assert torch.equal(logits, want)
    ban(logits, None)
    assert torch.equal(logits, want)
