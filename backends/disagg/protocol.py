"""What prefill and decode engines tell each other, and the metadata row.

Messages travel as NIXL notifications (JSON). Every message names its
bootstrap room, and a receiver acts only on rooms it knows, so no request can
ever take another's KV:

    decode -> prefill   queued    room: no KV free here yet, the dest follows (prefill waits without a timeout)
    decode -> prefill   dest      room, pages, slot, prompt_len, cached_tokens: where to write; decode
                                  holds the first cached_tokens (whole pages) of the prompt already,
                                  and `pages` are those of the rest
    decode -> prefill   abort     room: the decode side gave the request up
    decode -> prefill   ping      room 0: is the prefill engine still there (a failed send says no)
    prefill -> decode   done      room: KV and metadata have landed (the meta write's notification)
    prefill -> decode   error     room, msg: the prefill side failed or refused the room
    prefill -> decode   released  room: no write for this room is in flight any more; it follows
                                  every error and answers every abort, and only then may decode
                                  give the room's pages to another request

The metadata row (int64) is written into the decode engine's slot after the
last KV write: room, first token, its logprob (float64 bits), prompt length,
the logprob's rank, how many top logprobs follow, then (id, logprob bits) pairs.
"""
from __future__ import annotations

import json
import struct

import torch

from backends.request import MAX_LOGPROBS, TokenLogprob

META_WIDTH = 6 + 2 * MAX_LOGPROBS


def encode(kind: str, room: int, **fields) -> bytes:
    return json.dumps({"kind": kind, "room": room, **fields}, separators=(",", ":")).encode()


def decode(data: bytes) -> dict | None:
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return msg if isinstance(msg, dict) and "kind" in msg and "room" in msg else None


def new_meta_buffer(slots: int) -> torch.Tensor:
    return torch.zeros((slots, META_WIDTH), dtype=torch.int64)


def _bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def write_meta_row(meta: torch.Tensor, slot: int, room: int, token: int, logprob: TokenLogprob,
                   prompt_len: int) -> None:
    top = [x for tid, value in logprob.top for x in (tid, _bits(value))]
    row = [room, token, _bits(logprob.logprob), prompt_len, logprob.rank, len(logprob.top), *top]
    meta[slot] = torch.tensor(row + [0] * (META_WIDTH - len(row)), dtype=torch.int64)


def read_meta_row(meta: torch.Tensor, slot: int) -> tuple[int, int, TokenLogprob, int]:
    room, token, bits, prompt_len, rank, n, *top = meta[slot].tolist()
    pairs = tuple((top[2 * i], _float(top[2 * i + 1])) for i in range(min(n, MAX_LOGPROBS)))
    return room, token, TokenLogprob(_float(bits), rank, pairs), prompt_len


class SlotPool:
    """Metadata slots of one engine."""

    def __init__(self, count: int):
        self.free = list(range(count - 1, -1, -1))

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def give(self, slot: int) -> None:
        self.free.append(slot)
