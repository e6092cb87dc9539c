"""Where an engine computes on a CPU: which cores, and turns with the engines it shares them with.

Two engines of one host (a prefill and a decode role) that each run an OpenMP team on the
same cores share them badly: every barrier of a forward waits for a thread the other team
pushed off its core, and idle teams spin. So engines take turns: a forward holds one lock file
per core it runs on (in /dev/shm, taken in core order, so two engines never deadlock), and the
other engines' forwards on those cores wait, asleep. An engine alone on its cores (one per
host, or cores split with `cpu_cores`) never waits. The prefill role goes first: while it
waits for its turn, a decode forward that has not started yet waits behind it, so a new
prompt's first token is not queued behind a string of decode steps (the colocated engine
puts the prompt into the next step, too). But it goes first once, not for a whole burst of
prompts: a decode engine that waits for the cores says so (`mark_waiting`), and the next
prefill forward lets it have one forward first. So the two alternate as the colocated
engine's mixed steps do, and the running requests keep streaming through a burst (without
it, the burst's requests all started decoding after its last prompt, so their streams ended
together and the next burst came at once: TTFT p50 at 8 streams stayed near 1 s).
"""
from __future__ import annotations

import fcntl
import os

LOCK_DIR = "/dev/shm"


def parse_cores(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]; '' -> the cores this process may run on."""
    if not text.strip():
        return sorted(os.sched_getaffinity(0))
    cores = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"cpu_cores must be a list of cores such as '0-3,8', got {text!r}") from None
    allowed = os.sched_getaffinity(0)
    if not cores or not cores <= allowed:
        raise ValueError(f"cpu_cores {text!r} names cores this process may not use (allowed: "
                         f"{','.join(map(str, sorted(allowed)))})")
    return sorted(cores)


class CoreTurns:
    """Context manager around a step's forward and sampling: holds the turn of every core the
    engine runs on."""

    def __init__(self, cores: list[int], first: bool):
        self.first = first   # the prefill role: decode forwards that have not started wait behind it
        self.turns = [self._open(f"tandem-core{c}.turn") for c in cores]
        self.queue = [self._open(f"tandem-core{c}.queue") for c in cores]
        self.probes = [self._open(f"tandem-core{c}.{kind}") for kind in ("turn", "queue") for c in cores]
        self.waiting = [self._open(f"tandem-core{c}.waiting") for c in cores]  # decode engines waiting: shared

    @staticmethod
    def _open(name: str) -> int:
        fd = os.open(os.path.join(LOCK_DIR, name), os.O_CREAT | os.O_RDWR, 0o666)
        return fd

    def __enter__(self) -> "CoreTurns":
        if self.first:
            for fd in self.waiting:   # decode engines waiting for the cores take their turn first
                fcntl.flock(fd, fcntl.LOCK_EX)
                fcntl.flock(fd, fcntl.LOCK_UN)
            for fd in self.queue:
                fcntl.flock(fd, fcntl.LOCK_EX)
        else:  # wait while a prefill forward is queued on these cores
            for fd in self.queue:
                fcntl.flock(fd, fcntl.LOCK_SH)
                fcntl.flock(fd, fcntl.LOCK_UN)
        for fd in self.turns:
            fcntl.flock(fd, fcntl.LOCK_EX)
        for fd in self.queue if self.first else self.waiting:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return self

    def mark_waiting(self) -> None:
        """An engine that does not go first waits for the cores: the next prefill forward waits
        until this engine's forward has its turn (`__enter__` clears the mark), or `unmark`."""
        for fd in self.waiting:
            fcntl.flock(fd, fcntl.LOCK_SH)

    def unmark(self) -> None:
        """No forward follows the wait after all (nothing to run)."""
        for fd in self.waiting:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def busy(self) -> bool:
        """Whether another engine's forward holds these cores or a prefill forward is queued
        for them, so that a forward of an engine that does not go first would wait now. Probes
        on file descriptions of its own, so this engine's locks are never touched."""
        for fd in self.probes:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def __exit__(self, *exc) -> None:
        for fd in reversed(self.turns):
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in self.turns + self.queue + self.probes + self.waiting:
            os.close(fd)
