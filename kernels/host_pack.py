"""A step's integer arrays in one host buffer, copied to the device at once.

Made one tensor each, a step's lists (token ids, positions, page table, slots, the
attention's per-sequence arrays) were about ten blocking copies from pageable memory
on a GPU. Packed, they fill one pinned buffer and go in one non-blocking copy; each
array is a view of the device copy. On the CPU (`packed` False) every array stays the
plain tensor it always was: there is nothing to copy, and pinning needs CUDA.

Every array starts at a multiple of ALIGN bytes: a Triton kernel is specialized on
whether a pointer is 16-byte aligned, so a view at an odd offset would compile another
variant of it while serving.
"""
from __future__ import annotations

import numpy as np
import torch

ALIGN = 16
NUMPY = {torch.long: np.int64, torch.int32: np.int32}


class IntPack:
    """add() the arrays, then send() once. Arrays are named; send returns name -> tensor."""

    def __init__(self, device: torch.device | str, packed: bool | None = None):
        self.device = torch.device(device)
        self.packed = self.device.type == "cuda" if packed is None else packed
        self.parts: list[tuple[str, list[int], torch.dtype, tuple[int, ...]]] = []
        self.copies = 0  # host -> device copies made by send (what the tests count)

    def add(self, name: str, values: list[int] | torch.Tensor, dtype: torch.dtype,
            shape: tuple[int, ...] | None = None) -> None:
        """values flat (a list or a 1-D CPU tensor); shape (default [len(values)]) is the view
        send gives back."""
        shape = (len(values),) if shape is None else tuple(shape)
        if len(values) != _numel(shape):
            raise ValueError(f"{name}: expected {_numel(shape)} values for shape {shape}, got {len(values)}")
        self.parts.append((name, values, dtype, shape))

    def layout(self) -> list[tuple[str, int, int]]:
        """(name, byte offset, byte length) of every array in the buffer."""
        out, offset = [], 0
        for name, values, dtype, _ in self.parts:
            length = len(values) * dtype.itemsize
            out.append((name, offset, length))
            offset += -(-length // ALIGN) * ALIGN
        return out

    @property
    def nbytes(self) -> int:
        return max(ALIGN, sum(-(-length // ALIGN) * ALIGN for _, _, length in self.layout()))

    def host(self) -> torch.Tensor:
        """The filled host buffer [nbytes] uint8, pinned when the device is CUDA."""
        buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        for (_, values, dtype, _), (_, offset, length) in zip(self.parts, self.layout()):
            if length:
                buf[offset:offset + length].view(dtype).copy_(torch.as_tensor(values, dtype=dtype))
        return buf

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every array as a view of `buf` (a buffer of this layout, on any device)."""
        return {name: buf[offset:offset + length].view(dtype).view(shape)
                for (name, _, dtype, shape), (_, offset, length) in zip(self.parts, self.layout())}

    def send(self, into: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The arrays on the device: one copy of the host buffer (into `into` when given, a
        buffer of at least nbytes), or plain tensors when not packed."""
        if not self.packed:
            return {name: self._plain(values, dtype, shape) for name, values, dtype, shape in self.parts}
        return self.views(self.copy(self.host(), into))

    def _plain(self, values: list[int] | torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        # A list through numpy: torch.as_tensor(list).view() cost 15 us an array on the 2-vCPU
        # EPYC, ten arrays a step; numpy's 3 us. A .to() that moves nothing still cost 4 us.
        if isinstance(values, torch.Tensor) or dtype not in NUMPY:
            t = torch.as_tensor(values, dtype=dtype).view(shape)
        else:
            t = torch.from_numpy(np.asarray(values, dtype=NUMPY[dtype]).reshape(shape))
        return t if self.device.type == "cpu" else t.to(self.device)

    def copy(self, host: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """host (from host()) to the device without waiting for it: stream-ordered before
        every kernel launched after it."""
        self.copies += 1
        if into is None:
            return host.to(self.device, non_blocking=True)
        return into[:host.numel()].copy_(host, non_blocking=True)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def scatter(target: torch.Tensor, index: list[int], values: list[int], packed: bool | None = None) -> None:
    """target[index] = values for a 1-D device tensor: both lists in one copy (IntPack's packing)."""
    pack = IntPack(target.device, packed)
    pack.add("index", index, torch.long)
    pack.add("values", values, target.dtype)
    t = pack.send()
    target.index_copy_(0, t["index"], t["values"])
