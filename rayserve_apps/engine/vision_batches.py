"""Image batches: FIFO batches for a plain ViT, OTAS batches at a gamma for the adaptive ViT, and their backends.

Two formers (the engine's `BatchFormer`s for vision models):

* `ImageBatchFormer`: first come, first served, up to `max_batch_size` images, once the batch is full or the
  oldest image has waited `batch_wait_s` (what `@serve.batch` does, on the engine). Admitted images never expire.
* `OtasBatchFormer`: OTAS' replica scheduler (`placement.otas.replica_scheduler.OtasScheduler`): Alg. 1 puts each
  query into a batch of the queue, queries that cannot meet their deadline even at the fastest gamma are evicted
  (503), and Alg. 2/3 choose the next batch and its gamma (otas-v2 §III-A, Fig. 5). Each image is one query whose
  task and utility travel in the item's `attrs`.

Backends run a formed batch in this process (`InProcessVisionBackend`, `InProcessOtasBackend`, a worker thread)
or through a device group's stage actors (`StagedVisionBackend`, `StagedOtasBackend`: the adaptive ViT's layer
view with the batch's gamma and prompts riding along, the per-task heads applied here). Each answers one
{"label", "probabilities"} per image (OTAS adds "task" and "gamma").
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

import torch

from models.adaptive_vit_layers import adaptive_input_state
from models.layers import ActivationState
from models.task_registry import TaskRegistry
from parallel.group_runtime import ModelParallelGroup
from placement.otas.adaptive_batching import OtasRequest
from placement.otas.profile import OtasProfile
from placement.otas.replica_scheduler import Dispatch, OtasScheduler
from rayserve_apps.engine.engine import FormedBatch, WorkItem
from rayserve_apps.requests import RequestError

#: WorkItem.attrs keys of an OTAS query.
TASK_ATTR = "task_id"
UTILITY_ATTR = "utility"


def predictions(logits: Sequence[torch.Tensor] | torch.Tensor,
                extra: Sequence[dict[str, Any]] | None = None) -> list[dict]:
    """One {'label', 'probabilities', ...extra} per row of logits (rows on any device: they come to the CPU here)."""
    if isinstance(logits, torch.Tensor):
        rows: Sequence[torch.Tensor] = logits.detach().float().cpu()
    elif logits and all(row.shape == logits[0].shape for row in logits):
        rows = torch.stack(list(logits)).detach().float().cpu()  # one copy from the device, not one per row
    else:
        rows = [row.detach().float().cpu() for row in logits]
    answers = []
    for i, row in enumerate(rows):
        probabilities = torch.softmax(row.float(), dim=-1)
        answer = {"label": int(probabilities.argmax()), "probabilities": probabilities.tolist()}
        if extra is not None:
            answer.update(extra[i])
        answers.append(answer)
    return answers


class ImageBatchFormer:
    """FIFO batches of up to `max_batch_size` images (the plain ViT's former)."""

    def __init__(self, max_batch_size: int, batch_wait_s: float):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self._queue: list[WorkItem] = []

    def add(self, items: Sequence[WorkItem]) -> None:
        self._queue.extend(items)

    def queued(self) -> int:
        return len(self._queue)

    def ready_at_s(self, now_s: float, batches_running: int = 0) -> float:
        if len(self._queue) >= self.max_batch_size:
            return now_s
        return self._queue[0].arrival_s + self.batch_wait_s

    def form(self, now_s: float) -> FormedBatch:
        live = [item for item in self._queue if not item.future.done()]  # callers that went away
        batch, self._queue = live[: self.max_batch_size], live[self.max_batch_size:]
        return FormedBatch(items=batch)

    def completed(self, batch: FormedBatch, started_s: float, finish_s: float) -> None:
        pass


class OtasBatchFormer:
    """OTAS Alg. 1 batching, eviction and Alg. 2/3 token allocation over a model's waiting queries."""

    def __init__(self, scheduler: OtasScheduler, profile: OtasProfile,
                 on_completed: Callable[[Dispatch, float], None] | None = None):
        self.scheduler = scheduler
        self.profile = profile
        self.on_completed = on_completed

    def add(self, items: Sequence[WorkItem]) -> None:
        for item in items:
            self.scheduler.submit(OtasRequest(item.attrs[TASK_ATTR], item.arrival_s, item.deadline_s,
                                              item.attrs[UTILITY_ATTR], payload=item))

    def queued(self) -> int:
        return self.scheduler.num_waiting

    def ready_at_s(self, now_s: float, batches_running: int = 0) -> float:
        return now_s  # Alg. 2/3 decide themselves whether a batch runs now

    def form(self, now_s: float) -> FormedBatch:
        dispatch, evicted = self.scheduler.next_batch(now_s)
        refused = [(request.payload, RequestError(
            503, "deadline_unmeetable",
            f"query for task {request.task_id!r} cannot finish before its deadline; evicted"))
            for request in evicted]
        items = [request.payload for request in dispatch.batch.requests] if dispatch is not None else []
        return FormedBatch(items=items, plan=dispatch, refused=refused)

    def completed(self, batch: FormedBatch, started_s: float, finish_s: float) -> None:
        dispatch: Dispatch = batch.plan
        accuracy = [self.profile.task_accuracy(r.task_id, dispatch.gamma) for r in dispatch.batch.requests]
        self.scheduler.complete(dispatch, finish_s, expected_accuracy=accuracy)
        if self.on_completed is not None:
            self.on_completed(dispatch, finish_s)


def _images(batch: FormedBatch) -> torch.Tensor:
    return torch.stack([item.payload for item in batch.items]).float()


class InProcessVisionBackend:
    """A plain ViT classifier in a worker thread of this process."""

    def __init__(self, classifier):
        self.classifier = classifier

    async def execute(self, batch: FormedBatch) -> list[dict]:
        logits = await asyncio.to_thread(self.classifier.logits, _images(batch))
        return predictions(logits)


class StagedVisionBackend:
    """A plain ViT's whole layer view through a device group's stage actors."""

    def __init__(self, runtime: ModelParallelGroup):
        self.runtime = runtime

    async def execute(self, batch: FormedBatch) -> list[dict]:
        return predictions((await self.runtime.infer_async(ActivationState(hidden=_images(batch)))).hidden)


def otas_extras(batch: FormedBatch) -> list[dict[str, Any]]:
    gamma = batch.plan.gamma
    return [{"task": item.attrs[TASK_ATTR], "gamma": gamma} for item in batch.items]


class InProcessOtasBackend:
    """The adaptive ViT with its task registry in a worker thread: one pass at the batch's gamma."""

    def __init__(self, registry: TaskRegistry):
        self.registry = registry

    async def execute(self, batch: FormedBatch) -> list[dict]:
        task_ids = [item.attrs[TASK_ATTR] for item in batch.items]
        logits = await asyncio.to_thread(self.registry.logits, _images(batch), task_ids, batch.plan.gamma)
        return predictions(logits, otas_extras(batch))


class StagedOtasBackend:
    """The adaptive ViT's backbone through a device group's stage actors at the batch's gamma (its prompts ride in
    the activation state); the pooled features come back and each task's head for that gamma runs here."""

    def __init__(self, runtime: ModelParallelGroup, registry: TaskRegistry):
        self.runtime = runtime
        self.registry = registry

    async def execute(self, batch: FormedBatch) -> list[dict]:
        gamma = batch.plan.gamma
        task_ids = [item.attrs[TASK_ATTR] for item in batch.items]
        state = adaptive_input_state(_images(batch), gamma, self.registry.batch_prompts(task_ids, gamma))
        features = (await self.runtime.infer_async(state)).hidden
        logits = await asyncio.to_thread(self.registry.task_logits, features, task_ids, gamma)
        return predictions(logits, otas_extras(batch))
