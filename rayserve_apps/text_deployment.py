"""The per-model text deployment: a replica that embeds already tokenized texts with ConcatBatching (TCB).

The ingress tokenizes and validates; this replica re-checks the token ids (a handle caller may skip the ingress).
Every text of every call becomes one waiting request (placement/tcb/batch_scheduler.py `TextRequest`: its length,
arrival and the model's SLO as deadline). A batch-forming loop, one per replica, asks the configured scheduler
(`spec.policy("batching", model)`: das by default, or slotted_das, fcfs, sjf, edf) for the next batch of B rows of
L tokens, packs it (ops/packing.py) and runs the packed forward (models/packed_text.py) in a worker thread, so new
calls keep queueing meanwhile. Texts whose deadline passes before they are scheduled are dropped (TCB §5.2) and
their call fails with a 503 `deadline_exceeded`.

Custom metrics (`ray.serve.metrics`): tokens per batch, padding fraction, requests per batch, utility (TCB Eq. 9)
and dropped requests.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from models.packed_text import PackedTextEncoder
from models.text_encoder import load_text_encoder
from placement.core.deployment_spec import ModelSpec, PolicySpec
from placement.tcb.batch_scheduler import BatchDecision, BatchScheduler, TextRequest, make_batch_scheduler
from rayserve_apps import metrics
from rayserve_apps._threads import set_torch_threads_for
from rayserve_apps.requests import RequestError

logger = logging.getLogger("ray.serve")

#: Batching policy of a text replica whose spec names none (TCB Alg. 1).
DEFAULT_BATCHING_POLICY = "das"
#: Calls a replica accepts at once: many, so that the scheduler sees enough waiting texts to fill its rows.
MAX_ONGOING_REQUESTS = 256
#: How long the loop waits before re-checking a queue the scheduler could not take anything from, in seconds.
IDLE_RECHECK_S = 0.01
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


@dataclass
class _Call:
    """One `embed_token_ids` call: its texts, and the future its caller awaits."""

    token_ids: list[list[int]]
    future: asyncio.Future
    embeddings: list[list[float] | None] = field(default_factory=list)
    remaining: int = 0

    def fail(self, error: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS)
class TextModelDeployment:
    """Hosts one text encoder; `embed_token_ids` is its whole API."""

    def __init__(self, model_spec: dict, batching_policy: dict | None = None):
        self.spec = ModelSpec.model_validate(model_spec)
        set_torch_threads_for(self.spec.num_cpus_per_replica)
        self.encoder = load_text_encoder(self.spec.source, name=self.spec.name)
        self.limit = self.spec.max_input_length_tokens or self.encoder.max_length
        self.scheduler = batching_scheduler_for(self.spec, batching_policy, self.limit)
        self.packed = PackedTextEncoder(self.encoder)
        self.wait_s = self.spec.batch_wait_timeout_ms / 1000.0
        self._queue: list[TextRequest] = []
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count()
        self._arrived: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._totals = {"batches": 0, "texts": 0, "real_tokens": 0, "computed_tokens": 0, "dropped": 0}
        logger.info("text replica %s: %s batching, %d rows x %d tokens", self.spec.name, self.scheduler.name,
                    self.scheduler.params.num_rows, self.scheduler.params.row_length_tokens)

    async def embed_token_ids(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Unit-norm embeddings of tokenized texts, in input order; ValueError for bad ids."""
        if not isinstance(token_ids, list) or not token_ids:
            raise ValueError("token_ids must be a non-empty list of token id lists")
        self.encoder.text_tokenizer.check_token_ids(token_ids, self.limit)
        limit = self.scheduler.max_request_tokens
        for index, ids in enumerate(token_ids):
            if len(ids) > limit:
                raise ValueError(f"token_ids[{index}] has {len(ids)} tokens; the batch rows of this replica hold at most {limit}")
        self._ensure_loop()
        now = time.monotonic()
        call_id = next(self._call_ids)
        call = _Call(token_ids=[list(ids) for ids in token_ids], future=asyncio.get_running_loop().create_future(),
                     embeddings=[None] * len(token_ids), remaining=len(token_ids))
        self._calls[call_id] = call
        deadline = now + self.spec.slo_ms / 1000.0
        for index, ids in enumerate(call.token_ids):
            self._queue.append(TextRequest(request_id=(call_id, index), length_tokens=len(ids), arrival_s=now, deadline_s=deadline))
        self._arrived.set()
        try:
            return await call.future
        finally:
            self._calls.pop(call_id, None)

    # ---- the batch-forming loop ----

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._arrived = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop())

    def _capacity_tokens(self) -> int:
        return self.scheduler.params.num_rows * self.scheduler.params.row_length_tokens

    async def _batch_loop(self) -> None:
        while True:
            self._queue = [r for r in self._queue if r.request_id[0] in self._calls]  # calls that failed or went away
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            oldest = min(r.arrival_s for r in self._queue)
            fill_by = oldest + self.wait_s
            if sum(r.length_tokens for r in self._queue) < self._capacity_tokens() and time.monotonic() < fill_by:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), timeout=max(0.0, fill_by - time.monotonic()))
                except asyncio.TimeoutError:
                    pass
                continue
            decision = self.scheduler.form_batch(time.monotonic(), self._queue)
            self._queue = decision.remaining(self._queue)
            self._drop(decision)
            if decision.is_empty:  # nothing schedulable now: wait for an arrival (or the next deadline check)
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), timeout=max(self.wait_s, IDLE_RECHECK_S))
                except asyncio.TimeoutError:
                    pass
            else:
                try:
                    await self._run(decision)
                except Exception as error:  # a failed forward fails its calls, never the replica
                    logger.exception("text replica %s: batch failed", self.spec.name)
                    for request in decision.requests:
                        call = self._calls.get(request.request_id[0])
                        if call is not None:
                            call.fail(RuntimeError(f"batch failed: {error}"))

    def _drop(self, decision: BatchDecision) -> None:
        if not decision.dropped:
            return
        metrics.dropped_requests_total().inc(len(decision.dropped), tags={"model": self.spec.name})
        self._totals["dropped"] += len(decision.dropped)
        for request in decision.dropped:
            call = self._calls.get(request.request_id[0])
            if call is not None:
                call.fail(RequestError(503, "deadline_exceeded",
                                       f"model {self.spec.name!r}: text {request.request_id[1]} waited past its "
                                       f"{self.spec.slo_ms:g} ms SLO before it could be scheduled"))

    async def _run(self, decision: BatchDecision) -> None:
        requests = decision.requests
        position = {id(r): i for i, r in enumerate(requests)}
        token_ids = [self._calls[r.request_id[0]].token_ids[r.request_id[1]] if r.request_id[0] in self._calls else [0]
                     for r in requests]
        bins = [[position[id(r)] for r in members] for members in decision.bins()]
        params = self.scheduler.params
        batch = self.packed.pack(token_ids, params.row_length_tokens, params.num_rows,
                                 slot_size_tokens=decision.slot_size_tokens, bins=bins)
        output = await asyncio.to_thread(self.packed.embed_packed, batch)
        embeddings = output.embeddings.tolist()
        tags = {"model": self.spec.name}
        metrics.batch_tokens().observe(batch.real_tokens, tags=tags)
        metrics.padding_fraction().observe(batch.padding_fraction, tags=tags)
        metrics.batch_size().observe(batch.num_requests, tags=tags)
        metrics.batch_utility_total().inc(decision.utility, tags=tags)
        for key, value in (("batches", 1), ("texts", batch.num_requests), ("real_tokens", batch.real_tokens),
                           ("computed_tokens", batch.computed_tokens)):
            self._totals[key] += value
        for request, embedding in zip(requests, embeddings):
            call = self._calls.get(request.request_id[0])
            if call is None or call.future.done():
                continue
            call.embeddings[request.request_id[1]] = embedding
            call.remaining -= 1
            if call.remaining == 0:
                call.future.set_result(call.embeddings)

    def stats(self) -> dict[str, Any]:
        """What the replica runs: its batching policy, its queue and totals since start."""
        return {"model": self.spec.name, "batching": self.scheduler.name, "params": self.scheduler.params.model_dump(),
                "queued_texts": len(self._queue), **self._totals}

    def check_health(self) -> None:
        if self.encoder is None:  # pragma: no cover - defensive
            raise RuntimeError("encoder not loaded")
        if self._loop_task is not None and self._loop_task.done() and not self._loop_task.cancelled():
            error = self._loop_task.exception()
            if error is not None:
                raise RuntimeError(f"batch loop died: {error}")
