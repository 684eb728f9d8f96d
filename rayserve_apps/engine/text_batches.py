"""Text batches: TCB's schedulers choose the texts, ConcatBatching packs them, a backend runs the encoder.

`TextBatchFormer` keeps a model's waiting texts as `placement.tcb.batch_scheduler.TextRequest`s (length, arrival, the
model's SLO as deadline) and asks the configured scheduler (DAS by default, TCB Alg. 1; Slotted DAS, Alg. 2;
FCFS, SJF, EDF) for the next batch of B rows x L tokens once the rows are full, the oldest text has waited
`batch_wait_s`, or (`dispatch_when_idle`) at once when none of the model's batches runs
(`placement.tcb.dispatch.batch_ready_at_s`). With `refuse_early`, a call whose texts cannot finish by their deadline
behind the batch running and the queued tokens is answered 503 `overloaded` on arrival
(`placement.tcb.dispatch.admits`, from when the running batch is predicted to end). Texts whose
deadline passes before they are scheduled are dropped (TCB §5.2) and answered 503. Once the engine has timed a few
batches (`batch_cost.BatchCostEstimate`), the scheduler's batch is cut to what finishes by its deadlines, and
requests that cannot finish in time even alone are dropped before they run
(`placement.tcb.deadline_fit`, AlpaServe §6.5's rule): a late answer counts for nothing and costs the others.

`pack_text_batch` turns a formed batch into one `PackedBatch` (ops/packing.py): the scheduler's texts concatenated
into rows (re-laid into the narrowest rows that hold them, `ops.packing.narrowest_rows`) or its slots, with per-text
positions and a block-diagonal mask (TCB §4.1). A polymorphing model (Arlo) instead
packs into rows of its ideal runtime's fixed width (Arlo §3.4, Alg. 1 lines 18-19), untrimmed.

Backends: `InProcessTextBackend` runs the packed forward in a worker thread of this process;
`StagedTextBackend` sends it through a device group's stage actors (`parallel.ModelParallelGroup`). Both pool each
text's tokens here, with the checkpoint's pooling (`models.text_encoder.checkpoint_pooling`), and answer float32 numpy
rows (cheap to pickle back to the ingress).
"""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence

import numpy as np
import torch

from models.layers import ActivationState
from models.packed_text import PackedTextEncoder
from ops.concat_attention import block_diagonal_mask
from ops.packing import PackedBatch, narrowest_rows, pack_requests, pooled_embeddings
from ops.pooling import DEFAULT_POOLING, Pooling
from parallel.group_runtime import ModelParallelGroup
from placement.arlo.runtimes import ideal_runtime_length
from placement.core.deployment_spec import ModelSpec, PolicySpec
from placement.tcb.batch_scheduler import BatchDecision, BatchScheduler, TextRequest, make_batch_scheduler
from placement.tcb.deadline_fit import fit_to_deadlines
from placement.tcb.dispatch import admits, batch_ready_at_s
from rayserve_apps._threads import LoadFollowingThreads
from rayserve_apps.engine.batch_cost import BatchCostEstimate
from rayserve_apps.engine.engine import FormedBatch, WorkItem
from rayserve_apps.requests import RequestError

#: Batching policy of a text model whose spec names none (TCB Alg. 1).
DEFAULT_BATCHING_POLICY = "das"


def batching_scheduler_for(model: ModelSpec, policy: PolicySpec | dict | None, limit_tokens: int) -> BatchScheduler:
    """The model's batch scheduler; ValueError naming the field for a bad policy.

    Without `row_length_tokens` the row is as long as the model's input limit, so every accepted text fits a row.
    """
    if isinstance(policy, dict):
        policy = PolicySpec.model_validate(policy)
    policy = policy or model.policies.get("batching") or PolicySpec(name=DEFAULT_BATCHING_POLICY)
    params = dict(policy.params)
    params.setdefault("row_length_tokens", limit_tokens)
    try:
        return make_batch_scheduler(policy.name, params)
    except ValueError as error:
        raise ValueError(f"model {model.name!r} policies.batching: {error}") from None


class TextBatchFormer:
    """A model's waiting texts and its TCB scheduler (the engine's `BatchFormer` for text encoders)."""

    def __init__(self, model: str, scheduler: BatchScheduler, batch_wait_s: float, slo_ms: float):
        self.model = model
        self.scheduler = scheduler
        self.batch_wait_s = batch_wait_s
        self.slo_ms = slo_ms
        self.capacity_tokens = scheduler.params.num_rows * scheduler.params.row_length_tokens
        self._queue: list[TextRequest] = []
        self._queued_tokens = 0
        #: Seconds of a batch by its tokens, from the batches run (cuts each batch to its deadlines).
        self.cost = BatchCostEstimate()
        #: Texts refused on arrival (`refuse_early`).
        self.refused_early = 0
        #: Predicted ends of the batches formed and not yet completed (by the batch's id): an arrival's texts start
        #: once the first of them ends, not now. A batch that failed is forgotten once its predicted end passed.
        self._running_until_s: dict[int, float] = {}

    def _refuses(self, items: Sequence[WorkItem]) -> bool:
        if not items or not self.scheduler.params.refuse_early:
            return False
        now_s = items[0].arrival_s
        if not self.cost.ready(now_s):
            return False
        deadline_s = min(item.deadline_s for item in items)
        tokens = sum(len(item.payload) for item in items)
        return not admits(self.free_at_s(now_s), deadline_s, self._queued_tokens, tokens, self.capacity_tokens,
                          self.cost.seconds)

    def free_at_s(self, now_s: float) -> float:
        """When the next batch can start: now, or when the earliest batch running is predicted to end (TCB §5.2's
        deadline check counts the work ahead of a request; the batch on the device is part of it)."""
        running = self._running_until_s
        for key in [key for key, end_s in running.items() if end_s <= now_s]:
            del running[key]
        return min(running.values(), default=now_s)

    def add(self, items: Sequence[WorkItem]) -> None:
        """Queue one call's texts; refused at once (503 overloaded) when they cannot finish by their deadline."""
        if self._refuses(items):
            error = RequestError(503, "overloaded", f"model {self.model!r} is overloaded: the texts queued ahead "
                                 f"cannot be answered within the {self.slo_ms:g} ms SLO; retry later")
            for item in items:
                if not item.future.done():
                    item.future.set_exception(error)
            self.refused_early += len(items)
            return
        for item in items:
            request = TextRequest(request_id=item, length_tokens=len(item.payload), arrival_s=item.arrival_s,
                                  deadline_s=item.deadline_s)
            self._queue.append(request)
            self._queued_tokens += request.length_tokens

    def queued(self) -> int:
        return len(self._queue)

    def ready_at_s(self, now_s: float, batches_running: int = 0) -> float:
        return batch_ready_at_s(now_s, min(r.arrival_s for r in self._queue), self._queued_tokens,
                                self.capacity_tokens, self.batch_wait_s, batches_running,
                                self.scheduler.params.dispatch_when_idle)

    def form(self, now_s: float) -> FormedBatch:
        live = [r for r in self._queue if not r.request_id.future.done()]  # callers that went away
        decision = self.scheduler.form_batch(now_s, live)
        if self.cost.ready(now_s):
            decision = fit_to_deadlines(decision, live, now_s, self.cost.seconds)
        self._queue = decision.remaining(live)
        self._queued_tokens = sum(r.length_tokens for r in self._queue)
        refused = [(r.request_id, RequestError(
            503, "deadline_exceeded", f"model {self.model!r}: a text could not be answered within its {self.slo_ms:g} "
            "ms SLO (its deadline passed, or would pass before its batch ends)")) for r in decision.dropped]
        batch = FormedBatch(items=[r.request_id for r in decision.requests], plan=decision, refused=refused)
        if decision.requests and self.cost.ready(now_s):
            self._running_until_s[id(batch)] = now_s + self.cost.seconds(decision.num_tokens)
        return batch

    def completed(self, batch: FormedBatch, started_s: float, finish_s: float) -> None:
        self._running_until_s.pop(id(batch), None)
        if batch.plan is not None:
            self.cost.add(batch.plan.num_tokens, finish_s - started_s, finish_s)


def pack_text_batch(batch: FormedBatch, scheduler: BatchScheduler, pad_token_id: int,
                    runtime_lengths_tokens: Sequence[int] = ()) -> PackedBatch:
    """The formed batch as one packed forward pass: the scheduler's rows, or (Arlo) rows of the ideal runtime's
    width for the batch's longest text, untrimmed."""
    token_ids = [item.payload for item in batch.items]
    if runtime_lengths_tokens:
        width = ideal_runtime_length(runtime_lengths_tokens, max(len(ids) for ids in token_ids))
        return pack_requests(token_ids, row_length_tokens=width, pad_token_id=pad_token_id, trim=False)
    decision: BatchDecision = batch.plan
    params = scheduler.params
    if decision.slot_size_tokens is None:  # rows: the chosen texts in the rows that compute the fewest positions
        bins = narrowest_rows([len(ids) for ids in token_ids], params.row_length_tokens, params.num_rows)
    else:  # slots (Slotted DAS): the scheduler's slots as chosen
        position = {id(item): i for i, item in enumerate(batch.items)}
        bins = [[position[id(r.request_id)] for r in members] for members in decision.bins()]
    return pack_requests(token_ids, params.row_length_tokens, num_rows=params.num_rows,
                         slot_size_tokens=decision.slot_size_tokens, bins=bins, pad_token_id=pad_token_id)


def packed_state(batch: PackedBatch, mask_dtype: torch.dtype = torch.float32) -> ActivationState:
    """The encoder body's input for a packed batch: ids, per-text positions and the block-diagonal bias."""
    return ActivationState(
        hidden=batch.input_ids, attention_mask=batch.attention_mask,
        attention_bias=block_diagonal_mask(batch.segment_ids, "additive", mask_dtype),
        extras={"position_ids": batch.position_ids, "token_type_ids": batch.token_type_ids},
    )


def embedding_rows(embeddings: torch.Tensor) -> list[np.ndarray]:
    """One float32 row per text (numpy pickles far cheaper than lists of Python floats)."""
    array = embeddings.detach().to(torch.float32).cpu().numpy()
    return list(array)


class InProcessTextBackend:
    """Runs packed batches through the encoder in a worker thread of this process."""

    def __init__(self, packed: PackedTextEncoder, scheduler: BatchScheduler,
                 on_packed: Callable[[PackedBatch], None] | None = None,
                 threads: LoadFollowingThreads | None = None):
        self.packed = packed
        self.scheduler = scheduler
        self.on_packed = on_packed
        #: Sets torch's threads from the idle cores before each batch (None: the threads stay as set).
        self.threads = threads

    def _run(self, batch: FormedBatch) -> list[np.ndarray]:
        if self.threads is not None:
            self.threads.before_batch()  # in the worker thread that runs the forward
        packed = pack_text_batch(batch, self.scheduler, self.packed.pad_token_id)
        if self.on_packed is not None:
            self.on_packed(packed)
        return embedding_rows(self.packed.embed_packed(packed).embeddings)

    async def execute(self, batch: FormedBatch) -> list[np.ndarray]:
        return await asyncio.to_thread(self._run, batch)


class StagedTextBackend:
    """Runs packed batches through a device group's stage actors (embeddings and blocks); pools here with the
    model's `pooling`."""

    def __init__(self, runtime: ModelParallelGroup, scheduler: BatchScheduler, pad_token_id: int,
                 runtime_lengths_tokens: Sequence[int] = (), on_packed: Callable[[PackedBatch], None] | None = None,
                 pooling: Pooling = DEFAULT_POOLING):
        self.runtime = runtime
        self.pooling = pooling
        self.scheduler = scheduler
        self.pad_token_id = pad_token_id
        self.runtime_lengths_tokens = tuple(runtime_lengths_tokens)
        self.on_packed = on_packed

    async def execute(self, batch: FormedBatch) -> list[np.ndarray]:
        packed = pack_text_batch(batch, self.scheduler, self.pad_token_id, self.runtime_lengths_tokens)
        if self.on_packed is not None:
            self.on_packed(packed)
        hidden = (await self.runtime.infer_async(packed_state(packed))).hidden
        return embedding_rows(pooled_embeddings(hidden, packed, self.pooling))
