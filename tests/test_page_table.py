"""The decode graphs' page table on the device (backends.page_table): rows written only where
a request's pages changed, equal at every step to the table built from the page lists."""
import random

import pytest
import torch

from backends.page_table import DevicePageTable
from kernels.base import page_table_array


class Req:
    def __init__(self, pages):
        self.pages = pages


def step(table: DevicePageTable, reqs: list[Req], pad: int = 0) -> int:
    """One graph step: assign, write, gather; checked against the host-built table. The
    number of entries written."""
    rows, at, pages = table.assign(reqs, pad)
    table.write(at, pages, packed=False)
    got = table.gather(torch.tensor(rows))
    want = page_table_array([r.pages for r in reqs], table.width, pad).view(len(reqs) + pad, table.width)
    for i, req in enumerate(reqs):   # past a request's pages a row holds what it held: never read
        n = min(len(req.pages), table.width)
        assert got[i, :n].tolist() == want[i, :n].tolist()
    assert not got[len(reqs):].any()   # padding decodes read page 0
    return len(at)


def test_a_decode_writes_only_its_new_pages():
    table = DevicePageTable(4, 8, "cpu")
    a, b = Req([3, 4]), Req([5])
    assert step(table, [a, b], pad=2) == 3        # first step: whole rows
    assert step(table, [a, b], pad=2) == 0        # nothing changed: nothing sent
    a.pages += [9]                                # the scheduler's _grow: in place
    assert step(table, [a, b]) == 1
    b.pages = [7, 8]                              # a new list (preempted, matched again)
    assert step(table, [b, a]) == 2


def test_a_row_is_as_wide_as_the_table():
    table = DevicePageTable(2, 3, "cpu")
    assert step(table, [Req([1, 2, 3, 4, 5])]) == 3


def test_rows_of_requests_not_in_the_step_are_taken_back_least_recent_first():
    table = DevicePageTable(3, 4, "cpu")
    a, b, c, d = (Req([i, i + 10]) for i in range(1, 5))
    step(table, [a, b, c])
    step(table, [b])                   # b most recent, then c, a the least
    rows_before = table.assign([c, b], 0)[0]
    assert step(table, [d, c, b]) == 2  # d takes a's row; c and b keep theirs
    assert table.assign([c, b], 0)[0] == rows_before
    assert step(table, [a]) == 2       # a lost its row: written whole again


def test_a_batch_never_takes_its_own_rows():
    """A request whose row would be the least recent comes after one that needs a row."""
    table = DevicePageTable(2, 4, "cpu")
    a, b, c = Req([1]), Req([2]), Req([3])
    step(table, [a, b])
    assert step(table, [c, a]) == 1    # c takes b's row, not a's: a's row is not written again
    with pytest.raises(ValueError, match="3 sequences for a page table of 2 rows"):
        table.assign([a, b, c])


def test_after_a_reset_every_row_is_written_whole():
    table = DevicePageTable(2, 4, "cpu")
    a = Req([1, 2])
    step(table, [a])
    table.reset()                      # a step's writes never reached the device
    table.table.zero_()
    assert step(table, [a]) == 2


def test_random_steps_equal_the_host_built_table():
    rng = random.Random(7)
    table = DevicePageTable(6, 16, "cpu")
    live = [Req([rng.randrange(100)]) for _ in range(10)]
    written = 0
    for _ in range(300):
        for req in rng.sample(live, 3):
            if rng.random() < 0.1:
                req.pages = [rng.randrange(100) for _ in range(rng.randrange(1, 5))]
            else:
                req.pages += [rng.randrange(100)]
        written += step(table, rng.sample(live, rng.randrange(1, 7)), pad=rng.randrange(3))
    assert written < 300 * 6 * 16 / 4   # incremental: far fewer than whole rows every step


def test_the_host_time_bench_runs_both_ways():
    from client.bench_page_table import step_ms
    assert step_ms(64, False, 20) > 0 and step_ms(64, True, 20) > 0
