"""A polymorphing runtime instance as a Ray Serve replica (Arlo §3: one static-shape runtime per instance).

All runtime instances of one model are replicas of ONE deployment, so that one `PolymorphRouter` sees them all and
can apply Arlo's multi-level queue across runtimes (a Serve request router chooses among one deployment's replicas).
Which runtime a replica runs is data: the deployment's `user_config` maps replica rank -> max length
(`PolymorphAssignmentParams.assignment`); ranks it does not name run the longest runtime.

* execution ``packed`` (default) composes polymorphing with ConcatBatching (TCB §4.1): the replica's runtime is a
  `PackedStaticRuntime` of the same fixed shape [batch_size rows, max length L], and requests that wait for the
  replica while a forward pass runs are packed together, several short requests to a row, into the next pass
  (as many as fit without adding a pass to the oldest waiting request's own). Execution ``padded`` is Arlo's plain
  runtime: every text padded to L, one per row, one request at a time. Capacities stay in requests either way;
* `record_replica_metadata` reports the runtime the replica started with and its capacity within the SLO (M_i);
* `record_routing_stats` reports the current runtime, capacity and outstanding requests (queued + executing);
* `reconfigure` (a new allocation) builds the newly assigned runtime first and then swaps it in, so requests
  already running finish on the old one and none is dropped; a request longer than the current runtime (routed
  on stale information during a swap) runs on the dynamic-shape path instead of failing.

The deployment's `user_config` shape, the spec's policy params and the allocation update that changes the fewest
replicas live in `rayserve_apps/contracts.py` (the controller writes them too); the builder binds the deployment with
its router (`rayserve_apps.app.bind_polymorph_model`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import torch
from ray import serve

from models.runtimes.static_runtime import DynamicRuntime, PackedStaticRuntime, StaticRuntime
from models.text_encoder import load_text_encoder
from placement.core.deployment_spec import ModelSpec
from rayserve_apps._threads import set_torch_threads_for
from rayserve_apps.contracts import (
    STATS_CAPACITY,
    STATS_EXECUTION,
    STATS_MAX_LENGTH,
    STATS_OUTSTANDING,
    PolymorphAssignmentParams,
    PolymorphRuntimeParams,
)

logger = logging.getLogger("ray.serve")


@dataclass
class _WaitingCall:
    """A request waiting for the replica's next packed forward pass."""

    token_ids: list[list[int]]
    runtime: PackedStaticRuntime
    future: asyncio.Future


def _current_rank() -> int:
    try:
        return int(serve.get_replica_context().rank.rank)
    except Exception:  # pragma: no cover - outside a replica
        return 0


@serve.deployment
class PolymorphRuntimeDeployment:
    """One runtime instance; `embed_token_ids` is its API."""

    def __init__(self, model_spec: dict, params: dict):
        self.spec = ModelSpec.model_validate(model_spec)
        self.params = PolymorphRuntimeParams.model_validate(params)
        set_torch_threads_for(self.spec.num_cpus_per_replica)
        self.encoder = load_text_encoder(self.spec.source, name=self.spec.name)
        self.longest = max(self.params.capacities)
        if self.longest > self.encoder.max_length:
            raise ValueError(f"params.capacities: runtime {self.longest} exceeds the model's {self.encoder.max_length} "
                             "tokens")
        self.dynamic = DynamicRuntime(self.encoder)
        self.outstanding = 0
        self._compute_lock = asyncio.Lock()  # one forward pass at a time: an instance is one device
        self._waiting: list[_WaitingCall] = []  # packed execution: requests not yet taken into a forward pass
        self.runtime = self._build(self._assigned_length(self._initial_user_config(), _current_rank()))

    # --- allocation -------------------------------------------------------------------------------------------
    @staticmethod
    def _initial_user_config() -> PolymorphAssignmentParams:
        try:  # the first reconfigure runs after the metadata is captured, so read the config here
            raw = serve.get_replica_context()._deployment_config.user_config
        except Exception:  # pragma: no cover - outside a replica
            raw = None
        return PolymorphAssignmentParams.model_validate(raw or {})

    def _assigned_length(self, config: PolymorphAssignmentParams, rank: int) -> int:
        length = config.assignment.get(rank, self.longest)
        if length not in self.params.capacities:
            raise ValueError(f"user_config.assignment[{rank}]={length} is not a runtime (have "
                             f"{sorted(self.params.capacities)})")
        return length

    def _build(self, length: int) -> StaticRuntime | PackedStaticRuntime:
        if self.params.execution == "packed":
            return PackedStaticRuntime(self.encoder, length, self.params.batch_size, backend=self.params.backend)  # type: ignore[arg-type]
        return StaticRuntime(self.encoder, length, self.params.batch_size, backend=self.params.backend)  # type: ignore[arg-type]

    async def reconfigure(self, user_config: dict, rank: Any = None) -> None:
        config = PolymorphAssignmentParams.model_validate(user_config or {})
        length = self._assigned_length(config, int(rank.rank) if rank is not None else _current_rank())
        if length != self.runtime.max_length_tokens:
            logger.info("replica switches runtime %d -> %d (allocation v%d)", self.runtime.max_length_tokens, length,
                        config.version)
            new_runtime = await asyncio.to_thread(self._build, length)
            self.runtime = new_runtime  # running requests keep their reference to the old runtime

    # --- reports to the router --------------------------------------------------------------------------------
    def record_replica_metadata(self) -> dict:
        return {STATS_MAX_LENGTH: self.runtime.max_length_tokens,
                STATS_CAPACITY: self.params.capacities[self.runtime.max_length_tokens],
                STATS_EXECUTION: self.params.execution}

    def record_routing_stats(self) -> dict:
        return {STATS_MAX_LENGTH: self.runtime.max_length_tokens,
                STATS_CAPACITY: self.params.capacities[self.runtime.max_length_tokens],
                STATS_OUTSTANDING: self.outstanding}

    # --- serving ------------------------------------------------------------------------------------------------
    async def embed_token_ids(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Embeddings of tokenized texts, in input order (the interface of every text deployment)."""
        return (await self.embed_with_runtime(token_ids))["embeddings"]

    async def embed_with_runtime(self, token_ids: list[list[int]]) -> dict:
        """Embeddings of tokenized texts, the runtime length that served them (0: the dynamic path), the forward
        passes they ran in and how many requests shared those passes; ValueError for bad input."""
        if (not isinstance(token_ids, list) or not token_ids
            or not all(isinstance(ids, list) and ids for ids in token_ids)):
            raise ValueError("token_ids must be a non-empty list of non-empty token id lists")
        longest = max(len(ids) for ids in token_ids)
        if longest > self.longest:
            raise ValueError(f"input of {longest} tokens exceeds the longest runtime ({self.longest} tokens)")
        self.outstanding += 1
        try:
            runtime = self.runtime
            if isinstance(runtime, PackedStaticRuntime) and longest <= runtime.max_length_tokens:
                embeddings, passes, sharing = await self._run_packed(runtime, token_ids)
                served = runtime.max_length_tokens
            else:
                async with self._compute_lock:
                    runtime = self.runtime
                    if longest <= runtime.max_length_tokens and isinstance(runtime, StaticRuntime):
                        embeddings = await asyncio.to_thread(self._run_static, runtime, token_ids)
                        served, passes = runtime.max_length_tokens, -(-len(token_ids) // runtime.batch_size)
                    elif longest <= runtime.max_length_tokens:  # swapped to a packed runtime while waiting
                        result = await asyncio.to_thread(runtime.run_tokens, token_ids)
                        embeddings, served, passes = result.embeddings, runtime.max_length_tokens, result.forward_passes
                    else:  # routed on stale information during a runtime swap: never fail the request
                        embeddings = await asyncio.to_thread(self.dynamic.run_tokens, token_ids)
                        served, passes = 0, 1
                sharing = 1
        finally:
            self.outstanding -= 1
        return {"embeddings": embeddings.tolist(), "served_by_max_length_tokens": served,
                "forward_passes": passes, "requests_in_passes": sharing}

    @staticmethod
    def _run_static(runtime: StaticRuntime, token_ids: list[list[int]]):
        chunks = [runtime.run_tokens(token_ids[k:k + runtime.batch_size])
                  for k in range(0, len(token_ids), runtime.batch_size)]
        return torch.cat(chunks)

    # --- packed execution: ConcatBatching across waiting requests (TCB §4.1) ----------------------------------
    async def _run_packed(self, runtime: PackedStaticRuntime, token_ids: list[list[int]]):
        """Wait for the replica; whoever gets it runs its own request and the waiting ones packed together.

        Returns (embeddings, forward passes, requests that shared them)."""
        call = _WaitingCall(token_ids, runtime, asyncio.get_running_loop().create_future())
        self._waiting.append(call)
        try:
            async with self._compute_lock:
                if not call.future.done():  # not yet taken into an earlier request's passes
                    group = self._take_group(call)
                    try:
                        results = await asyncio.to_thread(self._run_packed_group, runtime, group)
                    except Exception as error:  # a failure reaches every request of the group (own one included)
                        for member in group:
                            member.future.set_exception(error)
                    except BaseException:  # cancelled: the others must not wait forever
                        for member in group[1:]:
                            member.future.set_exception(RuntimeError("the packed forward pass was cancelled"))
                        raise
                    else:
                        for member, result in zip(group, results):
                            member.future.set_result(result)
        except asyncio.CancelledError:
            if call in self._waiting:
                self._waiting.remove(call)
            raise
        return await call.future

    def _take_group(self, call: _WaitingCall) -> list[_WaitingCall]:
        """`call` and, oldest first, the waiting requests on the same runtime that fit in its passes' spare room."""
        self._waiting.remove(call)
        group, lengths = [call], [len(ids) for ids in call.token_ids]
        budget = call.runtime.num_passes(lengths)
        for other in list(self._waiting):
            if other.runtime is not call.runtime:
                continue
            candidate = lengths + [len(ids) for ids in other.token_ids]
            if call.runtime.num_passes(candidate) <= budget:
                group.append(other)
                lengths = candidate
                self._waiting.remove(other)
        return group

    @staticmethod
    def _run_packed_group(runtime: PackedStaticRuntime, group: list[_WaitingCall]) -> list[tuple[Any, int, int]]:
        texts = [ids for member in group for ids in member.token_ids]
        result = runtime.run_tokens(texts)
        out, start = [], 0
        for member in group:
            end = start + len(member.token_ids)
            out.append((result.embeddings[start:end], result.forward_passes, len(group)))
            start = end
        return out
