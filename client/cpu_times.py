"""The machine's CPU time from /proc/stat, for benchmarks that share it.

On a VM the hypervisor can take a vCPU away (steal). A step of the CPU engine runs on every
core at once and waits at each OpenMP barrier for the slowest, so a vCPU taken for 40 ms
stalls the whole step: benchmark rows carry the share stolen while they ran."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CpuTimes:
    busy: int   # ticks in user, nice, system, irq, softirq (steal and guest not included)
    steal: int
    total: int  # every tick, idle and steal included

    def share_stolen_since(self, before: "CpuTimes") -> float:
        return (self.steal - before.steal) / max(1, self.total - before.total)


def read(stat: str = "/proc/stat") -> CpuTimes:
    # Fields of the "cpu" line: user nice system idle iowait irq softirq steal guest guest_nice;
    # guest time is already counted in user and nice.
    with open(stat) as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
    return CpuTimes(busy=user + nice + system + irq + softirq, steal=steal, total=sum(fields))
