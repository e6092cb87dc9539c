"""Attention backends behind one interface (kernels.base), chosen by name.

Heavy imports (triton, flashinfer) happen inside the factory, so a machine
without a GPU never imports a GPU library.
"""
from __future__ import annotations

import importlib.util

import torch

from kernels.base import AttentionBackend, AttentionMetadata

BACKENDS = ("auto", "torch", "cpu", "triton", "flashinfer")


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name != "auto":
        return name
    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    if device.type == "cpu":
        from kernels import cpu_backend
        return "cpu" if cpu_backend.available() else "torch"
    # the project's own paged kernels, rather than the torch path that gathers the pages first
    return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    name = resolve_backend_name(name, device)
    if name == "torch":
        from kernels.torch_ref import TorchAttention
        return TorchAttention()
    if name == "cpu":
        from kernels.cpu_backend import CpuAttention
        return CpuAttention()
    if name == "triton":
        from kernels.triton_backend import TritonAttention
        return TritonAttention()
    from kernels.flashinfer_backend import FlashinferAttention
    return FlashinferAttention(device)


__all__ = ["AttentionBackend", "AttentionMetadata", "create_backend", "resolve_backend_name"]
