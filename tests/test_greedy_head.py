"""kernels.greedy_head: each CPU greedy head gives exactly argmax of the full head's logits (first
index on ties), barred tokens excluded, on shapes that exercise the padding (N not a multiple of
16 or 48, odd K) and the row tiles (1..64 rows): GreedyHead (an fp32 head's bf16 screen, AVX-512
BF16) on vdpbf16ps and on the AMX tiles, and ScreenedHead (AVX2: an fp32 head's bf16 screen, a
bf16 head's int8 one), its exact logits read from the head's rows (tied) or its panels;
PairsScreenedHead (a bf16 head's int8 screen on AVX-512 BF16, its exact logits on vdpbf16ps); and
ArgmaxHead (an int8 head, or a bf16 one past a screen's rows: the full logits' argmax in one call)."""
import pytest
import torch

from backends.config import cpu_flags
from kernels.greedy_head import ArgmaxHead, GreedyHead, PairsScreenedHead, ScreenedHead, pick_greedy_head
from kernels.linear import Bf16PanelLinear, Int8PanelLinear, PanelLinear, pick_linear

CPU_FLAGS = cpu_flags()
HAS_BF16 = "avx512_bf16" in CPU_FLAGS
HAS_AMX = "amx_bf16" in CPU_FLAGS and "amx_tile" in CPU_FLAGS
KINDS = ["vdpbf16ps", "amx", "screened-fp32", "screened-fp32-panels", "screened-bf16", "screened-bf16-panels",
         "screened-pairs"]
ARGMAX_KINDS = ["argmax-int8", "argmax-bf16"]  # no screen: the tests of screens do not apply


class Kind:
    """One greedy head under test: `make(weight)` builds it (skipping where this CPU cannot run
    it), `linear` is its full head's GEMM."""

    def __init__(self, name: str):
        self.name = name
        if name in ("vdpbf16ps", "amx"):
            if not HAS_BF16 or (name == "amx" and not HAS_AMX):
                pytest.skip(f"{name}: needs a CPU with AVX-512 BF16" + (" and AMX" if name == "amx" else ""))
            self.linear = pick_linear(torch.device("cpu"), torch.float32)
            assert isinstance(self.linear, PanelLinear)  # an AVX-512 BF16 CPU has AVX-512: the panel GEMM
        elif name == "screened-pairs":
            self.linear = pick_linear(torch.device("cpu"), torch.bfloat16)
            if not HAS_BF16 or type(self.linear) is not Bf16PanelLinear:
                pytest.skip(f"{name}: needs a CPU with AVX-512 BF16 and its bf16 panel GEMM")
        elif name in ARGMAX_KINDS:
            cpu = torch.device("cpu")
            self.linear = Int8PanelLinear() if name == "argmax-int8" else pick_linear(cpu, torch.bfloat16)
            if type(self.linear) not in (Int8PanelLinear, Bf16PanelLinear) or not self.linear.runs_here():
                pytest.skip(f"{name}: no panel GEMM on this CPU")
        else:
            self.linear = pick_linear(torch.device("cpu"), torch.bfloat16 if "bf16" in name else torch.float32)
            if type(self.linear) not in (PanelLinear, Bf16PanelLinear):
                pytest.skip(f"{name}: no panel GEMM on this CPU")

    def make(self, weight: torch.Tensor):
        packed = self.linear.prepare(weight)
        if self.name in ("vdpbf16ps", "amx"):
            head = GreedyHead(weight, packed, amx=self.name == "amx")
            assert head.runs_here()  # this CPU can run it: the tests must not pass by skipping it
            return head
        if self.name in ARGMAX_KINDS:
            head = ArgmaxHead(self.linear, packed, weight.shape[1])
            assert head.runs_here()
            return head
        if self.name == "screened-pairs":
            head = PairsScreenedHead(self.linear, weight, packed)
            assert head.runs_here()
            return head
        head = ScreenedHead(self.linear, weight, packed, tied=not self.name.endswith("panels"))
        if not head.runs_here():
            pytest.skip(f"{self.name}: not the FMA chain its exact logits repeat here (AVX-512 BF16)")
        return head


@pytest.fixture(params=KINDS)
def kind(request):
    return Kind(request.param)


def reference(kind, head, x, banned=None):
    logits = kind.linear(x, head.packed)
    for row, ids in enumerate(banned or []):
        logits[row, ids] = float("-inf")
    return logits.argmax(-1).tolist()


@pytest.mark.skipif(not HAS_BF16, reason="needs a CPU with AVX-512 BF16")
def test_amx_is_the_default_where_the_cpu_has_it():
    """The engine's head (pick_greedy_head) screens on the tiles on an AMX CPU: the path tested."""
    linear, w = pick_linear(torch.device("cpu"), torch.float32), torch.randn(64, 32)
    assert pick_greedy_head(linear, w, linear.prepare(w)).amx == HAS_AMX


@pytest.mark.parametrize("n,k", [(1000, 150), (4099, 64), (48, 7), (1024, 40)])
def test_matches_the_full_heads_argmax(kind, n, k):
    g = torch.Generator().manual_seed(n + k)
    head = kind.make(torch.randn(n, k, generator=g))
    rows = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33, 64]  # 1-6: every int16 tile of PairsScreenedHead's screen
    for m in rows:
        x = torch.randn(m, k, generator=g) * 2
        assert head(x) == reference(kind, head, x), m
    # Every row was screened: a row the screen missed would still get its token right, from
    # all n logits recomputed (1.2-2 candidates a row is typical here).
    assert 0 < head.candidates <= 8 * sum(rows)


def test_ties_and_near_ties_are_decided_exactly(kind):
    """Rows equal to or within the screen's resolution of the winner: the screen cannot tell them
    apart, the exact recompute must, and an exact tie goes to the first index."""
    g = torch.Generator().manual_seed(1)
    n, k = 777, 96
    w = torch.randn(n, k, generator=g)
    x = torch.randn(4, k, generator=g)
    best = kind.linear(x[:1], kind.linear.prepare(w)).argmax().item()
    w[3] = w[best]                                                  # an exact tie, earlier index
    w[500:540] = w[best] + 1e-4 * torch.randn(40, k, generator=g)   # 40 near ties
    head = kind.make(w)
    before = head.candidates
    got = head(x)
    assert got == reference(kind, head, x)
    assert got[0] in [3, *range(500, 540)]
    assert head.candidates - before > 40  # the near ties went through the exact recompute


def test_all_negative_logits_and_padding(kind):
    """Padding outputs screen to 0: they must not set the bar when every real logit is < 0."""
    g = torch.Generator().manual_seed(2)
    w = -torch.rand(1001, 33, generator=g) - 0.1
    head = kind.make(w)
    x = torch.rand(5, 33, generator=g) + 0.1
    assert max(kind.linear(x, head.packed).max(-1).values.tolist()) < 0
    assert head(x) == reference(kind, head, x)


def test_barred_tokens_are_never_chosen(kind):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(500, 40, generator=g)
    head = kind.make(w)
    x = torch.randn(3, 40, generator=g)
    top = kind.linear(x, head.packed).topk(3, dim=-1).indices.tolist()
    banned = [top[0][:1], top[1][:2], []]  # each barred row loses its best (and second) token
    got = head(x, banned)
    assert got == reference(kind, head, x, banned)
    assert got[0] == top[0][1] and got[1] == top[1][2] and got[2] == top[2][0]


def test_rows_it_cannot_answer_return_none(kind):
    head = kind.make(torch.randn(100, 16))
    assert head(torch.full((1, 16), float("nan"))) is None
    assert head(torch.randn(1, 16), [list(range(100))]) is None  # everything barred


def test_logits_at_are_the_full_heads_bit_for_bit(kind):
    g = torch.Generator().manual_seed(6)
    head = kind.make(torch.randn(999, 77, generator=g))
    x = torch.randn(3, 77, generator=g) * 5
    ids = torch.tensor([0, 47, 48, 95, 500, 998, 47])
    assert torch.equal(head.logits_at(x, ids), kind.linear(x, head.packed)[:, ids])
    with pytest.raises(ValueError, match="expected ids in"):
        head.logits_at(x, torch.tensor([999]))


@pytest.mark.parametrize("name", ["screened-bf16", "screened-pairs"])
def test_screened_head_gives_way_past_1024_candidates(name):
    """2000 equal rows: every one a candidate, more than the exact recompute takes; none computed."""
    kind = Kind(name)
    g = torch.Generator().manual_seed(5)
    twins = kind.make(torch.randn(1, 16, generator=g).expand(2000, 16).contiguous())
    before = twins.candidates
    assert twins(torch.randn(1, 16, generator=g)) is None
    assert twins.candidates == before


@pytest.mark.parametrize("name", ["screened-fp32", "screened-bf16"])
def test_the_engine_picks_the_screened_head_for_fp32_and_bf16_heads_the_argmax_head_for_int8(name):
    """Where it matches the full head (else make skips), unless GreedyHead (AVX-512 BF16) came first."""
    kind, w = Kind(name), torch.randn(200, 32)
    kind.make(w)
    head = pick_greedy_head(kind.linear, w, kind.linear.prepare(w), tied=True)
    assert isinstance(head, ScreenedHead) or isinstance(head, GreedyHead) and type(kind.linear) is PanelLinear
    int8 = Int8PanelLinear()
    assert isinstance(pick_greedy_head(int8, w, int8.prepare(w), tied=True), ArgmaxHead)  # no screen halves its bytes


def test_the_pairs_screen_screens_up_to_its_rows_then_gives_way_to_the_full_head():
    """PairsScreenedHead screens 1..MAX_ROWS rows (each row's candidates counted), and more rows
    take the full head's argmax (no candidate); the engine picks it for a bf16 head there."""
    kind = Kind("screened-pairs")
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3000, 96, generator=g)
    head = kind.make(w)
    assert isinstance(pick_greedy_head(kind.linear, w, kind.linear.prepare(w), tied=True), PairsScreenedHead)
    rows = PairsScreenedHead.MAX_ROWS
    before = head.candidates
    x = torch.randn(rows, 96, generator=g)
    assert head(x) == reference(kind, head, x)
    assert rows <= head.candidates - before <= 8 * rows
    before = head.candidates
    x = torch.randn(rows + 1, 96, generator=g)
    assert head(x) == reference(kind, head, x) and head.candidates == before


def rounding_decides(k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A row x and a head whose winner on x as given (token 7) loses on x rounded to bf16 (token 9,
    a zero row, logit 0; every other logit below -1), by margins past the screen's bound; None
    where this draw has none. Row 7 is exact in bf16 and in int8 groups (q / 128, a 127 in each
    group of 32), so the screen has no weight error to widen its bound by."""
    x = torch.randn(1, k, generator=g)
    r = x.bfloat16().float()
    u, rn = (x - r)[0].double(), r[0].double()
    v = (u - (u @ rn + 2e-3 * u.norm()) / (rn @ rn) * rn).view(-1, 32)  # v . r < 0 < v . x
    q = torch.round(v * 127 / v.abs().amax(dim=1, keepdim=True)).view(-1)
    w = (-rn / rn.norm()).float().expand(50, k) + 0.01 * torch.randn(50, k, generator=g)
    w[9] = 0
    w[7] = (q / 128).float()
    w = w.bfloat16().float()
    on_x, on_r = float(w[7].double() @ x[0].double()), float(w[7].double() @ rn)
    return (x, w) if on_x > 1e-2 and on_r < -1e-3 else None


def test_the_pairs_screen_bounds_the_full_heads_logits_of_the_rounded_rows():
    """Rows whose bf16 rounding moves the winner: the full head reads the rows rounded, so the screen
    must bound the distance to those logits, not to the logits of the rows as given (the token with
    a zero row has no weight error for a bound to cover)."""
    kind = Kind("screened-pairs")
    g = torch.Generator().manual_seed(8)
    found = [case for case in (rounding_decides(64, g) for _ in range(400)) if case is not None]
    assert len(found) >= 3
    for x, w in found[:3]:
        head = kind.make(w)
        assert reference(kind, head, x) == [9]
        assert head(x) == [9]


@pytest.fixture(params=KINDS + ARGMAX_KINDS)
def any_kind(request):
    return Kind(request.param)


def test_sampler_uses_it_only_where_no_logits_are_needed(any_kind):
    """Greedy rows without logprobs take the head; sampled rows and logprob requests the logits;
    a mixed batch gives each row the token the full logits give; a batch of greedy rows is one
    call of the head over all of them."""
    kind = any_kind
    from backends.request import Request, SamplingParams
    from backends.sampler import sample

    g = torch.Generator().manual_seed(4)
    w = torch.randn(300, 24, generator=g)

    class Model:
        greedy_head = kind.make(w)
        calls = []

        def logits(self, h):
            self.calls.append(("logits", h.shape[0]))
            return kind.linear(h, self.greedy_head.packed)

        def greedy(self, h, banned=None):
            self.calls.append(("greedy", h.shape[0]))
            return self.greedy_head(h, banned)

    model, x = Model(), torch.randn(3, 24, generator=g)
    greedy = SamplingParams(max_tokens=8)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    reqs = [Request(f"r{i}", [1, 2], p, None, None) for i, p in enumerate([greedy, sampled, greedy])]
    full = kind.linear(x, model.greedy_head.packed)
    tokens, logprobs = sample(model, x, reqs, [[], [], []], with_logprobs=False)
    assert model.calls == [("greedy", 2), ("logits", 1)] and logprobs is None
    assert tokens[0] == full[0].argmax().item() and tokens[2] == full[2].argmax().item()
    model.calls.clear()
    tokens2, logprobs = sample(model, x[:1], reqs[:1], [[]], with_logprobs=True)
    assert model.calls == [("logits", 1)] and len(logprobs) == 1 and tokens2 == tokens[:1]
    model.calls.clear()
    assert sample(model, x, [reqs[0]] * 3, [[], [], []], with_logprobs=False)[0] == full.argmax(-1).tolist()
    assert model.calls == [("greedy", 3)]


@pytest.mark.parametrize("name", ARGMAX_KINDS)
@pytest.mark.parametrize("n,k", [(1000, 150), (4099, 64), (48, 7), (49152, 96)])
def test_argmax_head_gives_the_full_heads_argmax(name, n, k):
    """Every row count of the GEMM's tiles, barred ids (a row's best, then its two best), an exact
    tie (the first index wins), a row of NaN (the full logits' argmax: 0) and every id barred."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    w[n // 2] = w[n // 3]  # equal rows: equal logits, the earlier index wins
    head = Kind(name).make(w)
    for m in [1, 2, 3, 4, 5, 8, 16, 17, 33, 64]:
        x = torch.randn(m, k, generator=g) * 2
        x[0] = (w[n // 3] * 4).bfloat16().float()  # row 0's best is the tie
        full = head.linear(x, head.packed)
        top = full.topk(3, dim=-1).indices.tolist()
        banned = [top[r][:r % 3] for r in range(m)]
        assert head(x) == full.argmax(-1).tolist(), m
        assert head(x)[0] == n // 3
        for row, ids in enumerate(banned):
            full[row, ids] = float("-inf")
        assert head(x, banned) == full.argmax(-1).tolist(), m
    x = torch.randn(3, k, generator=g)
    x[1, 0] = float("nan")
    assert head(x, [[], [], list(range(n))]) == [head.linear(x[:1], head.packed).argmax().item(), 0, 0]


def test_sampler_takes_the_full_logits_once_where_the_head_cannot_answer():
    """A step of plain greedy rows asks the head once; where it cannot answer (a row not finite,
    too many candidates) every row takes the full logits, barred ids included, not the head again."""
    from backends.request import Request, SamplingParams
    from backends.sampler import sample

    calls, full = [], torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])

    class Model:
        def greedy(self, h, banned=None):
            calls.append("greedy")
            return None

        def logits(self, h):
            calls.append("logits")
            return full[:h.shape[0]].clone()

    reqs = [Request(f"r{i}", [1], SamplingParams(max_tokens=4), None, None) for i in range(2)]
    assert sample(Model(), torch.zeros(2, 4), reqs, [[1], []], with_logprobs=False) == ([2, 0], None)
    assert calls == ["greedy", "logits"]


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
