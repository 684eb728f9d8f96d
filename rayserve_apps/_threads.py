"""Torch threads of a replica follow its logical CPU reservation."""

from __future__ import annotations

import math

import torch


def set_torch_threads_for(num_cpus: float) -> int:
    """One torch thread per reserved CPU, at least one (a 0.5-CPU replica computes on one thread)."""
    threads = max(1, math.floor(num_cpus))
    torch.set_num_threads(threads)
    return threads
