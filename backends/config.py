"""Engine configuration: one frozen dataclass, built from `config.pbtxt` parameters.

Every knob has a default here; the table in the README is generated from the
same defaults (`python -m backends.config`).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field, fields

import torch

from backends.cores import parse_cores
from backends.parameters import typed_parameter

ROLES = ("colocated", "prefill", "decode")
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}  # kv_cache_dtype
DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 "models", "SmolLM2-135M-Instruct")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str = field(default=DEFAULT_MODEL_DIR, metadata={
        "doc": "Hugging Face checkpoint directory; TANDEM_MODEL_PATH overrides it"})
    role: str = field(default="colocated", metadata={"doc": "colocated, prefill or decode (set by each model)"})
    device: str = field(default="auto", metadata={
        "doc": "auto (cuda if present, else cpu; TANDEM_DEVICE overrides auto), cpu, cuda or cuda:N"})
    dtype: str = field(default="auto", metadata={
        "doc": "auto (TANDEM_DTYPE overrides it): cuda bf16; cpu the checkpoint's own dtype where the CPU has "
               "AVX-512 BF16, AVX-512 VNNI, or AVX2 without AVX-512 (a bf16 or fp16 checkpoint runs in bf16, an "
               "fp32 one in fp32), else fp32; float32, bfloat16 or float16. On cpu bfloat16 means bf16 weights with fp32 activations "
               "(the KV: kv_cache_dtype)"})
    weights: str = field(default="auto", metadata={
        "doc": "auto (the dtype's; TANDEM_WEIGHTS overrides it) or int8: symmetric int8 weights with an fp16 scale "
               "per 32 weights of a row (as Q8_0), fp32 activations (cpu with AVX2 and FMA, or AVX-512 BF16)"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "doc": "auto (TANDEM_KV_CACHE_DTYPE overrides it): cpu bf16 under bf16 or int8 weights (as vLLM keeps a "
               "bf16 model's KV in bf16 and llama.cpp its KV in f16), else the activations' dtype; float32; "
               "bfloat16: half the memory a token takes and half the bytes attention reads, each K/V value "
               "rounded once as it is stored (cpu: the C attention kernel; cuda: dtype bfloat16)"})
    attention_backend: str = field(default="auto", metadata={
        "doc": "auto (GPU: flashinfer where it imports, else the Triton kernels; CPU: the C decode kernel where it builds, "
               "else torch), torch, cpu, triton or flashinfer"})
    page_size: int = field(default=16, metadata={"doc": "tokens per KV page"})
    num_pages: int = field(default=0, metadata={
        "doc": "KV pages in the pool; 0 = enough for max_running_requests full contexts, capped by kv_memory_gb"})
    kv_memory_gb: float = field(default=0.5, metadata={
        "doc": "KV pool cap when num_pages is 0 (per engine: the default repository runs three)"})
    max_batch_tokens: int = field(default=0, metadata={
        "doc": "token budget of one step (decodes + prefill chunks); 0 = auto: on cpu every decode plus 128 "
               "prompt tokens, on cuda 2048 (at least max_running_requests)"})
    chunk_size: int = field(default=512, metadata={"doc": "most prompt tokens of one request in one step (chunked prefill)"})
    max_running_requests: int = field(default=64, metadata={"doc": "most requests in the running batch"})
    max_context: int = field(default=0, metadata={"doc": "longest prompt + output; 0 = the model's max_position_embeddings"})
    default_max_tokens: int = field(default=256, metadata={"doc": "max_tokens when a request gives none"})
    threads: int = field(default=0, metadata={"doc": "torch CPU threads; 0 = one per core of cpu_cores"})
    cpu_cores: str = field(default="", metadata={
        "doc": "cpu: the cores this engine runs on, e.g. 0-3,8; \"\" = every core the server may use"})
    core_turns: str = field(default="auto", metadata={
        "doc": "cpu: on = take turns at shared cores with the other engines of this host (one forward at a "
               "time, prefill first); off; auto = on for prefill and decode, off for colocated"})
    dp_size: int = field(default=1, metadata={
        "doc": "DP attention: ranks (processes) behind this model instance, each with its own scheduler, "
               "requests and KV pool (num_pages and kv_memory_gb are per rank); attention runs per rank, "
               "the MLP is split across them. cpu: the ranks split cpu_cores, at most one rank per core; "
               "cuda: rank i on cuda:i. 1 = no DP"})
    engine_process: str = field(default="auto", metadata={
        "doc": "own = the engine runs in a process of its own and the model's Python stub only checks, tokenizes "
               "and streams (the stub's response sends then share no interpreter lock with the engine's step); "
               "stub = in the stub's process; auto = own on cuda, stub on cpu (docs/gpu.md)"})
    stream_backlog: int = field(default=8, metadata={
        "doc": "outputs of one stream that may wait behind its send to Triton, each sent as a response of its own; "
               "when more wait (the server lags behind the engine), they go out as one response carrying all their "
               "tokens, as vLLM's AsyncLLM merges a lagging reader's outputs; 0 = merge whatever waits"})
    dllm_threshold: float = field(default=0.95, metadata={
        "doc": "block-diffusion models: a masked position is revealed when its confidence reaches this "
               "(0 < t <= 1; 1 reveals one position a step)"})
    dllm_mixed_batches: str = field(default="off", metadata={
        "doc": "block-diffusion models: on = prefill and denoising work share steps (for comparison; off "
               "keeps them apart)"})
    overlap: str = field(default="auto", metadata={
        "doc": "on = the next step is scheduled and launched while the last one's tokens are streamed (a "
               "forward thread runs the steps, a decode's input token is resolved when its step starts; after a "
               "step of plain greedy rows, from its tokens on the device, without waiting for the host); off; "
               "auto = on on cuda (measured faster there, docs/gpu.md), off on cpu and for block-diffusion models"})
    prefix_caching: str = field(default="auto", metadata={
        "doc": "reuse the KV of prompt prefixes computed before (full pages, matched by their tokens): on; off; "
               "auto = on. decode: the prompt pages it already holds (received or decoded for an earlier "
               "request) are not sent again by prefill"})
    cuda_graphs: str = field(default="auto", metadata={
        "doc": "decode steps replayed as CUDA graphs captured at load, one per batch-size bucket (1, 2, 4, 8, "
               "then every 8 to max_running_requests; larger batches and prefill steps run eagerly): on; off; "
               "auto = on on cuda with the triton attention backend, off elsewhere (on is refused there)"})

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        for name in ("page_size", "chunk_size", "max_running_requests", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.core_turns not in ("auto", "on", "off"):
            raise ValueError(f"core_turns must be auto, on or off, got {self.core_turns!r}")
        if not 0 < self.dllm_threshold <= 1:
            raise ValueError(f"dllm_threshold must be > 0 and <= 1, got {self.dllm_threshold!r}")
        if self.dllm_mixed_batches not in ("on", "off"):
            raise ValueError(f"dllm_mixed_batches must be on or off, got {self.dllm_mixed_batches!r}")
        if self.overlap not in ("auto", "on", "off"):
            raise ValueError(f"overlap must be auto, on or off, got {self.overlap!r}")
        if self.prefix_caching not in ("auto", "on", "off"):
            raise ValueError(f"prefix_caching must be auto, on or off, got {self.prefix_caching!r}")
        if self.weights not in ("auto", "int8"):
            raise ValueError(f"weights must be auto or int8, got {self.weights!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto, float32 or bfloat16, got {self.kv_cache_dtype!r}")
        if self.engine_process not in ("auto", "own", "stub"):
            raise ValueError(f"engine_process must be auto, own or stub, got {self.engine_process!r}")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs must be auto, on or off, got {self.cuda_graphs!r}")
        parse_cores(self.cpu_cores)
        self._check_dp_size()
        if self.num_pages < 0 or self.threads < 0 or self.max_context < 0 or self.max_batch_tokens < 0:
            raise ValueError("num_pages, threads, max_context and max_batch_tokens must be >= 0")
        if self.stream_backlog < 0:
            raise ValueError(f"stream_backlog must be >= 0, got {self.stream_backlog}")

    def _check_dp_size(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.dp_size == 1:
            return
        if self.torch_device.type == "cpu" and self.dp_size > len(self.cores):
            raise ValueError(f"dp_size {self.dp_size} is more ranks than the {len(self.cores)} cores this engine "
                             f"may use (cpu_cores {self.cpu_cores or 'all'}): at most one rank per core")
        if self.torch_device.type == "cuda" and self.dp_size > torch.cuda.device_count():
            raise ValueError(f"dp_size {self.dp_size} is more ranks than the {torch.cuda.device_count()} GPUs")

    @property
    def own_process(self) -> bool:
        """Whether the engine runs in a process of its own (DP ranks always do)."""
        if self.engine_process == "auto":
            return self.torch_device.type == "cuda"
        return self.engine_process == "own"

    @property
    def overlaps(self) -> bool:
        """Whether steps overlap, as the device decides `auto`; the scheduler keeps a block-diffusion
        model's steps apart all the same (`on` is refused for one at load)."""
        if self.overlap == "auto":
            return self.torch_device.type == "cuda"
        return self.overlap == "on"

    def for_rank(self, rank: int) -> "EngineConfig":
        """One DP rank's engine: its share of the cores (cpu) or its own GPU (cuda)."""
        if self.dp_size == 1:
            return self
        if self.torch_device.type == "cuda":
            return self.replace(dp_size=1, device=f"cuda:{rank}")
        cores, n = self.cores, self.dp_size
        share = cores[rank * len(cores) // n:(rank + 1) * len(cores) // n]  # neighbours stay together
        threads = max(1, self.threads // n) if self.threads else 0
        return self.replace(dp_size=1, cpu_cores=",".join(map(str, share)), threads=threads)

    def context_limit(self, max_position: int) -> int:
        """The longest prompt + output for a model of `max_position` positions."""
        return min(self.max_context or max_position, max_position)

    @staticmethod
    def from_params(params: dict[str, str], **overrides) -> "EngineConfig":
        """From Triton's string parameters; unknown names are refused, blanks keep defaults."""
        known = {f.name: f for f in fields(EngineConfig)}
        values = {}
        for name, text in params.items():
            if name not in known:
                continue  # parameters of the adapter itself (e.g. transfer knobs) are not engine knobs
            if text.strip() == "":
                continue
            values[name] = typed_parameter(name, text, known[name].default)
        values.update(overrides)
        if os.environ.get("TANDEM_MODEL_PATH"):
            values["model_path"] = os.environ["TANDEM_MODEL_PATH"]
        return EngineConfig(**values)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @functools.cached_property  # read every step (step_budget); torch.cuda.is_available() is not free
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            # TANDEM_DEVICE pins `auto` (the test suite sets cpu: its references are fp32 on the CPU)
            chosen = os.environ.get("TANDEM_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
            return torch.device(chosen)
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        name = self.dtype
        if name == "auto":
            # TANDEM_DTYPE pins `auto` too (TANDEM_DEVICE=cuda TANDEM_DTYPE=float32: the suite's
            # fp32 references hold on a GPU)
            name = os.environ.get("TANDEM_DTYPE") or ("bfloat16" if self.torch_device.type == "cuda"
                                                      else cpu_auto_dtype(self.model_path))
        if name not in dtypes:
            what = "TANDEM_DTYPE" if self.dtype == "auto" else "dtype (or auto)"
            raise ValueError(f"{what} must be one of {list(dtypes)}, got {name!r}")
        return dtypes[name]

    @property
    def weights_kind(self) -> str:
        """auto or int8, TANDEM_WEIGHTS pinning auto (one benchmark run can serve each kind)."""
        name = self.weights if self.weights != "auto" else os.environ.get("TANDEM_WEIGHTS") or "auto"
        if name not in ("auto", "int8"):
            raise ValueError(f"TANDEM_WEIGHTS must be auto or int8, got {name!r}")
        return name

    def kv_dtype(self, auto: torch.dtype) -> torch.dtype:
        """The KV cache's dtype, `auto` standing for auto (the runner's choice): kv_cache_dtype,
        TANDEM_KV_CACHE_DTYPE pinning auto (one benchmark run can serve each)."""
        name = self.kv_cache_dtype
        if name == "auto":
            name = os.environ.get("TANDEM_KV_CACHE_DTYPE") or "auto"
        if name not in KV_CACHE_DTYPES:
            raise ValueError(f"TANDEM_KV_CACHE_DTYPE must be auto, float32 or bfloat16, got {name!r}")
        return auto if name == "auto" else KV_CACHE_DTYPES[name]

    def step_budget(self, decodes: int) -> int:
        """The token budget of a step that has `decodes` running decodes. On CPU a prefill
        costs the same per token in chunks of 128 as of 512, and small chunks let the waiting
        requests start sooner: through tritonserver TTFT p50 at 8 and 16 streams went 389 / 487
        and 789 / 646 ms -> 283 / 235 and 393 / 345 ms at the same tok/s. The decodes come on
        top of the 128, so a 128-token prompt is one step, not two: with 8 decodes, 136 tokens
        instead of 128 took TTFT p50 at 8 streams 385 / 386 -> 261 / 271 ms, ITL +1 ms. A GPU
        wants big prefill steps to fill its cores. Auto never leaves a running decode out. The
        prefill role uses the same rule: 512-token steps there batched the prompts of a burst into
        one long step, and `router` at 8 streams (AMD EPYC, 2 cores) went from 166.9 tok/s and
        TTFT p50 1431 ms to 188.2 tok/s and 769 ms with 128; a chunk's KV write still overlaps
        the next chunk's compute."""
        if self.max_batch_tokens:
            return self.max_batch_tokens
        if self.torch_device.type == "cuda":
            return max(2048, self.max_running_requests)
        return decodes + 128

    @property
    def cores(self) -> list[int]:
        return parse_cores(self.cpu_cores)

    @property
    def num_threads(self) -> int:
        return self.threads or len(self.cores)

    @property
    def caches_prefixes(self) -> bool:
        return self.prefix_caching != "off"

    @property
    def takes_turns(self) -> bool:
        if self.torch_device.type != "cpu":
            return False
        return self.core_turns == "on" or (self.core_turns == "auto" and self.role != "colocated")


def dtype_name(dtype: torch.dtype) -> str:
    """float32, bfloat16, ...: a torch dtype as the parameters and messages spell it."""
    return str(dtype).removeprefix("torch.")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_has_bf16() -> bool:
    """Whether the bf16 and int8 panel GEMMs build here (kernels/csrc/panel_gemm.c): AVX-512 BF16,
    else AVX2 and FMA (an AVX-512 CPU without its BF16 takes 16-lane forms with VNNI, the AVX2 ones
    without)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or {"avx2", "fma"} <= flags


def cpu_prefers_bf16() -> bool:
    """Whether `dtype auto` runs a bf16 checkpoint in bf16 here: where the bf16 form was measured
    ahead of fp32 (AVX-512 BF16; AVX-512 VNNI without its BF16, whose bf16 form is 16 lanes wide;
    AVX2 without AVX-512). Skylake-SP (AVX-512 without VNNI) would take the 8-lane AVX2 form
    against fp32's 16-lane one, not measured: fp32."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or {"avx512f", "avx512bw", "avx512_vnni"} <= flags \
        or ({"avx2", "fma"} <= flags and "avx512f" not in flags)


def cpu_auto_dtype(model_path: str) -> str:
    """`dtype auto` on a CPU: the checkpoint's own dtype, as vLLM follows it, where the CPU can run
    bf16 (a bf16 or fp16 checkpoint in bf16); fp32 elsewhere, and for an fp32 checkpoint, whose
    tokens then stay transformers' fp32 ones (docs/cpu.md)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return "float32"
    own = raw.get("torch_dtype") or raw.get("dtype")
    return "bfloat16" if own in ("bfloat16", "float16") and cpu_prefers_bf16() else "float32"


def parameter_table() -> str:
    rows = ["| parameter | default | meaning |", "|---|---|---|"]
    for f in fields(EngineConfig):
        default = "models/SmolLM2-135M-Instruct" if f.name == "model_path" else f.default
        rows.append(f"| `{f.name}` | `{default}` | {f.metadata['doc']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(parameter_table())
