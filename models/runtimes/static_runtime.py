"""Static-shape runtimes of a text encoder: one per (max length, batch size), Arlo's polymorphing unit (§2.3, §3.3).

A `StaticRuntime` is the encoder compiled for one fixed input shape [batch_size, max_length]. Requests are padded
to `max_length` tokens (attention mask 0, so the pooled embedding is unchanged) and the batch is filled with empty
rows up to `batch_size`; the compiled graph therefore always sees the same shape and never recompiles.

Backends, compared by `compare_backends` (keep the fastest that is exact against eager):

* ``eager``   - the plain module at the fixed shape (the reference);
* ``trace``   - TorchScript trace + `torch.jit.freeze` (constant-folded weights, fused ops);
* ``compile`` - `torch.compile(dynamic=False)` (Inductor, static shapes; slow to compile on a CPU).

`PackedStaticRuntime` composes polymorphing with ConcatBatching (TCB §4.1): the same fixed shape [rows, L], but
each row holds several requests concatenated, each with its own position ids restarting at 0 (TCB §4.1.1) and its
own token-type ids, attending only to itself through the block-diagonal mask (TCB §4.1.2, Eq. 5-6), then pooled
per request by the checkpoint's pooling. Packing is ops/packing.py's and the mask ops/concat_attention.py's; the
packed batch is padded to exactly `rows` rows of L tokens, so the compiled graph still sees one shape. A runtime of
length L thus serves every request of <= L tokens, several per row, instead of one padded request per row.

`DynamicRuntime` is the DT baseline (Arlo §2.2): one runtime for every length, padded only to the batch's longest
request; ``eager`` or ``compile`` with `dynamic=True`.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from torch import nn

from models.layers import ActivationState, run_layers
from models.text_encoder import TextEncoder
from ops.concat_attention import block_diagonal_mask, mask_kind_for
from ops.packing import PADDING_SEGMENT, PackedBatch, first_fit_decreasing, pack_requests, pooled_embeddings

logger = logging.getLogger(__name__)

StaticBackend = Literal["eager", "trace", "compile"]
DynamicBackend = Literal["eager", "compile"]
STATIC_BACKENDS: tuple[str, ...] = ("eager", "trace", "compile")
#: Largest absolute difference from the eager model for a runtime to count as exact (fp32 rounding only).
EXACT_ATOL = 1e-5


class PooledEncoder(nn.Module):
    """(input_ids, attention_mask, token_type_ids) -> embeddings pooled as the checkpoint says, via the model's
    layers."""

    def __init__(self, encoder: TextEncoder):
        super().__init__()
        self.layers = nn.ModuleList(encoder.layers())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        state = ActivationState(hidden=input_ids, attention_mask=attention_mask,
                                extras={"token_type_ids": token_type_ids})
        return run_layers(list(self.layers), state).hidden


@dataclass(frozen=True)
class PaddedBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    num_real: int


def pad_token_batch(token_ids: Sequence[Sequence[int]], length: int, rows: int, pad_id: int) -> PaddedBatch:
    """Right-pad each request to `length` tokens and the batch to `rows` rows (empty rows have an all-zero mask)."""
    if len(token_ids) > rows:
        raise ValueError(f"{len(token_ids)} requests exceed the runtime's batch size {rows}")
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, length), dtype=torch.long)
    for row, ids in enumerate(token_ids):
        if len(ids) > length:
            raise ValueError(f"request of {len(ids)} tokens exceeds the runtime's max length {length} tokens")
        if len(ids) == 0:
            raise ValueError("a request needs at least one token")
        input_ids[row, :len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
        attention_mask[row, :len(ids)] = 1
    return PaddedBatch(input_ids, attention_mask, torch.zeros_like(input_ids), len(token_ids))


def compile_static(module: nn.Module, example_args: tuple, backend: StaticBackend):
    """`module` compiled for the shapes of `example_args` by `backend`, and run once (compile and warm up now, not
    on the first request)."""
    if backend == "trace":
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer warnings about Python control flow on shapes: shapes are fixed
            fn = torch.jit.freeze(torch.jit.trace(module, example_args).eval())
    elif backend == "compile":
        fn = torch.compile(module, dynamic=False)
    else:
        fn = module
    with torch.inference_mode():
        fn(*example_args)
    return fn


def _check_static_shape(encoder: TextEncoder, max_length_tokens: int, rows_name: str, rows: int, backend: str) -> None:
    """ValueError naming the parameter when a static shape [rows, max_length_tokens] or its backend is invalid."""
    if max_length_tokens < 1 or max_length_tokens > encoder.max_length:
        raise ValueError(f"max_length_tokens must be in [1, {encoder.max_length}] (the model's limit), got "
                         f"{max_length_tokens}")
    if rows < 1:
        raise ValueError(f"{rows_name} must be >= 1, got {rows}")
    if backend not in STATIC_BACKENDS:
        raise ValueError(f"backend must be one of {STATIC_BACKENDS}, got {backend!r}")


class StaticRuntime:
    """The encoder at one fixed shape [batch_size, max_length_tokens]."""

    def __init__(self, encoder: TextEncoder, max_length_tokens: int, batch_size: int = 1,
                 backend: StaticBackend = "trace"):
        _check_static_shape(encoder, max_length_tokens, "batch_size", batch_size, backend)
        self.encoder = encoder
        self.max_length_tokens = max_length_tokens
        self.batch_size = batch_size
        self.backend = backend
        self.pad_id = encoder.tokenizer.pad_token_id or 0
        module = PooledEncoder(encoder).eval()
        example = pad_token_batch([[self.pad_id]], max_length_tokens, batch_size, self.pad_id)
        args = (example.input_ids, example.attention_mask, example.token_type_ids)
        started = time.perf_counter()
        self._fn = compile_static(module, args, backend)
        self.build_s = time.perf_counter() - started
        logger.info("static runtime L=%d b=%d (%s) built in %.1fs", max_length_tokens, batch_size, backend,
                    self.build_s)

    @torch.inference_mode()
    def run_tokens(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Embeddings [len(token_ids), hidden] for up to `batch_size` requests of at most `max_length_tokens`."""
        batch = pad_token_batch(token_ids, self.max_length_tokens, self.batch_size, self.pad_id)
        return self._fn(batch.input_ids, batch.attention_mask, batch.token_type_ids)[:batch.num_real].clone()

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """Tokenize (rejecting texts longer than the runtime) and run in chunks of `batch_size`."""
        ids = [self.encoder.tokenizer(t, add_special_tokens=True, truncation=False)["input_ids"] for t in texts]
        chunks = [self.run_tokens(ids[k:k + self.batch_size]) for k in range(0, len(ids), self.batch_size)]
        return torch.cat(chunks) if chunks else torch.empty(0, self.encoder.hidden_size)


class PackedBodyEncoder(nn.Module):
    """(input_ids, position_ids, token_type_ids, segment_ids) of a packed batch -> last hidden states.

    The embeddings and blocks of the model's layer view (the head's padded pooling is replaced by the
    per-request pooling of ops/packing.py, outside the graph); the block-diagonal mask (TCB Eq. 6) is built inside
    the graph from the segment ids, so the runtime's inputs are four [rows, L] integer tensors.
    """

    def __init__(self, encoder: TextEncoder):
        super().__init__()
        self.layers = nn.ModuleList([layer for layer in encoder.layers() if layer.kind != "head"])
        self.mask_kind = mask_kind_for(encoder.model.config._attn_implementation)
        self.dtype = encoder.model.dtype

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, token_type_ids: torch.Tensor,
                segment_ids: torch.Tensor) -> torch.Tensor:
        state = ActivationState(
            hidden=input_ids,
            attention_mask=(segment_ids != PADDING_SEGMENT).long(),
            attention_bias=block_diagonal_mask(segment_ids, self.mask_kind, self.dtype),
            extras={"position_ids": position_ids, "token_type_ids": token_type_ids},
        )
        return run_layers(list(self.layers), state).hidden


def pad_packed_rows(batch: PackedBatch, rows: int, pad_id: int) -> tuple[torch.Tensor, ...]:
    """A packed batch's (input_ids, position_ids, token_type_ids, segment_ids) padded to exactly `rows` rows.

    Padding rows are all padding segment: they attend only to themselves, and pooling ignores them.
    """
    executed, width = batch.input_ids.shape
    if executed > rows:
        raise ValueError(f"packed batch uses {executed} rows, more than the runtime's {rows} rows")
    if executed == rows:
        return batch.input_ids, batch.position_ids, batch.token_type_ids, batch.segment_ids
    filled = []
    for tensor, value in ((batch.input_ids, pad_id), (batch.position_ids, 0), (batch.token_type_ids, 0),
                          (batch.segment_ids, PADDING_SEGMENT)):
        full = torch.full((rows, width), value, dtype=tensor.dtype)
        full[:executed] = tensor
        filled.append(full)
    return tuple(filled)


@dataclass(frozen=True)
class PackedRunResult:
    """Embeddings in request order and how many fixed-shape forward passes computed them."""

    embeddings: torch.Tensor  #: [requests, hidden], pooled as the checkpoint says
    forward_passes: int
    rows_used: int  #: rows holding at least one request, over all passes


class PackedStaticRuntime:
    """The encoder at one fixed shape [rows, max_length_tokens], fed ConcatBatching packed batches (TCB §4.1).

    Requests of <= max_length_tokens are packed into rows by first-fit-decreasing (ops/packing.py), `rows` rows per
    forward pass; every pass is padded to exactly [rows, max_length_tokens], so a traced and frozen graph never
    recompiles. Parameter names: max_length_tokens is TCB's L (§5.1) and Arlo's runtime max length; rows is TCB's B.
    """

    def __init__(self, encoder: TextEncoder, max_length_tokens: int, rows: int = 1, backend: StaticBackend = "trace"):
        _check_static_shape(encoder, max_length_tokens, "rows", rows, backend)
        self.encoder = encoder
        self.max_length_tokens = max_length_tokens  # TCB §5.1: L
        self.rows = rows  # TCB §5.1: B
        self.batch_size = rows  # the padded runtime's name for the same dimension
        self.backend = backend
        self.pad_id = encoder.tokenizer.pad_token_id or 0
        module = PackedBodyEncoder(encoder).eval()
        example = pack_requests([[self.pad_id]], max_length_tokens, pad_token_id=self.pad_id, trim=False)
        args = pad_packed_rows(example, rows, self.pad_id)
        started = time.perf_counter()
        self._fn = compile_static(module, args, backend)
        self.build_s = time.perf_counter() - started
        logger.info("packed static runtime L=%d rows=%d (%s) built in %.1fs", max_length_tokens, rows, backend,
                    self.build_s)

    def plan(self, lengths: Sequence[int]) -> list[list[list[int]]]:
        """Request indices per row, rows grouped into forward passes of at most `rows` rows (first-fit-decreasing)."""
        bins = first_fit_decreasing(lengths, self.max_length_tokens, limit_name="max_length_tokens")
        return [bins[k:k + self.rows] for k in range(0, len(bins), self.rows)]

    def num_passes(self, lengths: Sequence[int]) -> int:
        """Forward passes `run_tokens` needs for requests of these lengths."""
        return len(self.plan(lengths))

    @torch.inference_mode()
    def run_tokens(self, token_ids: Sequence[Sequence[int]]) -> PackedRunResult:
        """Embeddings [len(token_ids), hidden] of any number of requests of at most `max_length_tokens` each."""
        lengths = [len(ids) for ids in token_ids]
        out = torch.empty(len(token_ids), self.encoder.hidden_size)
        passes = self.plan(lengths)
        for rows in passes:
            members = [i for row in rows for i in row]
            local = {index: k for k, index in enumerate(members)}
            batch = pack_requests([token_ids[i] for i in members], self.max_length_tokens,
                                  bins=[[local[i] for i in row] for row in rows], pad_token_id=self.pad_id, trim=False)
            hidden = self._fn(*pad_packed_rows(batch, self.rows, self.pad_id))
            out[members] = pooled_embeddings(hidden[:batch.input_ids.shape[0]], batch, self.encoder.pooling)
        return PackedRunResult(out, len(passes), sum(len(rows) for rows in passes))

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """Tokenize (rejecting texts longer than the runtime) and run packed."""
        ids = [self.encoder.tokenizer(t, add_special_tokens=True, truncation=False)["input_ids"] for t in texts]
        return self.run_tokens(ids).embeddings if ids else torch.empty(0, self.encoder.hidden_size)


class DynamicRuntime:
    """DT baseline: one runtime for all lengths, each batch padded only to its longest request."""

    def __init__(self, encoder: TextEncoder, backend: DynamicBackend = "eager"):
        if backend not in ("eager", "compile"):
            raise ValueError(f"backend must be 'eager' or 'compile', got {backend!r}")
        self.encoder = encoder
        self.backend = backend
        self.pad_id = encoder.tokenizer.pad_token_id or 0
        module = PooledEncoder(encoder).eval()
        self._fn = torch.compile(module, dynamic=True) if backend == "compile" else module

    @torch.inference_mode()
    def run_tokens(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        longest = max(len(ids) for ids in token_ids)
        if longest > self.encoder.max_length:
            raise ValueError(f"request of {longest} tokens exceeds the model's max length {self.encoder.max_length} "
                             "tokens")
        batch = pad_token_batch(token_ids, longest, len(token_ids), self.pad_id)
        return self._fn(batch.input_ids, batch.attention_mask, batch.token_type_ids)


def time_call(fn, repeats: int, warmup: int = 1, statistic: str = "median", clock=time.perf_counter) -> float:
    """Seconds of `fn()` over `repeats` runs after `warmup` runs: the median, or the minimum (robust to neighbours
    stealing the CPU on a shared machine: interference only ever adds time). `clock=time.thread_time` measures the
    calling thread's CPU time instead of the wall clock (torch with one thread computes in the calling thread)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        started = clock()
        fn()
        samples.append(clock() - started)
    samples.sort()
    return samples[0] if statistic == "min" else samples[len(samples) // 2]


@dataclass(frozen=True)
class BackendComparison:
    """One backend at one shape: build time, median latency and largest difference from eager."""

    backend: str
    build_s: float
    latency_s: float
    max_abs_diff: float

    @property
    def exact(self) -> bool:
        return self.max_abs_diff <= EXACT_ATOL


def synthetic_token_batch(encoder: TextEncoder, length: int, rows: int, seed: int = 0) -> list[list[int]]:
    """Requests of `length` real tokens (CLS, random vocabulary ids, SEP): a stand-in input for timing."""
    generator = torch.Generator().manual_seed(seed)
    cls_id = encoder.tokenizer.cls_token_id if encoder.tokenizer.cls_token_id is not None else 101
    sep_id = encoder.tokenizer.sep_token_id if encoder.tokenizer.sep_token_id is not None else 102
    vocab = encoder.model.config.vocab_size
    body = torch.randint(1000, vocab, (rows, max(length - 2, 0)), generator=generator).tolist()
    return [([cls_id] + ids + [sep_id])[:length] for ids in body]


def compare_backends(encoder: TextEncoder, max_length_tokens: int, batch_size: int,
                     backends: Sequence[str] = STATIC_BACKENDS, repeats: int = 5,
                     clock=time.perf_counter) -> list[BackendComparison]:
    """Build each backend at one shape, check it against eager on real-length inputs, and time it."""
    requests = synthetic_token_batch(encoder, max(max_length_tokens // 2, 2), batch_size)
    requests[0] = requests[0][:max(2, max_length_tokens // 4)]  # lengths differ inside the batch
    reference = DynamicRuntime(encoder).run_tokens([[*ids] for ids in requests])
    results = []
    for backend in backends:
        runtime = StaticRuntime(encoder, max_length_tokens, batch_size, backend=backend)  # type: ignore[arg-type]
        output = runtime.run_tokens(requests)
        diff = float((output - reference).abs().max())
        latency = time_call(lambda: runtime.run_tokens(requests), repeats, statistic="min", clock=clock)
        results.append(BackendComparison(backend, runtime.build_s, latency, diff))
        logger.info("backend %s: build %.1fs, %.2f ms, max |diff| %.2e", backend, runtime.build_s, latency * 1e3, diff)
    return results


def fastest_exact_backend(comparisons: Sequence[BackendComparison]) -> str:
    """The fastest backend whose output matches eager within EXACT_ATOL."""
    exact = [c for c in comparisons if c.exact]
    if not exact:
        raise ValueError("no backend matched the eager model")
    return min(exact, key=lambda c: c.latency_s).backend
