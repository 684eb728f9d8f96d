"""The per-model text deployment: a replica that embeds already tokenized texts with ConcatBatching (TCB).

The ingress tokenizes and validates; this replica re-checks the token ids (a handle caller may skip the ingress).
Every text of every call becomes one item of the replica's serving engine (`rayserve_apps/engine/`): the
configured TCB scheduler (`spec.policy("batching", model)`: das by default, or slotted_das, fcfs, sjf, edf) forms
batches of B rows of L tokens, they are packed (ops/packing.py) and the packed forward (models/packed_text.py) runs
in a worker thread, so new calls keep queueing meanwhile. Texts whose deadline passes before they are scheduled
are dropped (TCB §5.2) and their call fails with a 503 `deadline_exceeded`; a call that cannot finish in time behind
the queued texts is refused on arrival with a 503 `overloaded` (`refuse_early`). A text that finds the engine idle
runs at once (`dispatch_when_idle`); on CPU, packed rows attend per text (`sdpa_segments`, ops/concat_attention.py)
and torch's threads follow the wholly idle cores before each batch (`rayserve_apps._threads`).

The ingress sends the requests that arrived together in one `embed_batch` call; `embed_token_ids` serves one
request (handle callers, tests). Custom metrics: tokens per batch, padding fraction, requests per batch, utility
(TCB Eq. 9) and dropped requests.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from ray import serve

from models.device import CPU_RESOURCE, select_device
from models.packed_text import PackedTextEncoder
from models.text_encoder import load_text_encoder
from ops.concat_attention import SEGMENT_ATTENTION
from ops.packing import PackedBatch
from placement.core.deployment_spec import ModelSpec, PolicySpec
from rayserve_apps import metrics
from rayserve_apps._threads import LoadFollowingThreads, set_torch_threads_for
from rayserve_apps.engine import (
    FormedBatch,
    InProcessTextBackend,
    ServingEngine,
    TextBatchFormer,
    answer_requests,
    batching_scheduler_for,
)

logger = logging.getLogger("ray.serve")

#: Calls a replica accepts at once: many, so that the scheduler sees enough waiting texts to fill its rows.
MAX_ONGOING_REQUESTS = 256


def check_text_request(token_ids: Any, tokenizer, limit_tokens: int) -> None:
    """ValueError naming the problem of one request's token ids (a non-empty list of lists within the limit)."""
    if not isinstance(token_ids, list) or not token_ids:
        raise ValueError("token_ids must hold at least one sequence (a non-empty list of token id lists)")
    tokenizer.check_token_ids(token_ids, limit_tokens)


def text_batch_metrics(model: str):
    """The per-batch metrics callback of a text engine's backend."""
    tags = {"model": model}

    def record(batch: PackedBatch) -> None:
        metrics.batch_tokens().observe(batch.real_tokens, tags=tags)
        metrics.padding_fraction().observe(batch.padding_fraction, tags=tags)
        metrics.batch_size().observe(batch.num_requests, tags=tags)

    return record


class TextModelServer:
    """Hosts one text encoder; `embed_batch` / `embed_token_ids` are its API. The replica of a model's own
    deployment (`TextModelDeployment`), or an object in the ingress replica for a model with `in_ingress`."""

    def __init__(self, model_spec: dict, batching_policy: PolicySpec | dict | None = None,
                 device_resource: str = CPU_RESOURCE):
        self.spec = ModelSpec.model_validate(model_spec)
        set_torch_threads_for(self.spec.num_cpus_per_replica)
        #: CUDA when this replica reserved a GPU share and torch sees it (`models.device.select_device`); the
        #: packed batches go there and the embeddings come back as CPU rows.
        self.device = select_device(device_resource)
        # On CPU a packed row's attention runs per text (cost: sum of len^2); on CUDA one masked kernel per batch.
        attention = SEGMENT_ATTENTION if self.device.type == "cpu" else "sdpa"
        self.encoder = load_text_encoder(self.spec.source, name=self.spec.name, attn_implementation=attention)
        self.encoder.model.to(self.device)
        self.limit = min(self.spec.max_input_length_tokens or self.encoder.max_length, self.encoder.max_length)
        self.scheduler = batching_scheduler_for(self.spec, batching_policy, self.limit)
        self._totals = {"real_tokens": 0, "computed_tokens": 0, "utility": 0.0}
        former = TextBatchFormer(self.spec.name, self.scheduler, self.spec.batch_wait_timeout_ms / 1000.0,
                                 self.spec.slo_ms)
        threads = LoadFollowingThreads() if self.device.type == "cpu" else None
        backend = InProcessTextBackend(PackedTextEncoder(self.encoder), self.scheduler, on_packed=self._packed,
                                       threads=threads)
        self.engine = ServingEngine(self.spec.name, former, backend, on_batch=self._batch_done)
        logger.info("text replica %s: %s batching, %d rows x %d tokens", self.spec.name, self.scheduler.name,
                    self.scheduler.params.num_rows, self.scheduler.params.row_length_tokens)

    def _packed(self, batch: PackedBatch) -> None:
        text_batch_metrics(self.spec.name)(batch)
        self._totals["real_tokens"] += batch.real_tokens
        self._totals["computed_tokens"] += batch.computed_tokens

    def _batch_done(self, batch: FormedBatch, duration_s: float) -> None:
        metrics.batch_utility_total().inc(batch.plan.utility, tags={"model": self.spec.name})
        self._totals["utility"] += batch.plan.utility

    def _check(self, token_ids: Sequence[Sequence[int]]) -> None:
        check_text_request(token_ids, self.encoder.text_tokenizer, self.limit)
        row_limit = self.scheduler.max_request_tokens
        for index, ids in enumerate(token_ids):
            if len(ids) > row_limit:
                raise ValueError(f"token_ids[{index}] has {len(ids)} tokens; the batch rows of this replica hold at "
                                 f"most {row_limit}")

    async def embed_batch(self, model: str, requests: list[list[list[int]]], budgets_s: list[float]) -> list:
        """Several requests at once (what the ingress sends): per request its embeddings (float32 rows) or error."""
        if model != self.spec.name:
            raise ValueError(f"this replica serves model {self.spec.name!r}, not {model!r}")
        outcomes = await answer_requests(self.engine, requests, budgets_s, self._check)
        self._count_dropped(outcomes)
        return outcomes

    async def embed_token_ids(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Unit-norm embeddings of one request's tokenized texts, in input order; ValueError for bad ids."""
        (outcome,) = await self.embed_batch(self.spec.name, [token_ids], [self.spec.slo_ms / 1000.0])
        if isinstance(outcome, Exception):
            raise outcome
        return [row.tolist() for row in outcome]

    def _count_dropped(self, outcomes: list) -> None:
        dropped = sum(1 for o in outcomes if getattr(o, "error_type", None) in ("deadline_exceeded", "overloaded"))
        if dropped:
            metrics.dropped_requests_total().inc(dropped, tags={"model": self.spec.name})

    def stats(self) -> dict[str, Any]:
        """What the replica runs: its batching policy, its queue and totals since start."""
        totals = self.engine.totals
        return {"model": self.spec.name, "batching": self.scheduler.name, "params": self.scheduler.params.model_dump(),
                "queued_texts": self.engine.queued, "batches": totals.batches, "texts": totals.items,
                "dropped": totals.refused, "refused_early": self.engine.former.refused_early,
                "largest_batch": totals.largest_batch, **self._totals}

    def check_health(self) -> None:
        if not self.engine.healthy():
            raise RuntimeError("the serving engine's batch loop died")


#: The model's own deployment (`model-<name>`): a `TextModelServer` per replica.
TextModelDeployment = serve.deployment(name="TextModelDeployment", max_ongoing_requests=MAX_ONGOING_REQUESTS)(
    TextModelServer)
