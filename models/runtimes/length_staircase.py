"""Measure a text encoder's latency staircase: static-runtime latency by max length, and by batch size per runtime.

Arlo §3.3 picks runtime lengths where a static runtime's latency jumps (TensorRT Bert: every 64 tokens). On another
device or compiler the steps differ, so plexserve measures them: `measure_staircase` times a static runtime at each
candidate length, `placement.arlo.runtimes.choose_runtime_lengths` turns the curve into runtime lengths, and
`measure_runtime_latencies` profiles the chosen runtimes by batch size (Arlo's L_i, from which M_i follows).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

from models.runtimes.static_runtime import StaticBackend, StaticRuntime, synthetic_token_batch, time_call
from models.text_encoder import TextEncoder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Staircase:
    lengths_tokens: list[int]
    latencies_s: list[float]
    batch_size: int
    backend: str


def measure_staircase(encoder: TextEncoder, lengths_tokens: Sequence[int], batch_size: int = 1,
                      backend: StaticBackend = "trace", repeats: int = 5, clock=time.perf_counter) -> Staircase:
    """Latency of a static runtime compiled at each length (inputs of two tokens: padding is the cost).

    The minimum over `repeats` runs: on a shared machine interference only adds time, and a step must come from
    the runtime, not from a neighbour.
    """
    latencies = []
    for index, length in enumerate(lengths_tokens):
        runtime = StaticRuntime(encoder, int(length), batch_size, backend=backend)
        requests = synthetic_token_batch(encoder, min(2, int(length)), batch_size)
        latencies.append(time_call(lambda: runtime.run_tokens(requests), repeats, statistic="min", clock=clock))
        logger.info("staircase %d/%d: L=%d -> %.2f ms", index + 1, len(lengths_tokens), length, latencies[-1] * 1e3)
    return Staircase([int(x) for x in lengths_tokens], latencies, batch_size, backend)


def measure_runtime_latencies(encoder: TextEncoder, max_length_tokens: int, batch_sizes: Sequence[int],
                              backend: StaticBackend = "trace", repeats: int = 5,
                              clock=time.perf_counter) -> dict[int, float]:
    """Batch size -> seconds (minimum of `repeats`) of the runtime at `max_length_tokens`, one runtime per batch
    size."""
    result = {}
    for batch in batch_sizes:
        runtime = StaticRuntime(encoder, max_length_tokens, int(batch), backend=backend)
        requests = synthetic_token_batch(encoder, max_length_tokens, int(batch))
        result[int(batch)] = time_call(lambda: runtime.run_tokens(requests), repeats, statistic="min")
        logger.info("runtime L=%d b=%d -> %.2f ms", max_length_tokens, batch, result[int(batch)] * 1e3)
    return result
