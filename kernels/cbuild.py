"""Build and load the C kernels of kernels/csrc for the CPU this process runs on.

Each source is compiled on first use with the machine's C compiler (-march=native,
OpenMP) into a cache keyed by the source, the flags and the CPU, and opened with
ctypes: no torch headers, about a second per file. The OpenMP team is torch's:
torch is imported first, so its libgomp.so.1 is the one the library binds to and
the kernels never compete with a second thread pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
from functools import lru_cache
from pathlib import Path

import torch  # noqa: F401  (before any library: see the module docstring)

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# -fno-trapping-math: with GCC's default (-ftrapping-math) a float compare-and-select is a
# branch, so every loop through vexp.h's clamp (SiLU, the softmax) stayed scalar. It changes
# no value (no reassociation, no contraction: those are other flags), only whether an FP
# exception flag is treated as observable, and no kernel reads those flags.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-shared", "-fPIC"]


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


def compiler() -> str:
    """The C compiler the kernels are built with: $CC, else gcc."""
    return os.environ.get("CC", "gcc")


def build(source: Path, out_dir: Path | None = None) -> Path:
    """Compile `source` unless this source, the other sources of its directory, these flags and
    this CPU have a library; its path."""
    cc = compiler()
    # What it may include: the headers, and the kernels decoder.c compiles into itself.
    others = sorted(p for p in source.parent.iterdir() if p.suffix in (".h", ".c") and p != source)
    headers = b"".join(p.read_bytes() for p in others)
    key = hashlib.sha256(source.read_bytes() + headers + " ".join([cc, *FLAGS]).encode() + _cpu_id()).hexdigest()[:16]
    lib = (out_dir or cache_dir()) / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
    done = subprocess.run([cc, *FLAGS, str(source), "-o", str(tmp), "-lm"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building {source.name} with {cc} failed:\n{done.stderr.strip()}")
    os.replace(tmp, lib)  # atomic: engines starting together never load a half-written file
    return lib


# Settings of csrc/panel_gemm.c that every library compiling it in (panel_gemm, decoder,
# screen_head) must hold alike, or a GEMM and the decoder's copy of it would differ: symbol -> the
# function that decides it, run once a process in the first such library opened.
SHARED = {"panel_bf16_wide_min_rows": "panel_bf16_wide_choice"}
_shared: dict[str, int] = {}
_opened: list[ctypes.CDLL] = []


@lru_cache(maxsize=None)
def _open(name: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build(CSRC / f"{name}.c")))
    for symbol, decide in SHARED.items():
        if hasattr(lib, decide):
            if symbol not in _shared:
                _shared[symbol] = getattr(lib, decide)()
            ctypes.c_int.in_dll(lib, symbol).value = _shared[symbol]
    _opened.append(lib)
    return lib


def shared_setting(symbol: str, value: int | None = None) -> int:
    """A SHARED setting as decided (opening panel_gemm to decide it); then set to `value`, where
    given, in every library open now and opened later (tests and A/B timings compare both sides)."""
    _open("panel_gemm")
    decided = _shared[symbol]
    if value is not None:
        _shared[symbol] = value
        for lib in _opened:
            if hasattr(lib, SHARED[symbol]):
                ctypes.c_int.in_dll(lib, symbol).value = value
    return decided


def load(name: str, signatures: dict[str, tuple]) -> ctypes.CDLL:
    """csrc/<name>.c built and opened; each function of `signatures` (name -> argtypes)
    declared, all of them returning int."""
    lib = _open(name)
    for fn, argtypes in signatures.items():
        getattr(lib, fn).argtypes, getattr(lib, fn).restype = list(argtypes), ctypes.c_int
    return lib


def available(name: str, signatures: dict[str, tuple]) -> bool:
    try:
        load(name, signatures)
        return True
    except (OSError, RuntimeError) as exc:
        log.warning("C kernel %s unavailable: %s", name, exc)
        return False
