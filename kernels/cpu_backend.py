"""CPU serving backend: TorchAttention with decodes run by a C kernel (csrc/decode_attention.c).

The padded-SDPA decode of TorchAttention copies every decode's pages out before
it attends (index_select), which on the default model at 16 streams was a
quarter of the engine's time; the kernel reads the pages in place. Prefill
chunks keep TorchAttention's SDPA path (compute-bound, already one call each).

The library is compiled on first use with the machine's C compiler
(-march=native, so for the CPU it runs on) into a cache keyed by the source,
the flags and the CPU, and loaded with ctypes: no torch headers, builds in
about a second. `available()` says whether that worked; `auto` falls back to
the torch backend when it did not.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
from functools import lru_cache
from pathlib import Path

import torch  # before the library: its libgomp.so.1 is the one the kernel's OpenMP binds to

from kernels.torch_ref import TorchAttention, TorchPlan

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
ARGTYPES = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _ptr]


def cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "tandem"


def _cpu_id() -> bytes:
    """The CPU's model and flags: a library built with -march=native is only valid there."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))})).encode()


def build(out_dir: Path | None = None) -> Path:
    """Compile the kernel if this source, these flags and this CPU have no library yet; its path."""
    cc = os.environ.get("CC", "gcc")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *FLAGS]).encode() + _cpu_id()).hexdigest()[:16]
    lib = (out_dir or cache_dir()) / f"decode_attention-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
    done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building {SOURCE.name} with {cc} failed:\n{done.stderr.strip()}")
    os.replace(tmp, lib)  # atomic: engines starting together never load a half-written file
    return lib


@lru_cache(maxsize=None)
def load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    lib.decode_attention_f32.argtypes = ARGTYPES
    lib.decode_attention_f32.restype = ctypes.c_int
    return lib


def available() -> bool:
    try:
        load()
        return True
    except (OSError, RuntimeError) as exc:
        log.warning("CPU attention kernel unavailable, using the torch backend: %s", exc)
        return False


class CpuAttention(TorchAttention):
    name = "cpu"

    def __init__(self):
        self._kernel = load().decode_attention_f32

    def _decode(self, q, k_cache, v_cache, plan: TorchPlan, scale: float) -> torch.Tensor:
        bd, hq, dim = q.shape
        if q.dtype != torch.float32 or q.device.type != "cpu" or q.stride(2) != 1 or q.stride(1) != dim \
                or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return TorchAttention._decode(q, k_cache, v_cache, plan, scale)
        d = plan.decodes
        out = torch.empty((bd, hq, dim), dtype=q.dtype)
        rc = self._kernel(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), d.pages.data_ptr(),
                          d.num_pages, d.lens.data_ptr(), bd, hq, k_cache.shape[2], dim, k_cache.shape[1],
                          scale, out.data_ptr())
        if rc != 0:
            raise MemoryError("decode attention: no memory for the scores buffer")
        return out
