"""bf16 and int8 weights on the CPU path (`dtype: bfloat16`, `weights: int8` on cpu): the panel
GEMMs against an exact reference, and every tiny architecture's engine against the fp32 engine
the way `make gpu-check` checks CUDA bf16: greedy ids equal wherever fp32's top-2 margin
exceeds twice the measured error (here measured at each position), first-step logits within
twice it (plus 0.1 % of their scale). The error is measured per kind on transformers' own forward against its fp32 one:
bf16 that model in bf16; int8 the fp32 model with every matmul weight rounded per group of 32 k to
int8 and back (the lm_head untied from the embedding, which the engine keeps as it is)."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from backends.config import EngineConfig, cpu_flags
from client import gpu_check
from client.gpu_check import NEW_TOKENS, first_logits, greedy, prompts
from kernels import cbuild
from kernels.decoder import CpuDecoder
from kernels.greedy_head import ArgmaxHead, PairsScreenedHead, ScreenedHead
from kernels.linear import (INT8_GROUP, PANEL, SIGNATURES, Bf16PanelLinear, Int8PanelLinear, PanelLinear, int8_groups,
                            pack_bf16, pack_int8, panel_amx_min_rows, panel_bf16_wide_min_rows)
from tests.checkpoints import configs

ARCHS = sorted(configs())


def bf16_runs_here() -> bool:
    return cbuild.available("panel_gemm", SIGNATURES) and Bf16PanelLinear().runs_here()


needs_bf16 = pytest.mark.skipif(not bf16_runs_here(), reason="this CPU has neither AVX-512 BF16 nor AVX2 and FMA")
# The AVX-512 BF16 form rounds the rows to bf16 (vdpbf16ps's operand), except from
# panel_bf16_wide_min_rows rows where this CPU's vdpbf16ps is slow; the AVX2 form (also an AVX-512
# CPU's without its BF16) and that widened form keep them fp32.
ROWS_BF16 = "avx512_bf16" in cpu_flags()


def as_taken(x: torch.Tensor) -> torch.Tensor:
    """The rows in fp64 as the bf16 panel GEMM off the tiles multiplies them."""
    wide = panel_bf16_wide_min_rows()
    rounded = ROWS_BF16 and not (wide and x.shape[0] >= wide)
    return x.bfloat16().double() if rounded else x.double()


@needs_bf16
@pytest.mark.parametrize("rows,out,inp", [(1, 49, 577), (3, 96, 64), (8, 100, 31), (9, 48, 130), (17, 1000, 576),
                                          (16, 96, 577), (33, 144, 100), (64, 48, 32),
                                          (130, 50, 1536)])
@pytest.mark.parametrize("tiles", ["vdpbf16ps", "amx", "wide"])
def test_bf16_panel_gemm_is_the_bf16_product_in_fp32(rows, out, inp, tiles):
    """Every product of the row (rounded to bf16 but in the AVX2 and widened forms) and the rounded
    weight, summed in fp32: within fp32's summation error of the fp64 sum of the same values; rows
    with a stride and a bias; as this CPU runs it, on AMX tiles from the first row (rows short of a
    group of 16 as zero rows; a k tail and a partial last panel take vdpbf16ps within the tiles'
    call), and with AVX-512 BF16 widened to fp32 FMAs from the first row (fp32 rows)."""
    if tiles == "amx" and not Bf16PanelLinear().amx_ready():
        pytest.skip("this CPU (or kernel) gives no AMX tiles")
    if tiles == "wide" and not ROWS_BF16:
        pytest.skip("without AVX-512 BF16 every bf16 GEMM is widened: the vdpbf16ps case is that one")
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inp + 5, generator=gen)[:, 2:2 + inp]
    w, bias = torch.randn(out, inp, generator=gen), torch.randn(out, generator=gen)
    lin = Bf16PanelLinear()
    shipped, wide = panel_amx_min_rows(1 if tiles == "amx" else 0), panel_bf16_wide_min_rows()
    if tiles == "wide":
        panel_bf16_wide_min_rows(1)
    try:
        y = lin(x, lin.prepare(w), bias)
        xr = {"amx": x.bfloat16().double(), "wide": x.double()}.get(tiles, as_taken(x))
    finally:
        panel_amx_min_rows(shipped)
        panel_bf16_wide_min_rows(wide)
    want = xr @ w.bfloat16().double().T + bias.double()
    scale = xr.abs() @ w.bfloat16().double().abs().T
    assert y.dtype == torch.float32 and y.shape == (rows, out)
    assert ((y.double() - want).abs() <= inp * 2 ** -23 * scale + 1e-6).all()


def int16_rows(x: torch.Tensor) -> torch.Tensor:
    """x as csrc/panel_gemm.c's rows_to_i16 makes it (fp32 arithmetic, round half to even), in fp64."""
    rows, inp = x.shape
    groups = -(-inp // INT8_GROUP)
    padded = torch.nn.functional.pad(x, (0, groups * INT8_GROUP - inp)).view(rows, groups, INT8_GROUP)
    top = padded.abs().amax(dim=2, keepdim=True)
    inv = torch.where(top > 0, torch.tensor(32767.0) / top, torch.tensor(0.0))
    q = (padded * inv).round().clamp(-32768, 32767)
    return (q.double() * (top / 32767).double()).view(rows, -1)[:, :inp]


def fp16_at_or_above(x: torch.Tensor) -> torch.Tensor:
    """The least fp16 at or above each x (the smallest subnormal at least), as fp32: the int8
    scale the kernels read."""
    h = x.numpy().astype(np.float16)
    h = np.where(h.astype(np.float32) < x.numpy(), np.nextafter(h, np.float16(np.inf)), h)
    return torch.from_numpy(np.maximum(h, np.float16(2 ** -24)).astype(np.float32))


@needs_bf16
@pytest.mark.parametrize("rows,out,inp", [(1, 49, 577), (3, 96, 64), (5, 100, 31), (8, 100, 31), (17, 1000, 576),
                                          (130, 50, 1536)])
@pytest.mark.parametrize("tiles", ["int16", "amx"])
def test_int8_panel_gemm_is_the_product_of_the_group_scaled_weights(rows, out, inp, tiles):
    """Off the tiles: the rows in int16 with a scale per 32 k, times q * s exactly (int32 sums per
    group, then fp32). On the tiles (each panel made bf16 first, from the first row): bf16 rows
    times bf16(q * s)."""
    if tiles == "amx" and not Bf16PanelLinear().amx_ready():
        pytest.skip("this CPU (or kernel) gives no AMX tiles")
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, inp, generator=gen), torch.randn(out, inp, generator=gen)
    w[3] = 0  # an all-zero row: its scales must not divide by zero
    w[5, :INT8_GROUP] *= 1000  # one large group: the row's other groups keep their own scales
    x[0, -min(inp, INT8_GROUP):] *= 1e-3  # a row's small group keeps its own int16 scale
    rest = x.clone()
    rest[:, :INT8_GROUP] = 0  # rows that miss the large group
    lin = Int8PanelLinear()
    shipped = panel_amx_min_rows(1 if tiles == "amx" else 0, int8=True)
    try:
        packed = lin.prepare(w)
        y, y_rest = lin(x, packed), lin(rest, packed)
    finally:
        panel_amx_min_rows(shipped, int8=True)
    groups = -(-inp // INT8_GROUP)
    padded = torch.nn.functional.pad(w, (0, groups * INT8_GROUP - inp)).view(out, groups, INT8_GROUP)
    scale = fp16_at_or_above(padded.abs().amax(dim=2, keepdim=True) / 127)
    q = (padded / scale).round().clamp(-127, 127)
    assert (q.abs() == 127).any(dim=2)[:3].all()  # every nonzero group reaches the full range
    weight = (q * scale).view(out, -1)[:, :inp]
    if tiles == "amx":
        weight, xr = weight.bfloat16().double(), x.bfloat16().double()  # bf16(q * s), as the tiles take it
    else:
        weight, xr = weight.double(), int16_rows(x)
    want = xr @ weight.T
    bound = inp * 2 ** -23 * (xr.abs() @ weight.abs().T) + 1e-6
    assert ((y.double() - want).abs() <= bound).all()
    assert (y[:, 3] == 0).all()
    if inp > INT8_GROUP:  # row 5's other groups keep their weights; one scale a row would zero them
        per_channel = w.abs().amax(dim=1, keepdim=True) / 127
        coarse = rest.double() @ ((w / per_channel).round() * per_channel).double().T
        exact = rest.double() @ w.double().T
        assert (y_rest.double() - exact)[:, 5].abs().mean() < (coarse - exact)[:, 5].abs().mean() / 10


@needs_bf16
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_int8_panel_gemm_on_int16_rows_gives_nan_for_a_row_with_nan_or_inf(bad):
    """A row's int16 scale stands for its group's largest |x|: a NaN or an infinity there makes the
    row's outputs NaN (fp32's would be NaN or infinite), never finite; the other rows keep theirs."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 100, generator=gen), torch.randn(50, 100, generator=gen)
    x[1, 40] = bad
    lin = Int8PanelLinear()
    shipped = panel_amx_min_rows(0, int8=True)
    try:
        y = lin(x, lin.prepare(w))
    finally:
        panel_amx_min_rows(shipped, int8=True)
    assert y[1].isnan().all() and y[[0, 2]].isfinite().all()


AMX_READY = ("from kernels import greedy_head, linear; from kernels.cbuild import load; "
             "print(linear.Bf16PanelLinear().amx_ready(), "
             "bool(load('greedy_head', greedy_head.SIGNATURES).greedy_head_amx_ready()))")


@pytest.fixture(scope="module")
def uncapped_tiles() -> list[str]:
    """What AMX_READY prints with no ISA cap: whether this CPU and kernel give the tiles."""
    if not cbuild.available("panel_gemm", SIGNATURES):
        pytest.skip("no C compiler here")
    return subprocess.run([sys.executable, "-c", AMX_READY], capture_output=True, text=True, check=True,
                          env={k: v for k, v in os.environ.items() if "MAX_CPU_ISA" not in k}).stdout.split()


@pytest.mark.parametrize("cap, tiles", [("AVX512_CORE_BF16", False), ("avx512_core", False),
                                        ("AVX512_CORE_AMX", True), ("ALL", True), ("", True)])
def test_the_tiles_follow_onednns_isa_cap(cap, tiles, uncapped_tiles):
    """ONEDNN_MAX_CPU_ISA below AMX turns the tiles off in the panel GEMM (and the decoder that
    compiles it in) and the greedy head, as oneDNN turns off its own; else where the CPU has them."""
    got = subprocess.run([sys.executable, "-c", AMX_READY], capture_output=True, text=True, check=True,
                         env={**os.environ, "ONEDNN_MAX_CPU_ISA": cap}).stdout.split()
    assert got == (uncapped_tiles if tiles else ["False", "False"])


def test_int8_scales_past_fp16_or_not_finite_are_refused():
    """A scale rounds up to fp16: a group whose largest |w| / 127 passes fp16's largest value (or
    a NaN or an infinity in it) cannot be packed, and says so; the largest that fits packs."""
    w = torch.ones(2, 32)
    w[0, 0] = 65504 * 127
    assert int8_groups(w)[1][0, 0].item() == 65504
    for bad in (65504 * 127 * 1.001, float("nan"), float("inf")):
        w[0, 0] = bad
        with pytest.raises(ValueError, match="too large for an fp16 scale"):
            int8_groups(w)


def test_int8_pack_holds_the_group_scales_after_the_panels():
    w = torch.zeros(3, 35)
    w[0, :3], w[2, :3], w[0, 33] = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([3.0, 1.0, -1.0]), 4.0
    packed = pack_int8(w)
    panel_bytes = 1 * 18 * 48 * 2  # one panel, K2 = 18, 48 columns, 2 k
    q = packed.panels[:panel_bytes].view(torch.int8).view(1, 18, 48, 2)
    scales = packed.panels[panel_bytes:].view(torch.float16).view(1, 2, 48)  # [panels, groups of 32 k, 48]
    assert scales[0, 0, 0].item() == 0.0157623291015625  # 2 / 127 = 0.015748 rounded up to fp16
    assert scales[0, 1, 0].item() == 0.031524658203125  # 4 / 127, the same
    assert scales[0, 0, 1] > 0 and (scales[0, :, 3:] == 0).all()
    assert q[0, 0, 0].tolist() == [63, -127] and q[0, 1, 2].tolist() == [-42, 0] and q[0, 0, 1].tolist() == [0, 0]
    assert q[0, 16, 0].tolist() == [0, 127]


def disassembly(source: str, march: str, tmp_path) -> str:
    """kernels/csrc/<source> built for -march=<march> as cbuild builds it, disassembled."""
    cc = cbuild.compiler()
    if not shutil.which(cc) or not shutil.which("objdump"):
        pytest.skip("needs a C compiler and objdump")
    lib = tmp_path / "lib.so"
    flags = [f for f in cbuild.FLAGS if not f.startswith("-march=")]
    done = subprocess.run([cc, *flags, f"-march={march}", str(cbuild.CSRC / source), "-o", str(lib), "-lm"],
                          capture_output=True, text=True)
    if done.returncode and "march" in done.stderr:
        pytest.skip(f"{cc} does not know -march={march}")
    assert done.returncode == 0, done.stderr
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True,
                          check=True).stdout


def function_body(code: str, name: str) -> str:
    """The disassembly of one function ("" where `code` has none of that name)."""
    return code.split(f"<{name}>:\n", 1)[1].split("\n\n", 1)[0] if f"<{name}>:\n" in code else ""


def opens_team(code: str, function: str) -> bool:
    """Whether `function` of the disassembly calls GOMP_parallel, itself or in a function it calls or
    jumps to (the compiler may leave a shared body, e.g. gemm_pairs, out of line)."""
    body = function_body(code, function)
    targets = {line.rsplit("<", 1)[1].rstrip(">") for line in body.splitlines()
               if ("call" in line or "jmp" in line) and "<" in line}
    return "GOMP_parallel" in body or any("GOMP_parallel" in function_body(code, name) for name in targets)


@pytest.mark.parametrize("march, forms, vnni", [("skylake-avx512", True, False), ("cascadelake", True, True),
                                               ("icelake-server", True, True), ("cooperlake", True, True),
                                               ("x86-64", False, False)])
def test_avx512_without_its_bf16_builds_bf16_and_int8_forms(march, forms, vnni, tmp_path):
    """Built for AVX-512 without its BF16 (Skylake-SP to Ice Lake), panel_gemm.c has bf16 and int8
    GEMMs, not the stubs that return -1: with VNNI (Cascade Lake, Ice Lake) its 16-lane forms, int8
    through vpdpwssd on zmm registers; without it (Skylake-SP) the AVX2 forms. Built for SSE alone
    it has only the stubs. A GEMM is one that opens an OpenMP team."""
    code = disassembly("panel_gemm.c", march, tmp_path)
    for function in ("panel_gemm_bf16", "panel_gemm_i8"):
        assert opens_team(code, function) == forms, (march, function)
    assert any("vpdpwssd" in line and "zmm" in line for line in code.splitlines()) == vnni, march


@pytest.mark.parametrize("march, screens", [("x86-64", False), ("haswell", True), ("skylake-avx512", True),
                                            ("cascadelake", True), ("cooperlake", False)])
def test_screen_head_builds_for_every_cpu(march, screens, tmp_path):
    """screen_head.c builds on every CPU, and says where its screen holds: where the panel GEMM keeps
    the rows fp32 / int16 (AVX2, AVX-512 without its BF16), not where it rounds them to bf16 nor
    where there is no panel GEMM (SSE alone: its exact logits still build, for packed heads too)."""
    code = disassembly("screen_head.c", march, tmp_path)
    ready = code.split("<screen_head_ready>:\n", 1)[1].split("\n\n", 1)[0]
    assert ("$0x1" in ready) == screens, (march, ready)
    assert "<screen_head_logits>:" in code and "<screen_head>:" in code and "<head_argmax>:" in code
    pairs = code.split("<screen_head_pairs_ready>:\n", 1)[1].split("\n\n", 1)[0]
    assert ("$0x1" in pairs) == (march == "cooperlake"), (march, pairs)  # the vdpbf16ps GEMM's screen


def test_bf16_pack_layout():
    """Panels of 48 outputs, k in pairs: element [p, k // 2, j, k % 2] is w[48 p + j, k]."""
    w = torch.arange(50 * 5, dtype=torch.float32).view(50, 5)
    packed = pack_bf16(w)
    assert packed.panels.shape == (2, 3, 48, 2) and packed.out_features == 50
    assert packed.panels[1, 1, 0, 1].item() == w[48, 3].item()
    assert packed.panels[0, 2, 7, 1].item() == 0 and packed.panels[1, 0, 2, 0].item() == 0  # odd k, past out


@needs_bf16
def test_dtype_bfloat16_on_cpu_gets_bf16_weights_fp32_activations_and_the_fused_decoder(checkpoint):
    from backends.engine import Engine
    eng = Engine(EngineConfig(model_path=checkpoint("llama"), device="cpu", dtype="bfloat16", num_pages=16))
    model = eng.runner.model
    assert isinstance(model.linear, Bf16PanelLinear) and model.weight_dtype == torch.bfloat16
    assert model.dtype == torch.float32 and eng.runner.kv.dtype == torch.bfloat16  # kv_cache_dtype auto
    assert model.layers[0].qkv.panels.dtype == torch.bfloat16 and model.lm_head.panels.dtype == torch.bfloat16
    assert isinstance(model.decoder, CpuDecoder) and model.decoder.weights_kind == 1
    # The screened head where the bf16 GEMM is the AVX2 form (an FMA chain the exact logits repeat);
    # vdpbf16ps rounds the rows to bf16: the screen of rounded rows, its candidates on that chain.
    assert type(model.greedy_head) is (PairsScreenedHead if ROWS_BF16 else ScreenedHead)


@needs_bf16
def test_weights_int8_gets_the_int8_panels_and_the_fused_decoder(checkpoint):
    from backends.engine import Engine
    eng = Engine(EngineConfig(model_path=checkpoint("mistral"), device="cpu", weights="int8", num_pages=16))
    model = eng.runner.model
    assert isinstance(model.linear, Int8PanelLinear) and model.dtype == torch.float32
    assert model.layers[0].down.panels.dtype == torch.uint8 and model.lm_head.panels.dtype == torch.uint8
    assert isinstance(model.decoder, CpuDecoder) and model.decoder.weights_kind == 2
    assert eng.runner.kv.dtype == torch.bfloat16  # kv_cache_dtype auto
    assert isinstance(model.greedy_head, ArgmaxHead)


def test_weights_is_checked_by_name(monkeypatch):
    with pytest.raises(ValueError, match="weights must be auto or int8, got 'int4'"):
        EngineConfig(weights="int4")
    monkeypatch.setenv("TANDEM_WEIGHTS", "q8")
    with pytest.raises(ValueError, match="TANDEM_WEIGHTS.*'q8'"):
        EngineConfig().weights_kind
    monkeypatch.setenv("TANDEM_WEIGHTS", "int8")
    assert EngineConfig().weights_kind == "int8" and EngineConfig(weights="auto").weights_kind == "int8"


def test_kv_cache_dtype_bfloat16_halves_the_page_and_keeps_the_fused_decoder(checkpoint, monkeypatch):
    """The pool holds twice the pages in the same kv_memory_gb, the cache is bf16 under fp32
    activations, and the one-call decoder runs on it (decoder.c's kv_bf16)."""
    from backends.engine import Engine
    monkeypatch.delenv("TANDEM_KV_CACHE_DTYPE", raising=False)
    knobs = dict(model_path=checkpoint("llama"), device="cpu", dtype="float32", kv_memory_gb=0.001)
    fp32, bf16 = (Engine(EngineConfig(**knobs, kv_cache_dtype=kind)).runner for kind in ("auto", "bfloat16"))
    assert fp32.kv.dtype == torch.float32 and bf16.kv.dtype == torch.bfloat16
    assert bf16.model.dtype == torch.float32 and bf16.pool.num_pages // 2 == fp32.pool.num_pages  # floors
    assert isinstance(bf16.model.decoder, CpuDecoder)


def test_kv_cache_dtype_is_checked_by_name_and_kernel(checkpoint, monkeypatch):
    from backends.engine import Engine
    monkeypatch.delenv("TANDEM_KV_CACHE_DTYPE", raising=False)
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, float32 or bfloat16, got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")
    monkeypatch.setenv("TANDEM_KV_CACHE_DTYPE", "float16")
    with pytest.raises(ValueError, match="TANDEM_KV_CACHE_DTYPE.*'float16'"):
        EngineConfig().kv_dtype(torch.float32)
    monkeypatch.setenv("TANDEM_KV_CACHE_DTYPE", "bfloat16")
    assert EngineConfig().kv_dtype(torch.float32) == torch.bfloat16
    assert EngineConfig(kv_cache_dtype="auto").kv_dtype(torch.float32) == torch.bfloat16
    monkeypatch.delenv("TANDEM_KV_CACHE_DTYPE")
    assert EngineConfig().kv_dtype(torch.float32) == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 under float32 activations on a CPU needs the C "
                                         "attention kernel.*'torch'"):
        Engine(EngineConfig(model_path=checkpoint("llama"), device="cpu", dtype="float32", num_pages=16,
                            kv_cache_dtype="bfloat16", attention_backend="torch"))
    torch_attention = Engine(EngineConfig(model_path=checkpoint("llama"), device="cpu", weights="int8", num_pages=16,
                                          attention_backend="torch"))
    assert torch_attention.runner.kv.dtype == torch.float32  # auto: bf16 only where the C kernel reads it


def test_dtype_auto_on_cpu_follows_the_checkpoint_where_the_cpu_has_bf16(tmp_path, monkeypatch):
    import json

    from backends import config
    monkeypatch.delenv("TANDEM_DTYPE", raising=False)
    for own, bf16_cpu, want in [("bfloat16", True, torch.bfloat16), ("float16", True, torch.bfloat16),
                                ("float32", True, torch.float32), ("bfloat16", False, torch.float32)]:
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": own}))
        monkeypatch.setattr(config, "cpu_prefers_bf16", lambda: bf16_cpu)
        assert EngineConfig(model_path=str(tmp_path), device="cpu").torch_dtype == want, (own, bf16_cpu)


@pytest.mark.parametrize("flags, builds, auto_bf16", [
    ({"avx2", "fma"}, True, True),  # AMD Zen 2 and 3
    ({"avx2", "fma", "avx512f", "avx512bw"}, True, False),  # Skylake-SP: the AVX2 forms
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"}, True, True),  # Cascade Lake, Ice Lake: 16 lanes
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, True, True),  # Zen 4, Sapphire Rapids
    ({"sse4_2"}, False, False)])
def test_which_cpus_run_bf16_and_which_prefer_it(flags, builds, auto_bf16, monkeypatch):
    from backends import config
    monkeypatch.setattr(config, "cpu_flags", lambda: flags)
    assert (config.cpu_has_bf16(), config.cpu_prefers_bf16()) == (builds, auto_bf16)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint("llama"))


def int8_reference(model):
    """model (fp32, transformers) with each matmul weight rounded to int8 per group of 32 k and
    back, to bf16 as the kernel does."""
    import torch.nn as nn
    with torch.no_grad():
        if model.lm_head.weight is model.get_input_embeddings().weight:
            model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                q, scale = int8_groups(module.weight)
                weight = (q.view(*scale.shape, -1) * scale[:, :, None]).view(q.shape)[:, :module.weight.shape[1]]
                module.weight.copy_(weight.bfloat16())
    return model


def compare(path: str, tokenizer, batch: list[list[int]] | None = None, **knobs) -> tuple[str, dict]:
    """'' when the CPU engine with `knobs` agrees with the fp32 engine over `batch` (default
    gpu_check's prompts), else what differs; and the figures (errors, tokens decided)."""
    from transformers import AutoModelForCausalLM

    from backends.request import SamplingParams
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    batch = batch or prompts()
    want_ids = greedy(gpu_check.engine(path, tokenizer, "cpu", "float32"), batch, params)
    eng = gpu_check.engine(path, tokenizer, "cpu", "float32" if knobs.get("weights") == "int8" else "bfloat16",
                           **knobs)
    got_logits = first_logits(eng, batch[-1])
    got_ids = greedy(eng, batch, params)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if knobs.get("weights") == "int8":
        low = int8_reference(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    else:
        low = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    problems, decided = [], 0
    for prompt, want, got in zip(batch, want_ids, got_ids):
        ids = torch.tensor([prompt + want])
        with torch.no_grad():
            logits = ref(ids).logits[0, len(prompt) - 1:-1]
            err = (low(ids).logits[0, len(prompt) - 1:-1].float() - logits).abs().amax(dim=-1)  # per position
        top2 = logits.topk(2, dim=-1).values
        for pos, (w, g) in enumerate(zip(want, got)):
            if top2[pos, 0] - top2[pos, 1] <= 2 * err[pos]:
                break  # undecided at this precision from here on
            decided += 1
            if w != g:
                problems.append(f"prompt of {len(prompt)}: token {pos} is {g}, fp32 says {w}")
                break
    ids = torch.tensor([batch[-1]])
    with torch.no_grad():
        want_logits = ref(ids).logits[0, -1]
        low_err = (low(ids).logits[0, -1].float() - want_logits).abs().max().item()
    err, scale = (got_logits - want_logits).abs().max().item(), want_logits.abs().max().item()
    if err > 2 * low_err + 1e-3 * scale:
        problems.append(f"first-step logits differ by {err:.3f}, allowed {2 * low_err + 1e-3 * scale:.3f}")
    figures = {"engine_err": err, "measured_err": low_err, "decided": decided,
               "equal_all": sum(a == b for w, g in zip(want_ids, got_ids) for a, b in zip(w, g))}
    print(f"  {os.path.basename(path)} {knobs}: {figures}", flush=True)
    return "; ".join(problems), figures


TEXTS = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at a temperature of",
         "Once upon a time, in a small village,", "The three primary colors are"]
KINDS = {"bf16": {}, "int8": {"weights": "int8"},  # the engine's knobs besides its dtype (auto: a bf16 KV cache)
         "bf16-fp32kv": {"kv_cache_dtype": "float32"}, "int8-fp32kv": {"weights": "int8", "kv_cache_dtype": "float32"}}


@needs_bf16
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_agrees_with_the_fp32_engine(arch, kind, checkpoint, tokenizer):
    problems, _ = compare(checkpoint(arch), tokenizer, **KINDS[kind])
    assert problems == "", problems


@needs_bf16
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_engine_agrees_with_the_fp32_engine_on_the_default_model(kind, default_model):
    """The tiny random checkpoints have small top-2 margins (few tokens are decided at bf16's
    error, none at int8's on some); the default model on text decides more of them."""
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    batch = [tokenizer(text).input_ids for text in TEXTS]
    problems, figures = compare(default_model, tokenizer, batch, **KINDS[kind])
    assert problems == "", problems
    assert figures["decided"] >= 1


@needs_bf16
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_the_comparison_fails_when_the_kernel_reads_its_weights_wrong(kind, checkpoint, tokenizer, monkeypatch):
    """The k pairs packed swapped (each weight multiplies its neighbour's input): the check
    must see it."""
    import kernels.linear as linear
    real = linear.pack_bf16

    def swapped(weight):
        packed = real(weight)
        return linear.PackedWeight(packed.panels.flip(-1).contiguous(), packed.out_features)

    monkeypatch.setattr(linear, "pack_bf16", swapped)
    assert compare(checkpoint("llama"), tokenizer, **KINDS[kind])[0] != ""


@needs_bf16
def test_bench_linear_times_every_option(checkpoint, tmp_path):
    """client.bench_linear on a tiny shape: every option that runs on this CPU (all but AMX and
    oneDNN's bf16 without AVX-512) runs and reports its matmuls."""
    import json

    from client import bench_linear
    out = tmp_path / "linear.json"
    bench_linear.main(["--model", checkpoint("llama"), "--rows", "1,9", "--repeat", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert sorted(report) == ["1", "9"]
    for rows in report.values():
        assert sorted(rows) == sorted(bench_linear.options(1))
        assert all(r["best_ms"] > 0 and r["lm_head"] > 0 for r in rows.values())
    amx = Bf16PanelLinear().amx_ready()
    assert len(rows) == 6 + 2 * amx + 3 * torch.ops.mkldnn._is_mkldnn_bf16_supported()


@needs_bf16
@pytest.mark.parametrize("kind", [PanelLinear, Bf16PanelLinear, Int8PanelLinear])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("out", [PANEL, 5 * PANEL + 7, 40 * PANEL])
def test_every_panel_is_computed_once_whatever_the_team(kind, rows, out):
    """One or two rows' panels go out in contiguous runs, one a thread, that a thread done with its
    own takes over from the back (csrc/panel_gemm.c's next_panel); more rows take them one at a
    time. With more threads than cores (3 and 5 on this machine's few) threads are preempted and
    runs taken over all the time, and with more threads than panels some runs are empty: every
    output is still computed, bit for bit as on one thread (each column is its own chain). Each
    team gets new rows, so a panel left out would keep another call's values."""
    g = torch.Generator().manual_seed(rows * 7 + out)
    op = kind()
    w = op.prepare(torch.randn(out, 576, generator=g) * 0.05)
    threads = torch.get_num_threads()
    try:
        for team in (3, 5, 2):
            x = torch.randn(rows, 576, generator=g)
            torch.set_num_threads(team)
            got = op(x, w)
            torch.set_num_threads(1)
            assert torch.equal(got.view(torch.int32), op(x, w).view(torch.int32)), team
    finally:
        torch.set_num_threads(threads)
