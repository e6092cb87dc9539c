"""Greedy tokens from the last hidden rows without the full fp32 lm_head (csrc/greedy_head.c).

A bf16 copy of the head screens every logit to within a proven bound and only the few
tokens that can still win are computed again in fp32, the way the panel GEMM computes
them: the token is exactly argmax of the fp32 logits (first index on ties), for about
half of the head's weight stream. Only for the panel GEMM's packing (fp32, AVX-512) on a
CPU with AVX-512 BF16. The screen runs on the AMX tiles where the CPU has them, else on
vdpbf16ps. Elsewhere ScreenedHead screens fp32 and bf16 heads the same way (csrc/screen_head.c);
PairsScreenedHead screens a bf16 head on AVX-512 BF16 CPUs, for a step of few rows; and ArgmaxHead
gives an int8 head's token (or a bf16 one's past those rows) from its full logits in one C call.
On a GPU `pick_greedy_head` gives `DeviceGreedyHead`.
"""
from __future__ import annotations

import ctypes
import itertools

import numpy as np
import torch

from kernels.linear import (Bf16PanelLinear, Int8PanelLinear, PackedWeight, PanelLinear, int8_groups,
                            pack_int8_groups, scratch_words)
from kernels.linear import pack_bf16 as pack_panels_bf16

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
LANES = 16  # outputs per bf16 panel; csrc/greedy_head.c's LANES
KBLOCK = 32  # k per AMX tile: the packed k is padded to a multiple (csrc/greedy_head.c's KBLOCK2 pairs)
# greedy_head: x, ldx, bf16 panels, fp32 panels, fp32 rows (or NULL), norms, M, N, K, banned, offsets, scratch,
# tokens, candidates, amx; greedy_head_logits: x, ldx, weight (rows or panels), has rows, M, K, ids, n ids, out
SIGNATURES = {"greedy_head": (_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64),
              "greedy_head_logits": (_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr),
              "greedy_head_amx_ready": ()}


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> bf16 panels [ceil(N / 16), K32 / 2, 16, 2] with K32 = K rounded up to 32,
    zero-padded, round to nearest."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // LANES) * LANES, -(-k // KBLOCK) * KBLOCK, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    return padded.view(-1, LANES, padded.shape[1] // 2, 2).transpose(1, 2).contiguous()


def row_norms(weight: torch.Tensor) -> torch.Tensor:
    """||W_j|| in fp64, then fp32 (the kernel's bound allows for that rounding), zero-padded to 16."""
    n = weight.shape[0]
    norms = torch.zeros(-(-n // LANES) * LANES, dtype=torch.float32)
    norms[:n] = weight.double().norm(dim=1)
    return norms


def barred(banned: list[list[int]] | None, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Each of m rows' barred ids in one array, row i's at [offsets[i], offsets[i + 1]) (and one
    more element, so the array is never empty)."""
    if not banned or not any(len(ids) for ids in banned):
        return np.zeros(1, np.int64), np.zeros(m + 1, np.int64)
    flat = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in banned] + [np.zeros(1, np.int64)])
    return flat, np.fromiter(itertools.accumulate((len(ids) for ids in banned), initial=0), np.int64, m + 1)


def checked_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """ids as contiguous int64, each in [0, n), else a ValueError naming the range."""
    ids = ids.to(torch.int64).contiguous()
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < n:
        raise ValueError(f"expected ids in [0, {n}), got {int(ids.min())}..{int(ids.max())}")
    return ids


class GreedyHead:
    def __init__(self, weight: torch.Tensor, packed: PackedWeight, amx: bool | None = None, tied: bool = False):
        """amx: screen on the AMX tiles (None: where the CPU and the OS allow it; True where they
        do not is an error). tied: the model keeps `weight` anyway (its embeddings), so
        exact logits (the candidates', `logits_at`'s) read an id's row (2.3 KB on the default
        model) instead of the panels (36 KB: one float of each cache line); else no second fp32
        copy is kept."""
        from kernels import cbuild

        lib = cbuild.load("greedy_head", SIGNATURES)
        self._kernel, self._logits = lib.greedy_head, lib.greedy_head_logits
        self.rows = weight if tied and weight.dtype == torch.float32 and weight.is_contiguous() else None
        ready = bool(lib.greedy_head_amx_ready())
        if amx and not ready:
            raise RuntimeError("the greedy head cannot use AMX here (CPU, compiler or OS)")
        self.amx = ready if amx is None else amx
        self.packed, self.bf16, self.norms = packed, pack_bf16(weight.float()), row_norms(weight.float())
        self.n, self.k = weight.shape
        self.candidates = 0  # exact logits computed so far (over all rows): the screen's hit count

    def __call__(self, hidden: torch.Tensor, banned: list[list[int]] | None = None) -> list[int] | None:
        """Greedy token of each row of hidden [M, K] fp32, row m never one of banned[m]; None where
        the kernel cannot answer (built without AVX-512 BF16, a row that is not finite, or all of
        a row barred): then take the full logits."""
        if hidden.stride(-1) != 1:
            hidden = hidden.contiguous()
        m = hidden.shape[0]
        flat, offsets = barred(banned, m)
        scratch = torch.empty(m, self.norms.numel(), dtype=torch.float32)
        tokens = torch.empty(m, dtype=torch.int64)
        count = ctypes.c_int64(0)
        rows = self.rows.data_ptr() if self.rows is not None else None
        rc = self._kernel(hidden.data_ptr(), hidden.stride(0), self.bf16.data_ptr(), self.packed.panels.data_ptr(),
                          rows, self.norms.data_ptr(), m, self.n, self.k, flat.ctypes.data, offsets.ctypes.data,
                          scratch.data_ptr(), tokens.data_ptr(), ctypes.byref(count), int(self.amx))
        if rc != 0:
            return None
        self.candidates += count.value
        return tokens.tolist()

    def logits_at(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[M, len(ids)] fp32: each row's logits at ids (int64, each below N), bit for bit those of
        the full logits (the panel GEMM's), without the others."""
        if hidden.stride(-1) != 1:
            hidden = hidden.contiguous()
        ids = checked_ids(ids, self.n)
        out = torch.empty(hidden.shape[0], ids.numel(), dtype=torch.float32)
        source = self.rows if self.rows is not None else self.packed.panels
        rc = self._logits(hidden.data_ptr(), hidden.stride(0), source.data_ptr(), int(self.rows is not None),
                          hidden.shape[0], self.k, ids.data_ptr(), ids.numel(), out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"greedy_head_logits failed ({rc})")
        return out

    def runs_here(self) -> bool:
        return self(torch.ones(1, self.k)) is not None


SCREEN_SIGNATURES = {
    # x, ldx, screen, kind, norms, M, N, K, weights, layout, banned, offsets, scores, rows' scratch, tokens, candidates
    "screen_head": (_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr),
    # x, ldx, weights, layout, M, K, ids, n ids, out
    "screen_head_logits": (_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr),
    "screen_head_ready": (),
    # x, ldx, weights (the head's packing), kind, M, N, K, banned, offsets, logits, rows' scratch, tokens
    "head_argmax": (_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr),
    # x, ldx, screen, norms, M, N, K, bf16 panels, banned, offsets, scores, rounded rows, rows' scratch, tokens,
    # candidates
    "screen_head_pairs": (_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr),
    "screen_head_pairs_ready": ()}
ROWS_F32, ROWS_AS_BF16, PANELS_F32, PANELS_BF16, PANELS_BF16_PAIRS = range(5)  # csrc/screen_head.c's layouts


class ScreenedHead:
    """The greedy head where the panel GEMM keeps the rows fp32 under bf16 weights and int16 under
    int8 (AVX2 CPUs, and AVX-512 ones without its BF16), for an fp32 or a bf16 lm_head: the panel
    GEMM computes a screen of every logit from a copy of the head in half its bytes (bf16 of an
    fp32 head, int8 groups of a bf16 one), and csrc/screen_head.c computes again, exactly as the
    full head would, only the tokens the screen's proven bound cannot rule out (1-4 a row on the
    default model). The token is argmax of the full head's logits, first index on ties. At 1-64
    rows the screened head measured 1.1-1.9x faster than full logits and argmax (docs/cpu.md)."""

    def __init__(self, linear, weight: torch.Tensor, packed: PackedWeight, tied: bool = False):
        from kernels import cbuild

        self._lib = lib = cbuild.load("screen_head", SCREEN_SIGNATURES)
        self._screen, self._logits, self._ready = lib.screen_head, lib.screen_head_logits, lib.screen_head_ready
        self.linear, self.packed = linear, packed
        bf16 = isinstance(linear, Bf16PanelLinear)
        exact = weight.float().bfloat16().float() if bf16 else weight.float()
        n, k = exact.shape
        if bf16:  # the screen: int8 groups of the bf16 values, as weights int8 makes them
            q, scale = int8_groups(exact)
            self.screen, self.kind = pack_int8_groups(q, scale, k), Int8PanelLinear.kind
            screen = q.view(n, scale.shape[1], -1).mul_(scale.float()[:, :, None]).view(n, -1)[:, :k]
        else:
            screen = exact.bfloat16().float()
            self.screen, self.kind = pack_panels_bf16(screen), Bf16PanelLinear.kind
        # [2, N]: fp32 norms err by under K 2^-25 relative (1.7e-5 at K 576): rounded up past that
        self.norms = torch.stack([(exact - screen).norm(dim=1), exact.norm(dim=1)]).mul_(1 + 2 ** -12).contiguous()
        if tied and weight.dtype == torch.float32 and weight.is_contiguous():
            self.weights, self.layout = weight, ROWS_AS_BF16 if bf16 else ROWS_F32
        else:
            self.weights, self.layout = packed.panels, PANELS_BF16 if bf16 else PANELS_F32
        self.n, self.k = n, k
        self._scores = self._rows = None
        self.candidates = 0  # exact logits computed so far (over all rows)

    def __call__(self, hidden: torch.Tensor, banned: list[list[int]] | None = None) -> list[int] | None:
        """Greedy token of each row of hidden [M, K] fp32, row m never one of banned[m]; None where
        the full logits must decide (a row that is not finite, all of it barred, or too many
        candidates)."""
        hidden, flat, offsets, scores, rows, tokens = _head_inputs(self, hidden, banned)
        count = ctypes.c_int64(0)
        rc = self._screen(hidden.data_ptr(), hidden.stride(0), self.screen.panels.data_ptr(), self.kind,
                          self.norms.data_ptr(), len(tokens), self.n, self.k, self.weights.data_ptr(), self.layout,
                          flat.ctypes.data, offsets.ctypes.data, scores.data_ptr(), rows.data_ptr(),
                          tokens.ctypes.data, ctypes.byref(count))
        self.candidates += count.value
        return tokens.tolist() if rc == 0 else None

    def logits_at(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[M, len(ids)] fp32: each row's logits at ids, bit for bit those of the full head."""
        hidden = hidden.float().contiguous()
        ids = checked_ids(ids, self.n)
        out = torch.empty(hidden.shape[0], ids.numel(), dtype=torch.float32)
        self._logits(hidden.data_ptr(), hidden.stride(0), self.weights.data_ptr(), self.layout, hidden.shape[0],
                     self.k, ids.data_ptr(), ids.numel(), out.data_ptr())
        return out

    def runs_here(self) -> bool:
        """Whether the screen's GEMMs are the ones its bound is for (fp32 and int16 rows) and this
        CPU's full head computes each logit as the exact chain here does (the AVX-512 BF16 forms
        round the rows to bf16 and sum pairs: not this chain), bit for bit, on random rows at every
        id of a panel's edge and a spread of others; and the screen picks the full head's argmax."""
        if not self._ready():
            return False
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, self.k, generator=g) * torch.tensor([[1.0], [30.0], [1e-3]])
        full = self.linear(x, self.packed)
        ids = torch.unique(torch.cat([torch.arange(min(self.n, 50)), torch.randint(self.n, (64,), generator=g),
                                      torch.tensor([self.n - 1])]))
        if not torch.equal(self.logits_at(x, ids).view(torch.int32), full[:, ids].view(torch.int32)):
            return False
        tokens = self(x[:2])  # None (too many candidates, a head of near-equal rows): the full logits decide
        return tokens is None or tokens == full[:2].argmax(-1).tolist()


class PairsScreenedHead(ScreenedHead):
    """The greedy head of a bf16 head on AVX-512 BF16 CPUs, whose GEMM rounds the rows to bf16 and
    sums k pairs on vdpbf16ps (no chain ScreenedHead's bound is for): the same int8 screen of the
    head, read by rows already rounded to bf16, and the candidates computed again by that GEMM's own
    chain (csrc/screen_head.c's screen_head_pairs), so the token is argmax of the full head's
    logits. It reads about half the full head's bytes, which pays only while a step has few rows:
    from MAX_ROWS + 1 rows, and where the GEMM would use the AMX tiles, ArgmaxHead gives the token."""

    MAX_ROWS = 6  # the int8 screen's GEMM against the full bf16 head's, on a Zen 4 (docs/cpu.md)

    def __init__(self, linear, weight: torch.Tensor, packed: PackedWeight):
        super().__init__(linear, weight, packed)
        self._pairs = self._lib.screen_head_pairs
        self._ready = self._lib.screen_head_pairs_ready
        self.weights, self.layout = packed.panels, PANELS_BF16_PAIRS
        self.full = ArgmaxHead(linear, packed, self.k)
        self._rounded = None

    def __call__(self, hidden: torch.Tensor, banned: list[list[int]] | None = None) -> list[int] | None:
        """As ScreenedHead's; more than MAX_ROWS rows go to the full head."""
        if hidden.shape[0] > self.MAX_ROWS:
            return self.full(hidden, banned)
        hidden, flat, offsets, scores, rows, tokens = _head_inputs(self, hidden, banned)
        if self._rounded is None or self._rounded.shape[0] < len(tokens):
            self._rounded = torch.empty(self.MAX_ROWS, self.k, dtype=torch.float32)
        count = ctypes.c_int64(0)
        rc = self._pairs(hidden.data_ptr(), hidden.stride(0), self.screen.panels.data_ptr(), self.norms.data_ptr(),
                         len(tokens), self.n, self.k, self.weights.data_ptr(), flat.ctypes.data, offsets.ctypes.data,
                         scores.data_ptr(), self._rounded.data_ptr(), rows.data_ptr(), tokens.ctypes.data,
                         ctypes.byref(count))
        self.candidates += count.value
        if rc == -3:
            return self.full(hidden, banned)
        return tokens.tolist() if rc == 0 else None


def _head_inputs(head, hidden: torch.Tensor, banned: list[list[int]] | None) -> tuple:
    """What screen_head and head_argmax take for hidden [M, K]: its rows as contiguous fp32, the
    rows' barred ids (`barred`), the head's logits [M, N] and GEMM row scratch (kept for the next
    step) and an empty tokens array [M]."""
    m = hidden.shape[0]
    if hidden.dtype != torch.float32 or hidden.stride(-1) != 1:
        hidden = hidden.float().contiguous()
    if head._scores is None or head._scores.shape[0] < m:
        head._scores = torch.empty(m, head.n, dtype=torch.float32)
        head._rows = torch.empty(scratch_words(m, head.k), dtype=torch.int32)
    return hidden, *barred(banned, m), head._scores, head._rows, np.empty(m, dtype=np.int64)


class ArgmaxHead:
    """The greedy head of an int8 head (no screen reads fewer bytes than it) and of a bf16 head
    past PairsScreenedHead's rows (AVX-512 BF16): the full head's logits, by the same panel GEMM,
    and their argmax in one C call (csrc/screen_head.c's head_argmax), so the same token as the
    full logits give, with none of the tensor operations around them. Right after a step has
    streamed its weights through the caches each such operation cost 5-20x what it costs alone
    (docs/cpu.md, session 39)."""

    def __init__(self, linear, packed: PackedWeight, k: int):
        from kernels import cbuild

        self._kernel = cbuild.load("screen_head", SCREEN_SIGNATURES).head_argmax
        self.linear, self.packed, self.kind = linear, packed, linear.kind
        self.n, self.k = packed.out_features, k
        self._scores = self._rows = None

    def __call__(self, hidden: torch.Tensor, banned: list[list[int]] | None = None) -> list[int] | None:
        """Greedy token of each row of hidden [M, K], row m never one of banned[m] (every id barred:
        0, as argmax of the full logits); None where this build has no such GEMM."""
        hidden, flat, offsets, scores, rows, tokens = _head_inputs(self, hidden, banned)
        rc = self._kernel(hidden.data_ptr(), hidden.stride(0), self.packed.panels.data_ptr(), self.kind, len(tokens),
                          self.n, self.k, flat.ctypes.data, offsets.ctypes.data, scores.data_ptr(), rows.data_ptr(),
                          tokens.ctypes.data)
        return tokens.tolist() if rc == 0 else None

    def logits_at(self, hidden: torch.Tensor, ids: torch.Tensor) -> None:
        """None: penalised rows take the full logits (no exact chain for a few ids of these heads)."""
        return None

    def runs_here(self) -> bool:
        """Whether it gives the full head's argmax on random rows (its GEMM is the full head's)."""
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, self.k, generator=g) * torch.tensor([[1.0], [30.0], [1e-3]])
        tokens = self(x)
        return tokens is not None and tokens == self.linear(x, self.packed).argmax(-1).tolist()


def ban(logits: torch.Tensor, banned: list[list[int]] | None) -> None:
    """-inf at each row's banned ids, in one scatter whose indices go to the device without
    waiting for it (on a GPU an assignment a row made a copy that waited for the stream)."""
    pairs = [(row, token) for row, ids in enumerate(banned or ()) for token in ids]
    if not pairs:
        return
    at = torch.tensor(pairs, dtype=torch.long).to(logits.device, non_blocking=True)
    logits.index_put_((at[:, 0], at[:, 1]), logits.new_full((len(pairs),), float("-inf")))


class PendingTokens:
    """A step's greedy tokens, launched: `device` (a row's token each) can feed the next step's
    input ids before any of them reaches the host; `wait()` gives them on the host. `done` is
    the event after which the step's work on the device has ended (None: it had when made)."""

    def __init__(self, device: torch.Tensor, host: torch.Tensor | None = None, done=None):
        self.device, self.host, self.done = device, host, done

    def wait(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return (self.host if self.host is not None else self.device).tolist()


def launch_argmax(logits: torch.Tensor, banned: list[list[int]] | None = None,
                  argmax: torch.Tensor | None = None) -> PendingTokens:
    """Each row's argmax of `logits` with its banned ids barred (in place), left pending: on a GPU
    copied to the host on the stream, an event after it. argmax: `logits`' own argmax, taken
    already (a decode graph's), used where no id is barred."""
    if any(len(ids) for ids in banned or ()):
        ban(logits, banned)
        argmax = None
    tokens = logits.argmax(dim=-1) if argmax is None else argmax
    if not tokens.is_cuda:
        return PendingTokens(tokens)
    host = torch.empty(tokens.shape[0], dtype=torch.int64, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return PendingTokens(tokens, host, done)


class DeviceGreedyHead:
    """Greedy tokens on a GPU. The argmax is taken over the logits in the model's dtype: the
    fp32 logits the sampler would take are their exact copies, so the token is the same, and
    the [rows, vocab] fp32 copy is never made. The result is awaited on a CUDA event, whose
    wait lets go of the GIL (a plain .tolist() waits holding it): with overlap on, the
    scheduler thread prepares the next step meanwhile."""

    def __init__(self, linear, head):
        self.linear, self.head = linear, head

    def __call__(self, hidden: torch.Tensor, banned: list[list[int]] | None = None) -> list[int]:
        return self.launch(hidden, banned).wait()

    def launch(self, hidden: torch.Tensor, banned: list[list[int]] | None = None) -> PendingTokens:
        """The tokens on the device and their copy to the host on its way; nothing waits."""
        return launch_argmax(self.linear(hidden, self.head), banned)

    def logits_at(self, hidden: torch.Tensor, ids: torch.Tensor) -> None:
        """None: on a GPU the full logits cost little, and a matmul over a few ids need not
        round as the full one does (penalised rows take the full logits)."""
        return None


def pick_greedy_head(linear, weight: torch.Tensor, packed,
                     tied: bool = False) -> GreedyHead | ScreenedHead | ArgmaxHead | DeviceGreedyHead | None:
    """On a GPU the device head; on a CPU with AVX-512 BF16 GreedyHead for an fp32 panel GEMM head;
    else ScreenedHead for an fp32 or bf16 panel GEMM head where its exact logits are the full
    head's (checked here; PairsScreenedHead for a bf16 one on AVX-512 BF16); else ArgmaxHead for a
    bf16 or int8 one. tied: `weight` is the model's embeddings."""
    from kernels import cbuild

    if weight.is_cuda:
        return DeviceGreedyHead(linear, packed)
    if type(linear) is PanelLinear and cbuild.available("greedy_head", SIGNATURES):
        head = GreedyHead(weight, packed, tied=tied)
        if head.runs_here():
            return head
    if type(linear) in (PanelLinear, Bf16PanelLinear) and cbuild.available("screen_head", SCREEN_SIGNATURES):
        lib = cbuild.load("screen_head", SCREEN_SIGNATURES)
        pairs = type(linear) is Bf16PanelLinear and lib.screen_head_pairs_ready()
        head = PairsScreenedHead(linear, weight, packed) if pairs else ScreenedHead(linear, weight, packed, tied=tied)
        if head.runs_here():
            return head
    if type(linear) in (Bf16PanelLinear, Int8PanelLinear) and cbuild.available("screen_head", SCREEN_SIGNATURES):
        head = ArgmaxHead(linear, packed, weight.shape[1])
        if head.runs_here():
            return head
    return None
