"""Torch intra-op threads of a replica: its logical CPU reservation at start, then the cores left idle.

`set_torch_threads_for` sets one thread per reserved CPU. `LoadFollowingThreads` sets them before each batch from
what the machine leaves idle (`/proc/stat`'s idle and iowait time since the previous batch) plus what this process
itself used in that time (`time.process_time`), shared among this process's batches running at once: one batch on an
otherwise idle machine computes on every core, and batches of several replicas at once split the cores instead of
oversubscribing them.

Only a core that was free nearly all the time (`WHOLE_CORE_FRACTION`) gets a thread. torch's OpenMP threads meet at
a barrier after every operator, so a thread on a core that other processes use in part (the ingress, Ray's own
processes, other replicas) makes the whole batch wait for it while the threads that wait spin on their own cores:
the thread adds more CPU time than it takes off the batch's time, CPU that the other processes on the host lack.
"""

from __future__ import annotations

import math
import os
import time

import torch

from parallel.host_cpu import read_host_cpu_s

#: The share of a core that must have been idle (or this process's own) for the core to get a thread.
WHOLE_CORE_FRACTION = 0.9


def set_torch_threads_for(num_cpus: float) -> int:
    """One torch thread per reserved CPU, at least one (a 0.5-CPU replica computes on one thread)."""
    threads = max(1, math.floor(num_cpus))
    torch.set_num_threads(threads)
    return threads


def threads_for_load(idle_cores: float, own_cores: float, total_cores: int, batches_running: int) -> int:
    """Threads for one batch: the cores idle or used by this process, shared by its `batches_running` batches,
    counting a core only when at least `WHOLE_CORE_FRACTION` of it is free, between 1 and `total_cores`."""
    if total_cores < 1:
        raise ValueError(f"total_cores must be >= 1, got {total_cores}")
    available = max(0.0, idle_cores) + max(0.0, own_cores)
    share = available / max(1, batches_running)
    whole = math.floor(share)
    threads = whole + (1 if share - whole >= WHOLE_CORE_FRACTION else 0)
    return max(1, min(total_cores, threads))


def read_cpu_idle_s(stat_path: str = "/proc/stat") -> tuple[float, float] | None:
    """(idle + iowait seconds, all seconds) summed over the machine's cores since boot; None where /proc/stat is
    absent (`parallel.host_cpu`)."""
    return read_host_cpu_s(stat_path)


class LoadFollowingThreads:
    """Sets torch's intra-op threads before each batch from the idle cores measured since the previous one."""

    def __init__(self, total_cores: int | None = None, stat_path: str = "/proc/stat"):
        self.total_cores = total_cores or os.cpu_count() or 1
        self.stat_path = stat_path
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        cpu = read_cpu_idle_s(self.stat_path)
        if cpu is None:
            return None
        return time.monotonic(), cpu[0], time.process_time()

    def before_batch(self, batches_running: int = 1) -> int:
        """Set and return the threads for the batch about to run (the current setting where /proc/stat is absent
        or no time has passed)."""
        now = self._sample()
        last, self._last = self._last, now
        if now is None or last is None or now[0] <= last[0]:
            return torch.get_num_threads()
        elapsed = now[0] - last[0]
        threads = threads_for_load((now[1] - last[1]) / elapsed, (now[2] - last[2]) / elapsed, self.total_cores,
                                   batches_running)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads
