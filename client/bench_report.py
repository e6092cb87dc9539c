"""client.bench's reading and reporting: genai-perf exports -> rows -> table, JSON, plots."""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys

PCTS = ("p50", "p90", "p99")


# ---- reading genai-perf's exports -----------------------------------------------------
def _export(run_dir: str, name: str) -> str:
    """genai-perf nests its files in <artifact-dir>/<model>-<service>-<mode><level>/."""
    paths = glob.glob(os.path.join(run_dir, "**", name), recursive=True)
    if not paths:
        raise FileNotFoundError(f"{name} not found under {run_dir}")
    return paths[0]


def summary(run_dir: str) -> dict:
    """The table's numbers from profile_export_genai_perf.json (times in ms)."""
    with open(_export(run_dir, "profile_export_genai_perf.json")) as f:
        s = json.load(f)
    pick = lambda key: {p: s[key][p] for p in ("avg",) + PCTS}
    osl = s["output_sequence_length"]
    return {"output_tok_s": s["output_token_throughput"]["avg"],
            "requests_s": s["request_throughput"]["avg"],
            "request_count": int(s["request_count"]["avg"]),
            "ttft_ms": pick("time_to_first_token"), "itl_ms": pick("inter_token_latency"),
            "latency_ms": pick("request_latency"),
            "osl": {"min": osl["min"], "avg": osl["avg"], "max": osl["max"]},
            "isl_avg": s["input_sequence_length"]["avg"]}


class TokenCounter:
    """Recounts each request's output tokens the way genai-perf 0.0.16 does (the streamed
    text concatenated, encoded without special tokens) and compares them with what the
    server reported: num_output_tokens of its last response and the output_ids it streamed.

    A request whose text is exactly the decoded output_ids but re-encodes to fewer tokens
    (two streamed "\n" become one "\n\n" token) is a counting artefact of genai-perf,
    listed under `retokenized`; anything else is a server-side `mismatch`."""

    def __init__(self, tokenizer_dir: str):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    def check(self, run_dir: str) -> dict:
        with open(_export(run_dir, "profile_export.json")) as f:
            requests = json.load(f)["experiments"][0]["requests"]
        mismatches, retokenized, client_total, server_total = [], [], 0, 0
        for i, r in enumerate(requests):
            text, ids, reported = self._collect(r["response_outputs"])
            client = len(self.tok.encode(text, add_special_tokens=False)) if text else 0
            client_total, server_total = client_total + client, server_total + len(ids)
            entry = {"request": i, "client": client, "server": reported, "output_ids": len(ids)}
            if reported != len(ids) or self.tok.decode(ids) != text:
                mismatches.append({**entry, "text_matches_ids": self.tok.decode(ids) == text})
            elif client != reported:
                retokenized.append(entry)
        genai = summary(run_dir)
        genai_total = round(genai["osl"]["avg"] * genai["request_count"])
        return {"requests": len(requests), "client_total": client_total, "server_total": server_total,
                "genai_perf_total": genai_total, "mismatches": mismatches, "retokenized": retokenized,
                "ok": not mismatches and client_total == genai_total and len(requests) == genai["request_count"],
                "equal": not mismatches and not retokenized}

    @staticmethod
    def _collect(outputs: list[dict]) -> tuple[str, list[int], int]:
        text = "".join(o.get("text_output", "") for o in outputs)
        ids = [i for o in outputs if "output_ids" in o
               for i in (o["output_ids"] if isinstance(o["output_ids"], list) else [o["output_ids"]])]
        reported = [int(o["num_output_tokens"]) for o in outputs if "num_output_tokens" in o]
        return text, ids, (reported[-1] if reported else -1)


# ---- merging --------------------------------------------------------------------------
def merge(rows: list[dict], paths: list[str]) -> list[dict]:
    """Earlier results first; a new row replaces an old one of the same target and level."""
    merged: dict[tuple, dict] = {}
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["results"]:
                merged[_key(row)] = row
    for row in rows:
        merged[_key(row)] = row
    return list(merged.values())


def _key(row: dict) -> tuple:
    return row["target"], row["mode"], row["level"]


# ---- table ----------------------------------------------------------------------------
STEAL_NOTE = 0.01  # a row whose CPUs lost this share to the hypervisor gets a note
HEADER = ("target", "load", "reqs", "out tok/s", "req/s", "TTFT ms p50/p90/p99", "ITL ms p50/p90/p99",
          "latency ms p50/p90/p99", "out tokens", "tokens vs server", "steal %")


def table(rows: list[dict]) -> str:
    lines = [HEADER] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    fmt = lambda line: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
    return "\n".join([fmt(lines[0]), "  ".join("-" * w for w in widths)] + [fmt(line) for line in lines[1:]])


def _cells(r: dict) -> tuple:
    load = _load(r)
    if r.get("error"):
        return (r["target"], load, str(r["requests"]), "FAILED") + ("",) * 6 + (_steal_cell(r),)
    pct = lambda m, d: "/".join(f"{m[p]:.{d}f}" for p in PCTS)
    osl = r["osl"]
    out = f"{osl['avg']:.0f}" if osl["min"] == osl["max"] else f"{osl['min']:.0f}-{osl['max']:.0f}"
    return (r["target"], load, str(r["request_count"]), f"{r['output_tok_s']:.1f}", f"{r['requests_s']:.2f}",
            pct(r["ttft_ms"], 0), pct(r["itl_ms"], 1), pct(r["latency_ms"], 0), out, _token_cell(r),
            _steal_cell(r))


def _steal_cell(r: dict) -> str:
    # The share of the machine's CPU time its hypervisor took while the level ran ("-": a row
    # written before the column).
    return f"{100 * r['steal']:.1f}" if r.get("steal") is not None else "-"


def _token_cell(r: dict) -> str:
    t = r.get("tokens")
    if t is None:
        return "not checked" if r["kind"] == "triton" else "-"
    if not t["ok"]:
        return f"MISMATCH {len(t['mismatches'])}/{t['requests']}"
    if t["retokenized"]:  # the server is right; genai-perf's re-count is lower
        return f"{t['client_total']} vs {t['server_total']} (retok.)"
    return f"equal ({t['server_total']})"


def bases(rows: list[dict]) -> list[str]:
    """Tandem's servers among the targets: `llm`, and `llm-<name>` (llm-bf16, llm-int8: the same
    server in another dtype), in order; each is compared with every target that is not one."""
    return [t for t in dict.fromkeys(r["target"] for r in rows) if t == "llm" or t.startswith("llm-")]


def ratios(rows: list[dict], base: str = "llm") -> dict[str, dict[str, dict]]:
    """Per other target (not one of `bases`) and load: base's output tok/s and TTFT p50 over the
    other's (how far `llm` is ahead of a peer, or behind the in-process `engine`)."""
    ok = [r for r in rows if not r.get("error")]
    ref = {(r["mode"], r["level"]): r for r in ok if r["target"] == base}
    ours = set(bases(rows))
    out: dict[str, dict[str, dict]] = {}
    for r in ok:
        b = ref.get((r["mode"], r["level"]))
        if b is None or r["target"] in ours:
            continue
        out.setdefault(r["target"], {})[_load(r)] = {
            "output_tok_s": b["output_tok_s"] / r["output_tok_s"],
            "ttft_p50": b["ttft_ms"]["p50"] / r["ttft_ms"]["p50"]}
    return out


def ratio_table(ratios: dict[str, dict[str, dict]], base: str = "llm") -> str:
    return _per_target(
        f"{base} / target: output tok/s (above 1: {base} is faster), TTFT p50 (below 1: {base} answers sooner)",
        {target: [f"{load} {v['output_tok_s']:.2f}x ({v['ttft_p50']:.2f}x)" for load, v in by_load.items()]
         for target, by_load in ratios.items()})


def rounds_table(paths: list[str]) -> str:
    """The median and range over several reports (one per round) of each ratio they printed."""
    seen: dict[str, dict[str, dict[str, list[float]]]] = {}  # base -> target -> load -> ratios
    for path in paths:
        with open(path) as f:
            rows = json.load(f)["results"]
        for base in bases(rows):
            for target, by_load in ratios(rows, base).items():
                for load, v in by_load.items():
                    seen.setdefault(base, {}).setdefault(target, {}).setdefault(load, []).append(v["output_tok_s"])
    return "\n\n".join(_per_target(
        f"{base} / target, output tok/s over {len(paths)} rounds: median (min-max)",
        {target: [f"{load} {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})" for load, v in by_load.items()]
         for target, by_load in by_target.items()}) for base, by_target in seen.items())


def _per_target(header: str, cells: dict[str, list[str]]) -> str:
    return "\n".join([header] + [f"  {target:<14} " + "   ".join(c) for target, c in cells.items()])


def _load(r: dict) -> str:
    return ("c=" if r["mode"] == "concurrency" else "rate=") + f"{r['level']:g}"


# ---- plots ----------------------------------------------------------------------------
def plots(rows: list[dict], out_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    series = _series([r for r in rows if not r.get("error")])
    if not series:
        return []
    modes = {mode for _, mode in series}
    xlabel = {"concurrency": "concurrency", "request_rate": "request rate (req/s)"}.get(
        modes.pop(), "load") if len(modes) == 1 else "load (concurrency or req/s)"
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(dict.fromkeys(n for n, _ in series))}
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (name, _), pts in series.items():
        x = [r["level"] for r in pts]
        axes[0].plot(x, [r["output_tok_s"] for r in pts], "o-", color=colors[name], label=name)
        axes[1].plot(x, [r["requests_s"] for r in pts], "o-", color=colors[name], label=name)
    _style(axes[0], xlabel, "output tokens/s", "Output throughput")
    _style(axes[1], xlabel, "requests/s", "Request throughput")
    paths.append(_save(fig, out_dir, "throughput.png"))

    for key, title, fname in (("ttft_ms", "Time to first token", "ttft.png"),
                              ("itl_ms", "Inter-token latency", "itl.png"),
                              ("latency_ms", "Request latency", "latency.png")):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for (name, _), pts in series.items():
            x = [r["level"] for r in pts]
            for p, style in zip(PCTS, ("o-", "s--", "^:")):
                ax.plot(x, [r[key][p] for r in pts], style, color=colors[name], label=f"{name} {p}")
        _style(ax, xlabel, "ms", f"{title} (p50 solid, p90 dashed, p99 dotted)")
        paths.append(_save(fig, out_dir, fname))
    plt.close("all")
    return paths


def _series(rows: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["target"], r["mode"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["level"]) for k, v in out.items()}


def _style(ax, xlabel: str, ylabel: str, title: str) -> None:
    levels = sorted({x for line in ax.get_lines() for x in line.get_xdata()})
    if len(levels) <= 12:
        ax.set_xticks(levels)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# ---- writing --------------------------------------------------------------------------
def write(report: dict, out_dir: str) -> int:
    """Table to stdout and table.txt, bench.json, plots; returns the exit code."""
    rows = report["results"]
    text = table(rows)
    report["ratios"] = {base: ratios(rows, base) for base in bases(rows)}
    for base, by_target in report["ratios"].items():
        if by_target:
            text += "\n\n" + ratio_table(by_target, base)
    print(text)
    with open(os.path.join(out_dir, "table.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(report, f, indent=1)
    written = plots(rows, out_dir)
    print(f"\nwrote {out_dir}/bench.json, table.txt" + "".join(f", {os.path.basename(p)}" for p in written))
    workloads = {json.dumps(r.get("workload"), sort_keys=True) for r in rows}
    if len(workloads) > 1:
        print(f"note: the rows come from different workloads: {', '.join(sorted(workloads))}", file=sys.stderr)
    failed = [r for r in rows if r.get("error")]
    for r in failed:
        print(f"\n{r['target']} {r['mode']}={r['level']:g} failed: {r['error']}", file=sys.stderr)
    bad_tokens = [r for r in rows if r.get("tokens") and not r["tokens"]["ok"]]
    for r in bad_tokens:
        print(f"\nTOKEN COUNT MISMATCH {r['target']} {r['mode']}={r['level']:g}: {json.dumps(r['tokens'])[:600]}",
              file=sys.stderr)
    for r in rows:
        t = r.get("tokens")
        if t and t["ok"] and t["retokenized"]:
            print(f"\nnote: {r['target']} {r['mode']}={r['level']:g}: genai-perf counted {t['client_total']} output "
                  f"tokens, the server sent {t['server_total']}: {len(t['retokenized'])} request(s) whose text "
                  "re-encodes to fewer tokens (e.g. two streamed newlines -> one token); the text matches the "
                  "server's token ids.", file=sys.stderr)
    for r in rows:
        if (r.get("steal") or 0) >= STEAL_NOTE:
            print(f"\nnote: {r['target']} {r['mode']}={r['level']:g}: the hypervisor took {100 * r['steal']:.1f} % of "
                  "this VM's CPU time while it ran (steal); a step that waits for a descheduled vCPU stalls, so "
                  "its figures are low.", file=sys.stderr)
    return 1 if failed else 3 if bad_tokens else 0
