"""Text-encoder runtimes built from a model and the ops/ kernels: static-shape runtimes per (max length, batch size)
(Arlo §2.3, §3.3), their packed (ConcatBatching) and dynamic counterparts, and the latency-staircase measurement
that picks runtime lengths.
"""

from models.runtimes.static_runtime import (
    StaticBackend, DynamicBackend, PooledEncoder, PaddedBatch, pad_token_batch, compile_static, StaticRuntime,
    PackedBodyEncoder, pad_packed_rows, PackedRunResult, PackedStaticRuntime, DynamicRuntime, time_call,
    BackendComparison, synthetic_token_batch, compare_backends, fastest_exact_backend,
)
from models.runtimes.length_staircase import Staircase, measure_staircase, measure_runtime_latencies

__all__ = [
    "StaticBackend", "DynamicBackend", "PooledEncoder", "PaddedBatch", "pad_token_batch", "compile_static",
    "StaticRuntime", "PackedBodyEncoder", "pad_packed_rows", "PackedRunResult", "PackedStaticRuntime",
    "DynamicRuntime", "time_call", "BackendComparison", "synthetic_token_batch", "compare_backends",
    "fastest_exact_backend", "Staircase", "measure_staircase", "measure_runtime_latencies",
]
