"""Text-encoder runtimes built from a model and the ops/ kernels: static-shape runtimes per (max length, batch size)
(Arlo §2.3, §3.3), their packed (ConcatBatching) and dynamic counterparts, and the latency-staircase measurement
that picks runtime lengths.
"""

from models.runtimes.length_staircase import Staircase, measure_runtime_latencies, measure_staircase
from models.runtimes.static_runtime import (
    BackendComparison,
    DynamicBackend,
    DynamicRuntime,
    PackedBodyEncoder,
    PackedRunResult,
    PackedStaticRuntime,
    PaddedBatch,
    PooledEncoder,
    StaticBackend,
    StaticRuntime,
    compare_backends,
    compile_static,
    fastest_exact_backend,
    pad_packed_rows,
    pad_token_batch,
    synthetic_token_batch,
    time_call,
)

__all__ = [
    "StaticBackend", "DynamicBackend", "PooledEncoder", "PaddedBatch", "pad_token_batch", "compile_static",
    "StaticRuntime", "PackedBodyEncoder", "pad_packed_rows", "PackedRunResult", "PackedStaticRuntime",
    "DynamicRuntime", "time_call", "BackendComparison", "synthetic_token_batch", "compare_backends",
    "fastest_exact_backend", "Staircase", "measure_staircase", "measure_runtime_latencies",
]
