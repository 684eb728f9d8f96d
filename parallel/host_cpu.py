"""The host's CPU time since boot from /proc/stat, the one reader every part uses (the profiler's foreign-load meter,
the replicas' load-following intra-op threads).

/proc/stat's first line sums every core: `cpu user nice system idle iowait irq softirq steal guest guest_nice`
(proc(5)), in clock ticks; guest time is already inside user, so the first eight fields are the whole.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple


class HostCpuSeconds(NamedTuple):
    """CPU seconds of the whole host since boot, summed over its cores."""

    idle_s: float  #: idle and iowait
    total_s: float  #: user, nice, system, idle, iowait, irq, softirq and steal

    @property
    def busy_s(self) -> float:
        """All but idle and iowait: every process's time and the hypervisor's steal."""
        return self.total_s - self.idle_s


def read_host_cpu_s(stat_path: str | Path = "/proc/stat", ticks_per_s: int | None = None) -> HostCpuSeconds | None:
    """The host's CPU seconds from `stat_path`'s aggregate `cpu` line; None where it is absent or not that format
    (off Linux)."""
    try:
        with open(stat_path) as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if len(fields) < 5 or fields[0] != "cpu":
        return None
    ticks = [int(value) for value in fields[1:9]] + [0] * (9 - min(9, len(fields)))  # older kernels: fewer fields
    hertz = ticks_per_s or os.sysconf("SC_CLK_TCK")
    return HostCpuSeconds(idle_s=(ticks[3] + ticks[4]) / hertz, total_s=sum(ticks) / hertz)
