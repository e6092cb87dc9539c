"""python -m client.bench_gpu (`make gpu-bench`): the engine on a GPU against the hardware.

Builds a Llama-3-8B-shaped model (32 layers, hidden 4096, 32/8 heads, intermediate 14336,
vocab 128256) with random bf16 weights on the GPU, a word-level tokenizer of the same
vocabulary (the `tokenizers` library; random weights have no text), and prints, measured in
this run:

    hardware   device-to-device copy bandwidth (read + write bytes per second), bf16 matmul rate
    engine     in-process at each level (streams x prompt tokens, fixed output tokens, greedy,
               ignore_eos; all of a level's requests submitted at once): output tok/s, TTFT p50,
               ITL p50, and beside the ITL the roofline step time ((weights read per step + KV
               read at the level's mean context) / the copy bandwidth) and ITL / roofline
    graph      the level's decode CUDA graph (the forward, the lm_head and its argmax) replayed
               alone on a step recorded mid-level (the engine's ceiling) and graph / ITL
    peer       transformers' continuous batching (`generate_batch`) on the same weights and
               levels: output tok/s, TTFT p50, ITL p50, and our tok/s over its

and writes the report as JSON (--out). Without CUDA it runs the tiny shape on the CPU in
fp32 (a smoke test: CI runs it); the figures then mean nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import tempfile
import time

import numpy as np
import torch

SHAPES = {
    "8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256),
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=1024),
}
LEVELS = ((1, 128), (16, 128), (64, 128), (64, 1024))  # (streams, prompt tokens)


def hf_config(shape: str, max_position: int) -> dict:
    """config.json of a Llama-3-like checkpoint of `shape` (Llama-3's rope, no EOS)."""
    shape = SHAPES[shape]
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", **shape,
                head_dim=shape["hidden_size"] // shape["num_attention_heads"], rms_norm_eps=1e-5, max_position_embeddings=max_position, rope_theta=500000.0,
                tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=None, eos_token_id=None)


def write_checkpoint_dir(path: str, config: dict) -> None:
    """config.json and a word-level tokenizer with one word per id ("t0" ... "tN")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def build_models(path: str, device: torch.device, dtype: torch.dtype):
    """transformers' LlamaForCausalLM with random weights made on the device, and our model
    over the same tensors (ours fuses q/k/v and gate/up into copies of its own)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from backends.model import LlamaModel
    from backends.model_config import ModelConfig

    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    hf.eval()
    weights = {name: t.detach() for name, t in hf.state_dict().items()}
    ours = LlamaModel(ModelConfig.load(path), weights, device, dtype)
    return hf, ours, AutoTokenizer.from_pretrained(path)


def timed(fn, repeat: int, device: torch.device) -> float:
    """Seconds per call of fn, the mean of `repeat` calls after one untimed."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeat


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hardware(device: torch.device, dtype: torch.dtype, small: bool) -> dict:
    """Copy bandwidth (bytes read + written per second) and the matmul rate of `dtype`."""
    n = (1 << 20) if small else (1 << 30)
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    copy_s = timed(lambda: dst.copy_(src), 20, device)
    m = 256 if small else 8192
    a, b = torch.randn(m, m, dtype=dtype, device=device), torch.randn(m, m, dtype=dtype, device=device)
    mm_s = timed(lambda: a @ b, 20, device)
    del src, dst, a, b
    return dict(copy_bytes_s=2 * n / copy_s, matmul_flop_s=2 * m ** 3 / mm_s)


def bytes_per_step(config: dict, dtype: torch.dtype, contexts: float) -> tuple[float, float]:
    """(weights read by one decode step, KV read for `contexts` cached tokens in all)."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d, hq, hkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    per_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * inter + 2 * h
    weights = (config["num_hidden_layers"] * per_layer + v * h + h) * dtype.itemsize
    kv = contexts * config["num_hidden_layers"] * 2 * hkv * d * dtype.itemsize
    return weights, kv


class GraphSteps:
    """Keeps the host inputs of full-bucket decode steps the engine replays, to replay one alone."""

    def __init__(self, graphs):
        self.graphs, self.steps = graphs, {}
        replay = graphs.replay

        def recording(bucket, host, rows, before):
            if rows == bucket:
                self.steps.setdefault(bucket, []).append(host.clone())
            return replay(bucket, host, rows, before)
        graphs.replay = recording

    def time_alone(self, bucket: int, device: torch.device) -> float | None:
        """Seconds per replay of `bucket`'s graph on the middle recorded step; None if none was."""
        steps = self.steps.pop(bucket, [])
        if bucket not in self.graphs.captured or not steps:
            return None
        c = self.graphs.captured[bucket]
        c.static.copy_(steps[len(steps) // 2])
        return timed(c.graph.replay, 50, device)


def run_level(engine, prompts: list[list[int]], output_tokens: int) -> dict:
    from backends.request import SamplingParams
    from client.bench_engine import wave

    params = SamplingParams(max_tokens=output_tokens, min_tokens=output_tokens, ignore_eos=True)
    r = wave(engine, prompts, len(prompts), params)
    row = dict(tok_s=r["tok_s"], ttft_p50_ms=float(np.median(r["ttft"])), itl_p50_ms=float(np.median(r["itl"])),
               tokens=r["tokens"])
    if len(prompts) == 1:  # its greedy ids: every variant's one stream runs the same bucket, so the same ids
        row["ids"] = r["ids"][0]
    return row


def run_peer(hf, prompts: list[list[int]], output_tokens: int) -> dict:
    """transformers' continuous batching on the same prompts, all submitted at once."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=output_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = hf.generate_batch(prompts, generation_config=gen, record_timestamps=True, progress_bar=False)
    results = list(out.values())
    if len(results) != len(prompts) or any(r.error for r in results):
        raise RuntimeError(f"generate_batch: {[r.error for r in results if r.error] or 'missing results'}")
    start = min(r.created_time for r in results)
    tokens = sum(len(r.generated_tokens) for r in results)
    wall = max(r.timestamps[-1] for r in results) - start
    itl = [(r.timestamps[-1] - r.timestamps[0]) / (len(r.timestamps) - 1) for r in results if len(r.timestamps) > 1]
    return dict(tok_s=tokens / wall, ttft_p50_ms=1e3 * statistics.median(r.timestamps[0] - r.created_time
                                                                         for r in results),
                itl_p50_ms=1e3 * statistics.median(itl), tokens=tokens)


def make_prompts(levels, vocab: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {(c, p): torch.randint(1, vocab, (c, p), generator=g).tolist() for c, p in levels}


def engine_levels(args, cfg, ours, tokenizer, config, dtype, hw) -> list[dict]:
    from backends.engine import Engine

    engine = Engine(cfg, tokenizer=tokenizer, model=ours).start()
    graphs = GraphSteps(engine.runner.graphs) if engine.runner.graphs is not None else None
    prompts = make_prompts(args.levels, config["vocab_size"])
    rows = []
    try:
        for level in args.levels:  # compiles every kernel variant the levels use, and warms the allocator
            run_level(engine, prompts[level], 4)
        if graphs is not None:
            graphs.steps.clear()
        for streams, prompt in args.levels:
            r = run_level(engine, prompts[(streams, prompt)], args.output_tokens)
            weights, kv = bytes_per_step(config, dtype, streams * (prompt + args.output_tokens / 2))
            roof_ms = 1e3 * (weights + kv) / hw["copy_bytes_s"]
            bucket = engine.runner.graphs.bucket(streams) if graphs is not None else None
            alone = graphs.time_alone(bucket, cfg.torch_device) if graphs is not None and bucket else None
            rows.append(dict(streams=streams, prompt_tokens=prompt, output_tokens=args.output_tokens, **r,
                             roofline_ms=roof_ms, itl_over_roofline=r["itl_p50_ms"] / roof_ms,
                             graph_ms=None if alone is None else 1e3 * alone,
                             graph_over_itl=None if alone is None else 1e3 * alone / r["itl_p50_ms"]))
            print(row_line(rows[-1]), flush=True)
    finally:
        release(engine)
    return rows


def release(engine) -> None:
    """Stop the engine and give its KV and graph memory back at once: the next part of the
    run (a variant, the server, the peer) needs it. Engine.start froze the objects of the
    time (gc.freeze), so the engine's reference cycles are collected only once unfrozen."""
    engine.stop()
    engine.runner.kv = engine.runner.graphs = None
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def variant(args, cfg, ours, tokenizer, config, dtype, hw, name: str) -> list[dict]:
    """The levels again with one thing changed: engine settings (`overlap=off`,
    `max_batch_tokens=512`, ...), or `torch-ops` (the torch composites instead of the fused
    Triton ops: what those gained)."""
    from kernels.layer_ops import TorchOps

    print(f"variant {name}", flush=True)
    ops = ours.ops
    try:
        if name == "torch-ops":
            ours.ops = TorchOps()
        else:
            cfg = with_settings(cfg, parse_sets(name))
        return engine_levels(args, cfg, ours, tokenizer, config, dtype, hw)
    finally:
        ours.ops = ops


def with_settings(cfg, sets: dict[str, str]):
    """cfg with config.pbtxt-style settings (strings, typed by each knob's default); an unknown
    name is refused."""
    from backends.parameters import typed_parameter

    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    if unknown := sorted(set(sets) - set(defaults)):
        raise ValueError(f"unknown variant setting(s) {unknown}: a variant is torch-ops or engine settings "
                         "NAME=VALUE,...")
    return cfg.replace(**{name: typed_parameter(name, text, defaults[name]) for name, text in sets.items()})


def serve(args, cfg, hf, tokenizer, report: dict) -> None:
    """`llm` through tritonserver at the levels of 16 streams and more, beside the in-process rows."""
    from client.bench_gpu_serve import serve_levels

    checkpoint = os.path.join(args.scratch, "checkpoint")
    t0 = time.perf_counter()
    hf.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    print(f"checkpoint saved in {time.perf_counter() - t0:.1f} s", flush=True)
    levels = [level for level in args.levels if level[0] >= 16]
    settings = {name: str(getattr(cfg, name)) for name in ("max_running_requests", "num_pages", "max_context",
                                                           "overlap")}
    prompts = make_prompts(levels, report["config"]["vocab_size"])
    for extra in args.serve_sets[1:]:  # the others first: the table's run is the last the machine ran
        name = extra.replace("=", "-").replace(",", "_")
        report.setdefault("served_sets", {})[extra] = serve_levels(
            args.serve, checkpoint, {**settings, **parse_sets(extra)}, prompts, args.output_tokens, args.out,
            args.stub_path, name)
    served = serve_levels(args.serve, checkpoint, {**settings, **parse_sets(args.serve_sets[0])}, prompts,
                          args.output_tokens, args.out, args.stub_path)
    for row in report["engine"]:
        got = served.get(f"{row['streams']}x{row['prompt_tokens']}")
        if got:
            row["served"], row["served_over_engine"] = got, got["tok_s"] / row["tok_s"]
    report["served"] = served


def parse_sets(text: str) -> dict[str, str]:
    """"name=value,name=value" -> {name: value}"""
    if bad := [item for item in text.split(",") if item and "=" not in item]:
        raise ValueError(f"{bad[0]!r}: settings are NAME=VALUE,...")
    return dict(item.split("=", 1) for item in text.split(",") if item)


def peer_levels(args, hf, config, rows) -> None:
    prompts = make_prompts(args.levels, config["vocab_size"])
    run_peer(hf, prompts[args.levels[0]][:1], 4)  # its warm-up
    for row, level in zip(rows, args.levels):
        try:
            peer = run_peer(hf, prompts[level], args.output_tokens)
            row["peer"] = peer
            row["tok_s_over_peer"] = row["tok_s"] / peer["tok_s"]
        except Exception as exc:  # the peer's failure is reported, ours are already measured
            row["peer"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"  peer {level}: {row['peer']}", flush=True)


def same_ids(rows: list[dict], main: list[dict]) -> list[dict]:
    """Marks a variant's one-stream rows with whether their greedy ids are the main run's (a
    check of overlap's tokens fed on the device, and of the torch ops against the fused ones)."""
    ids = {(r["streams"], r["prompt_tokens"]): r["ids"] for r in main if "ids" in r}
    for r in rows:
        if "ids" in r and (r["streams"], r["prompt_tokens"]) in ids:
            r["ids_equal_main"] = r["ids"] == ids[(r["streams"], r["prompt_tokens"])]
    return rows


def row_line(r: dict) -> str:
    graph = "-" if r["graph_ms"] is None else f"{r['graph_ms']:.2f} ms ({r['graph_over_itl']:.2f})"
    return (f"{r['streams']:>3} x {r['prompt_tokens']:>4}: {r['tok_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:7.1f} ms"
            f"  ITL p50 {r['itl_p50_ms']:6.2f} ms  roofline {r['roofline_ms']:5.2f} ms"
            f" (x{r['itl_over_roofline']:.2f})  graph alone {graph}")


def table(report: dict) -> str:
    fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)
    lines = ["| streams x prompt | tok/s | TTFT p50 ms | ITL p50 ms | roofline ms | ITL/roof | graph ms | graph/ITL "
             "| peer tok/s | peer TTFT | peer ITL | ours/peer | tritonserver tok/s | served/engine |", "|" + "---|" * 14]
    for r in report["engine"]:
        p, s = r.get("peer") or {}, r.get("served") or {}
        lines.append(f"| {r['streams']} x {r['prompt_tokens']} | {r['tok_s']:.0f} | {r['ttft_p50_ms']:.1f} | "
                     f"{r['itl_p50_ms']:.2f} | {r['roofline_ms']:.2f} | {r['itl_over_roofline']:.2f} | "
                     f"{fmt(r['graph_ms'])} | {fmt(r['graph_over_itl'])} | {fmt(p.get('tok_s'), '{:.0f}')} | "
                     f"{fmt(p.get('ttft_p50_ms'), '{:.1f}')} | {fmt(p.get('itl_p50_ms'))} | "
                     f"{fmt(r.get('tok_s_over_peer'))} | {fmt(s.get('tok_s'), '{:.0f}')} | "
                     f"{fmt(r.get('served_over_engine'))} |")
    for name, rows in report.get("variants", {}).items():
        lines.append(f"\nvariant {name}: " + "; ".join(
            f"{r['streams']} x {r['prompt_tokens']}: {r['tok_s']:.0f} tok/s, ITL {r['itl_p50_ms']:.2f} ms, "
            f"graph {fmt(r['graph_ms'])} ms" + ("" if "ids_equal_main" not in r else
                                                 f", ids {'equal' if r['ids_equal_main'] else 'DIFFER from'} the main run's")
            for r in rows))
    engine = {f"{r['streams']}x{r['prompt_tokens']}": r["tok_s"] for r in report["engine"]}
    for name, served in report.get("served_sets", {}).items():
        lines.append(f"\ntritonserver with {name}: " + ("failed: " + served["error"] if "error" in served else "; ".join(
            f"{level}: {row['tok_s']:.0f} tok/s ({row['tok_s'] / engine[level]:.2f} of the engine), ITL "
            f"{row['itl_p50_ms']:.2f} ms" for level, row in served.items() if level in engine)))
    if "error" in report.get("served", {}):
        lines.append(f"\ntritonserver failed: {report['served']['error']}")
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    import transformers
    import triton

    card = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return dict(device=card, torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, cuda=torch.version.cuda, python=platform.python_version())


def save(report: dict, out: str, t0: float) -> None:
    report["seconds"] = time.perf_counter() - t0
    with open(os.path.join(out, "gpu_bench.json"), "w") as f:
        json.dump(report, f, indent=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 8b on cuda, tiny on cpu")
    p.add_argument("--output-tokens", type=int, default=None, help="default: 256 on cuda, 8 on cpu")
    p.add_argument("--levels", default=None, help="streams:prompt,...; default 1:128,16:128,64:128,64:1024 "
                                                  "(cpu: 1:16,4:32)")
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto", help="the engine's overlap")
    p.add_argument("--max-context", type=int, default=None,
                   help="the engine's max_context (the decode graphs' page-table width); default 8192 on cuda")
    p.add_argument("--variants", nargs="+", default=[], metavar="VARIANT",
                   help="reruns of the levels, each torch-ops or engine settings NAME=VALUE,... "
                        "(e.g. overlap=off max_batch_tokens=512)")
    p.add_argument("--serve", default=None, metavar="TRITONSERVER_DIR",
                   help="also serve the model with this tritonserver tree (scripts/gpu_serve_prepare.sh)")
    p.add_argument("--serve-sets", nargs="+", default=[""], metavar="NAME=VALUE,...",
                   help="llm's config.pbtxt settings for each tritonserver run, e.g. engine_process=own "
                        "engine_process=stub; the table shows the first, the JSON every one")
    p.add_argument("--stub-path", default="", help="packages the server's Python stub takes first (its numpy < 2), through a virtual environment")
    p.add_argument("--scratch", default=None, help="where the checkpoint is written (default: the temp dir)")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' generate_batch")
    p.add_argument("--out", default="artifacts/gpu-bench")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.shape = args.shape or ("8b" if cuda else "tiny")
    args.output_tokens = args.output_tokens or (256 if cuda else 8)
    args.max_context = args.max_context or (8192 if cuda else 64)
    text = args.levels or ("1:128,16:128,64:128,64:1024" if cuda else "1:16,4:32")
    args.levels = [tuple(int(x) for x in item.split(":")) for item in text.split(",")]
    return args


def main(argv=None) -> dict:
    from backends.config import EngineConfig, dtype_name

    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    max_streams = max(c for c, _ in args.levels)
    max_pages = max(c * -(-(p + args.output_tokens + 16) // 16) for c, p in args.levels)
    config = hf_config(args.shape, max(8192, args.max_context))
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    hw = hardware(device, dtype, small=device.type != "cuda")
    print(f"copy {hw['copy_bytes_s'] / 1e12:.3f} TB/s, {dtype} matmul {hw['matmul_flop_s'] / 1e12:.1f} TFLOP/s",
          flush=True)
    with tempfile.TemporaryDirectory(dir=args.scratch) as path:
        args.scratch = path
        write_checkpoint_dir(path, config)
        hf, ours, tokenizer = build_models(path, device, dtype)
        cfg = EngineConfig(model_path=path, device=args.device, dtype=dtype_name(dtype),
                           max_running_requests=max_streams, num_pages=max_pages + 16,
                           max_context=args.max_context, overlap=args.overlap)
        report = dict(environment=environment(device), shape=args.shape, config=config, overlap=cfg.overlaps,
                      max_context=args.max_context, hardware=hw)
        report["engine"] = engine_levels(args, cfg, ours, tokenizer, config, dtype, hw)
        save(report, args.out, t0)  # each part is kept if a later one fails or hangs
        if args.serve:
            serve(args, cfg, hf, tokenizer, report)
            save(report, args.out, t0)
        for name in args.variants:
            rows = variant(args, cfg, ours, tokenizer, config, dtype, hw, name)
            report.setdefault("variants", {})[name] = same_ids(rows, report["engine"])
            save(report, args.out, t0)
        del ours
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not args.no_peer:
            peer_levels(args, hf, config, report["engine"])
    save(report, args.out, t0)
    print(json.dumps(report["environment"]))
    print(table(report))
    return report


if __name__ == "__main__":
    main()
