"""Host time of a decode graph step's arrays at 64 sequences: the page table built on the host
as wide as the context (before) against rows of the device table (backends.page_table).

    python -m client.bench_page_table [--widths 512 8192] [--steps 400]
"""
from __future__ import annotations

import argparse
import statistics
import time

from backends.page_table import DevicePageTable
from backends.runner import pack_inputs
from kernels.host_pack import IntPack

SEQS, PAGE, CONTEXT = 64, 16, 384   # the GPU bench's 128 + 256 tokens


class Sequence:
    def __init__(self, first: int):
        self.pages = list(range(first, first + CONTEXT // PAGE))


def step_ms(width: int, device_table: bool, steps: int) -> float:
    """Median ms to build one step's pack and its host buffer; a new page each PAGE steps."""
    seqs = [Sequence(i * 100) for i in range(SEQS)]
    table = DevicePageTable(SEQS, width, "cpu")
    kv = [CONTEXT] * SEQS
    times = []
    for s in range(steps):
        if s % PAGE == 0:
            for seq in seqs:
                seq.pages += [seq.pages[-1] + 1]
        start = time.perf_counter()
        pack = IntPack("cpu", packed=True)
        args = ([0] * SEQS, [k - 1 for k in kv], list(range(SEQS)), [1] * SEQS, kv, [q.pages for q in seqs], PAGE)
        if device_table:
            rows, _, _ = table.assign(seqs)
            pack_inputs(pack, *args, table_rows=rows)
        else:
            pack_inputs(pack, *args, width=width)
        pack.host()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[512, 8192], help="table widths in pages")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    for width in args.widths:
        host, rows = step_ms(width, False, args.steps), step_ms(width, True, args.steps)
        print(f"{SEQS} sequences, {width} pages wide: host-built table {host:.3f} ms, "
              f"device table rows {rows:.3f} ms ({host / rows:.2f}x)")


if __name__ == "__main__":
    main()
