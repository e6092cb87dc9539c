"""Token choice for a batch of rows of the lm_head's input, in vLLM's order:

    raw logprobs (rows that ask) -> banned ids (min_tokens) -> penalties (repetition,
    frequency, presence) -> greedy argmax, or temperature -> min_p -> top-k/top-p -> draw

Greedy rows that need no logprobs go through the model's exact greedy head where it has one
(kernels.greedy_head), penalised ones too where it gives logits at a few ids (`_greedy_rows`);
the rest from full logits, on the logits' device, each stage only over the rows that use it.
A sampled row that fails (its probabilities are not a distribution) costs only that row:
`RowsFailed` carries every other row's token."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from backends.request import Request, TokenLogprob
from kernels.greedy_head import ban, launch_argmax


class RowsFailed(RuntimeError):
    """Some rows could not be sampled; `tokens` holds the others' (each generator advanced once)."""

    def __init__(self, tokens: list[int], logprobs: list | None, errors: dict[int, str]):
        super().__init__(f"{len(errors)} row(s) could not be sampled")
        self.tokens, self.logprobs, self.errors = tokens, logprobs, errors


def needs_logits(req: Request, with_logprobs: bool) -> bool:
    """Whether a row must be chosen from full logits (the greedy head gives only an argmax)."""
    p = req.params
    return with_logprobs or p.logprobs is not None or not p.greedy


def sample(model, hidden: torch.Tensor, requests: list[Request], banned: list[list[int]],
           with_logprobs: bool = True) -> tuple[list[int], list[TokenLogprob | None] | None]:
    """hidden [n, hidden], one row per request (runner.run's output); banned: the ids each
    row may not pick (its stop ids before min_tokens). `model` has `logits(rows)`,
    `greedy(rows, banned)` and `logits_at(rows, ids)` (None where it cannot). Returns token
    ids and, where a row's request asks for them (or `with_logprobs`, every row: a hand-off
    carries them), their logprobs (None for the other rows; None in all when none asks)."""
    if not with_logprobs and all(req.params.plain_greedy for req in requests):  # the common step
        tokens = model.greedy(hidden, banned)
        if tokens is not None:
            return tokens, None
        heads = []  # the head cannot answer some row: the full logits for all, not the head again
    else:
        heads = [row for row, req in enumerate(requests) if not needs_logits(req, with_logprobs)]
    by_row = _greedy_rows(model, hidden, requests, banned, heads) if heads else {}
    rest = [row for row in range(len(requests)) if row not in by_row]
    if not rest:
        return [by_row[row] for row in range(len(requests))], None
    errors, rest_logprobs = {}, None
    try:
        rest_tokens, rest_logprobs = sample_logits(model.logits(take(hidden, rest)), [requests[r] for r in rest],
                                                   [banned[r] for r in rest], with_logprobs)
    except RowsFailed as exc:
        rest_tokens, rest_logprobs = exc.tokens, exc.logprobs
        errors = {rest[row]: message for row, message in exc.errors.items()}
    by_row |= dict(zip(rest, rest_tokens))
    tokens = [by_row[row] for row in range(len(requests))]
    logprobs = None
    if rest_logprobs is not None:
        lp_by_row = dict(zip(rest, rest_logprobs))
        logprobs = [lp_by_row.get(row) for row in range(len(requests))]
    if errors:
        raise RowsFailed(tokens, logprobs, errors)
    return tokens, logprobs


class LogitsRows:
    """`sample`'s model where a step's logits were computed already (a decode graph runs the
    lm_head: backends.cuda_graphs): the rows it is given are those logits, in the model's dtype.
    They are the step's scratch (the graph's next replay rewrites them), changed in place.
    Greedy rows take their argmax (exact: the fp32 logits are their copies), the graph's own
    where they are all its rows; penalised rows take the full logits, as on a GPU's own head."""

    def __init__(self, logits: torch.Tensor, argmax: torch.Tensor):
        self.all, self.argmax = logits, argmax

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.float()

    def greedy(self, rows: torch.Tensor, banned: list[list[int]]) -> list[int]:
        return launch_argmax(rows, banned, self.argmax if rows is self.all else None).wait()

    def logits_at(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        return None


def take(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows], without a copy where rows are all of them in order (the common step: an
    index op after a step's weight stream costs 0.1 ms of cold caches here, docs/cpu.md)."""
    return hidden if rows == list(range(hidden.shape[0])) else hidden[rows]


def _greedy_rows(model, hidden: torch.Tensor, requests: list[Request], banned: list[list[int]],
                 rows: list[int]) -> dict[int, int]:
    """The greedy head's tokens of greedy `rows`, by row, in one call; rows it cannot answer are
    left out (they take the full logits). Penalties change a row's logits only at the ids it
    has seen, so a penalised row's token is the better of the head's pick with those ids barred
    (exact over the others) and its best seen id, penalised (`_best_seen`)."""
    pen = [row for row in rows if requests[row].params.penalised]
    seen = _best_seen(model, hidden[pen], [requests[r] for r in pen], [banned[r] for r in pen]) if pen else None
    if seen is None:  # no logits at a few ids from this model: penalised rows take the full logits
        rows, pen = [row for row in rows if row not in pen], []
    if not rows:
        return {}
    barred = {row: banned[row] for row in rows}
    for row, ids in zip(pen, seen.ids if pen else ()):
        barred[row] = np.concatenate([np.asarray(banned[row], dtype=np.int64), ids])
    tokens = model.greedy(take(hidden, rows), [barred[row] for row in rows])
    if tokens is None:
        return {}
    by_row = dict(zip(rows, tokens))
    if pen:
        picks = torch.tensor([by_row[row] for row in pen])
        own = model.logits_at(hidden[pen], picks).diagonal()  # an id not seen: no penalty
        take_seen = (seen.value > own) | ((seen.value == own) & (seen.token < picks))  # argmax: first index
        for row, token in zip(pen, torch.where(take_seen, seen.token, picks).tolist()):
            by_row[row] = token
            requests[row].history.add(token)
    return by_row


class Seen(NamedTuple):
    ids: list[np.ndarray]   # each row's penalised ids, distinct (`_penalised_ids`)
    value: torch.Tensor     # [rows] each row's best penalised logit among `columns` (-inf: none)
    token: torch.Tensor     # [rows] its id (argmax's first on ties)


def _best_seen(model, hidden: torch.Tensor, requests: list[Request], banned: list[list[int]]) -> Seen | None:
    """The penalised rows' best among the ids any of them has seen, after banned ids and
    penalties as `sample_logits` takes them, from the logits at those ids alone
    (`model.logits_at`, bit for bit the full logits'); None where the model cannot give those.
    Another row's ids count too: their logits are exact, and the head's pick beats them."""
    ids = [np.unique(_penalised_ids(req)) for req in requests]
    columns = np.unique(np.concatenate(ids))
    logits = model.logits_at(hidden, torch.from_numpy(columns))
    if logits is None:
        return None
    if not len(columns):
        return Seen(ids, torch.full((len(requests),), float("-inf")), torch.zeros(len(requests), dtype=torch.int64))
    for row, stop in enumerate(banned):
        if len(stop):
            at = np.searchsorted(columns, stop).clip(max=len(columns) - 1)
            logits[row, at[columns[at] == stop]] = float("-inf")
    apply_penalties(logits, list(range(len(requests))), requests, columns)
    best = logits.argmax(dim=-1)
    return Seen(ids, logits.gather(1, best[:, None])[:, 0], torch.from_numpy(columns)[best])


def sample_logits(logits: torch.Tensor, requests: list[Request], banned: list[list[int]],
                  with_logprobs: bool = True) -> tuple[list[int], list[TokenLogprob | None] | None]:
    """logits [n, V] fp32, one row per request (changed in place); returns token ids and the
    logprobs of the rows that ask (see `sample`). Everything stays on the logits' device; the
    host copies are the ids (and the logprobs) at the end."""
    want = [row for row, req in enumerate(requests) if with_logprobs or req.params.logprobs is not None]
    raw = torch.log_softmax(logits[want], dim=-1) if want else None   # before anything below changes them
    ban(logits, banned)  # no end before min_tokens
    penalised = [row for row, req in enumerate(requests) if req.params.penalised]
    if penalised:
        apply_penalties(logits, penalised, [requests[row] for row in penalised])
    tokens = argmax_rows(logits)
    sampled = [row for row, req in enumerate(requests) if not req.params.greedy]
    failed = None
    if sampled:
        picks, failed = _sample_rows(logits[sampled], [requests[row] for row in sampled])
        tokens[sampled] = picks
    logprobs = None
    if want:
        chosen = _token_logprobs(raw, tokens[want], [requests[row].params.logprobs or 0 for row in want])
        logprobs = [None] * len(requests)
        for row, entry in zip(want, chosen):
            logprobs[row] = entry
    tokens = tokens.tolist()
    for row in penalised:
        requests[row].history.add(tokens[row])
    if failed is not None and any(bad := failed.tolist()):
        raise RowsFailed(tokens, logprobs, {sampled[i]: "its probabilities are not finite (NaN or inf)"
                                            for i, b in enumerate(bad) if b})
    return tokens, logprobs


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, as torch's (the first index on ties; a NaN wins). On a CPU through
    numpy, whose argmax is vector code and torch's is not: 1 x 49152 logits 6 us against 82,
    16 rows 83 against 551 (the 2-vCPU EPYC, Zen 3)."""
    if x.device.type == "cpu":
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def _token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, tops: list[int]) -> list[TokenLogprob]:
    """Each row's chosen token's logprob and rank, and its top N (one host copy)."""
    own = raw.gather(1, tokens[:, None])
    rank = (raw >= own).sum(dim=-1, keepdim=True)   # vLLM's rank: tokens at least as likely, itself included
    columns = [own.double(), rank.double()]
    k = max(tops)
    if k:
        top_values, top_ids = raw.topk(k, dim=-1)
        columns += [top_values.double(), top_ids.double()]
    out = []
    for values, n in zip(torch.cat(columns, dim=1).tolist(), tops):
        top = tuple(zip(map(int, values[2 + k:2 + k + n]), values[2:2 + n]))
        out.append(TokenLogprob(values[0], int(values[1]), top))
    return out


class History:
    """The ids a penalised request's penalties read: its prompt's distinct ids and every
    output token. Kept by the sampler, which sees each token as it is sampled (with overlap
    the scheduler's output_ids lag a step); made at the request's first penalised sample from
    what it has by then (on decode, the first token that came with the KV)."""

    def __init__(self, req: Request):
        self.prompt = np.unique(np.asarray(req.prompt_ids, dtype=np.int64))
        self.output = np.empty(len(req.output_ids) + req.params.max_tokens + 1, dtype=np.int64)
        self.n = len(req.output_ids)
        self.output[:self.n] = req.output_ids

    def add(self, token: int) -> None:
        if self.n == len(self.output):  # a preempted request samples its last token again: keep room
            self.output = np.concatenate([self.output, np.empty_like(self.output)])
        self.output[self.n] = token
        self.n += 1

    @property
    def outputs(self) -> np.ndarray:
        return self.output[:self.n]

    def seen(self) -> np.ndarray:
        return np.concatenate([self.prompt, self.outputs])


def _history(req: Request) -> History:
    if req.history is None:
        req.history = History(req)
    return req.history


def _penalised_ids(req: Request) -> np.ndarray:
    """The ids whose logits the request's penalties change (repetition 1: its outputs only)."""
    history = _history(req)
    return history.seen() if req.params.repetition_penalty != 1 else history.outputs


def _pad(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ids padded to one width with a copy of the row's own first id (a scatter writes
    it the same value twice), and which entries are real. A row with no ids is all id 0."""
    width = max(1, max(len(a) for a in arrays))
    ids = np.zeros((len(arrays), width), dtype=np.int64)
    real = np.zeros((len(arrays), width), dtype=bool)
    for i, a in enumerate(arrays):
        if len(a):
            ids[i] = a[0]
            ids[i, :len(a)] = a
            real[i, :len(a)] = True
    return ids, real


def apply_penalties(logits: torch.Tensor, rows: list[int], requests: list[Request],
                    columns: np.ndarray | None = None) -> None:
    """In place on `rows` of logits [n, V], only at the ids each row has seen (gathered, then
    scattered back: no pass over the vocabulary): repetition as transformers and vLLM apply
    it (positive logits divided by it, the others multiplied) over prompt and output ids,
    then frequency x count and presence over output ids (OpenAI's, vLLM's definition).
    columns: the sorted ids that logits' columns hold, every id the rows' penalties change
    (`_best_seen`); None: the whole vocabulary."""
    device, dtype = logits.device, logits.dtype
    hists = [_history(req) for req in requests]
    # padding maps too: a row's own first id, or id 0 where a row has no outputs (which adds 0)
    at = (lambda ids: ids) if columns is None else (lambda ids: np.searchsorted(columns, ids))
    index = torch.tensor(rows, device=device)[:, None]
    column = lambda values: torch.tensor(values, dtype=dtype, device=device)[:, None]
    if any(req.params.repetition_penalty != 1 for req in requests):
        ids = torch.from_numpy(at(_pad([_penalised_ids(req) for req in requests])[0])).to(device)
        r = column([req.params.repetition_penalty for req in requests])
        v = logits[index, ids]
        logits[index, ids] = torch.where(v > 0, v / r, v * r)
    if any(req.params.presence_penalty or req.params.frequency_penalty for req in requests):
        ids, real = _pad([h.outputs for h in hists])
        ids, real = torch.from_numpy(at(ids)).to(device), torch.from_numpy(real).to(device)
        presence = column([req.params.presence_penalty * (h.n > 0) for req, h in zip(requests, hists)])
        frequency = column([req.params.frequency_penalty for req in requests])
        logits[index, ids] = logits[index, ids] - presence
        logits.index_put_((index.expand_as(ids), ids), -frequency * real, accumulate=True)


def _sample_rows(logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, min_p, top-k, top-p, then one draw per row by the Gumbel-max trick: argmax
    of logits - log(E), E ~ Exp(1), is a draw from softmax(logits). A row with a seed draws its
    noise from its own generator on the logits' device (a CPU generator cannot feed a CUDA
    tensor), so its tokens do not depend on its neighbours. Returns the tokens and which
    rows had no distribution to draw from."""
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype, device=device)
    x = logits / temperature[:, None]
    if any(r.params.min_p > 0 for r in requests):
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p); min_p 0 keeps every id
        floor = torch.tensor([r.params.min_p for r in requests], dtype=x.dtype, device=device).log()[:, None]
        x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + floor, float("-inf"))
    if any(r.params.top_k > 0 or r.params.top_p < 1 for r in requests):
        x = _top_k_top_p(x, requests)
    noise = torch.empty_like(x)
    for row, req in enumerate(requests):
        noise[row].exponential_(generator=_generator(req, device))
    inf = float("inf")
    failed = torch.isnan(x).any(dim=-1) | (x == inf).any(dim=-1) | (x == -inf).all(dim=-1)
    return argmax_rows(x - noise.log()), failed


def _top_k_top_p(x: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Keep each row's top_k highest logits, then the smallest set whose probability
    reaches top_p; -inf elsewhere (one sort for all rows)."""
    vocab = x.shape[-1]
    top_k = torch.tensor([r.params.top_k or vocab for r in requests], device=x.device)
    top_p = torch.tensor([r.params.top_p for r in requests], dtype=x.dtype, device=x.device)
    ordered, order = x.sort(dim=-1, descending=True)
    drop = torch.arange(vocab, device=x.device)[None, :] >= top_k[:, None]
    ordered = ordered.masked_fill(drop, float("-inf"))
    probs = ordered.softmax(-1)
    drop |= probs.cumsum(-1) - probs >= top_p[:, None]
    return torch.full_like(x, float("-inf")).scatter(1, order, ordered.masked_fill(drop, float("-inf")))


def _generator(req: Request, device: torch.device) -> torch.Generator | None:
    """The request's own generator, made on the device that samples it, or None (the default)."""
    if req.params.seed is None:
        return None
    if req.generator is None or req.generator.device != device:
        req.generator = torch.Generator(device=device).manual_seed(req.params.seed)
    return req.generator
