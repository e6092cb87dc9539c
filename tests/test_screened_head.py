"""kernels.greedy_head.ScreenedHead: from a screen in half the head's bytes (bf16 of an fp32 head,
int8 groups of a bf16 one) and a proven bound, exactly argmax of the full head's logits (first
index on ties), barred tokens excluded, on shapes with padding (N not a multiple of 8 or 48, odd
K) and 1..17 rows, with the exact logits read from the head's rows (tied) or its panels."""
import pytest
import torch

from kernels.greedy_head import GreedyHead, ScreenedHead, pick_greedy_head
from kernels.linear import Bf16PanelLinear, Int8PanelLinear, PanelLinear, pick_linear

LINEARS = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(params=list(LINEARS))
def linear(request):
    lin = pick_linear(torch.device("cpu"), LINEARS[request.param])
    if type(lin) not in (PanelLinear, Bf16PanelLinear):
        pytest.skip("no panel GEMM on this CPU")
    return lin


@pytest.fixture(params=[True, False], ids=["rows", "panels"])
def tied(request):
    return request.param


def make_head(linear, weight, tied=True):
    head = ScreenedHead(linear, weight, linear.prepare(weight), tied=tied)
    if not head.runs_here():
        pytest.skip(f"{type(linear).__name__} is not the FMA chain the exact logits repeat here (AVX-512 BF16)")
    return head


def reference(linear, head, x, banned=None):
    logits = linear(x, head.packed)
    for row, ids in enumerate(banned or []):
        logits[row, ids] = float("-inf")
    return logits.argmax(-1).tolist()


@pytest.mark.parametrize("n,k", [(1000, 150), (4099, 64), (48, 7), (1024, 40)])
def test_matches_the_full_heads_argmax(linear, tied, n, k):
    g = torch.Generator().manual_seed(n + k)
    head = make_head(linear, torch.randn(n, k, generator=g), tied)
    rows = [1, 2, 3, 5, 8, 17, 64]
    for m in rows:
        x = torch.randn(m, k, generator=g) * 2
        assert head(x) == reference(linear, head, x), m
    assert 0 < head.candidates <= 8 * sum(rows)  # every row screened, a few candidates each


def test_ties_and_near_ties_are_decided_exactly(linear, tied):
    """Rows equal to or within the screen's error of the winner: the screen cannot tell them
    apart, the exact recompute must, and an exact tie goes to the first index."""
    g = torch.Generator().manual_seed(1)
    n, k = 777, 96
    w = torch.randn(n, k, generator=g)
    x = torch.randn(4, k, generator=g)
    best = linear(x[:1], linear.prepare(w)).argmax().item()
    w[3] = w[best]                                                  # an exact tie, earlier index
    w[500:540] = w[best] + 1e-3 * torch.randn(40, k, generator=g)   # 40 near ties
    head = make_head(linear, w, tied)
    before = head.candidates
    got = head(x)
    assert got == reference(linear, head, x)
    assert got[0] in [3, *range(500, 540)]
    assert head.candidates - before > 40  # the near ties went through the exact recompute


def test_all_negative_logits_and_padding(linear):
    """Padding outputs screen to 0: they must not set the bar when every real logit is < 0."""
    g = torch.Generator().manual_seed(2)
    w = -torch.rand(1001, 33, generator=g) - 0.1
    head = make_head(linear, w)
    x = torch.rand(5, 33, generator=g) + 0.1
    assert max(linear(x, head.packed).max(-1).values.tolist()) < 0
    assert head(x) == reference(linear, head, x)


def test_barred_tokens_are_never_chosen(linear):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(500, 40, generator=g)
    head = make_head(linear, w)
    x = torch.randn(3, 40, generator=g)
    top = linear(x, head.packed).topk(3, dim=-1).indices.tolist()
    banned = [top[0][:1], top[1][:2], []]  # each barred row loses its best (and second) token
    got = head(x, banned)
    assert got == reference(linear, head, x, banned)
    assert got[0] == top[0][1] and got[1] == top[1][2] and got[2] == top[2][0]


def test_rows_it_cannot_answer_return_none(linear):
    g = torch.Generator().manual_seed(5)
    head = make_head(linear, torch.randn(100, 16, generator=g))
    assert head(torch.full((1, 16), float("nan"))) is None
    assert head(torch.randn(1, 16, generator=g), [list(range(100))]) is None  # everything barred
    twins = make_head(linear, torch.randn(1, 16, generator=g).expand(2000, 16).contiguous())
    before = twins.candidates
    assert twins(torch.randn(1, 16, generator=g)) is None  # 2000 equal rows: more candidates than it takes
    assert twins.candidates == before  # and none of them computed


def test_logits_at_are_the_full_heads_bit_for_bit(linear, tied):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(999, 77, generator=g)
    head = make_head(linear, w, tied)
    x = torch.randn(3, 77, generator=g) * 5
    ids = torch.tensor([0, 47, 48, 95, 500, 998, 47])
    assert torch.equal(head.logits_at(x, ids), linear(x, head.packed)[:, ids])
    with pytest.raises(ValueError, match="expected ids in"):
        head.logits_at(x, torch.tensor([999]))


def test_the_engine_picks_it_for_fp32_and_bf16_heads_not_int8(linear):
    """Where it matches the full head (else make_head skips), unless GreedyHead (AVX-512 BF16) came first."""
    w = torch.randn(200, 32)
    make_head(linear, w)
    head = pick_greedy_head(linear, w, linear.prepare(w), tied=True)
    assert isinstance(head, ScreenedHead) or isinstance(head, GreedyHead) and type(linear) is PanelLinear
    int8 = Int8PanelLinear()
    assert pick_greedy_head(int8, w, int8.prepare(w), tied=True) is None  # no screen halves int8's bytes
