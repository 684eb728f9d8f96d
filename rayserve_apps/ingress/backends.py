"""Where the ingress sends a validated request: per-model deployments, or device groups chosen by dispatch.

`ModelDeploymentBackend` serves the models in no device group: each has its own replicated deployment, or its engine
in the ingress process (`in_ingress`: always, or while the model has nothing in flight).
`GroupBackend` serves the models of a placement's groups: a `GroupDispatcher` picks the group (shortest queue
with SLO admission by default, AlpaServe §4.3) and a request no group can finish in time is refused with 503 at
once. `ModelRouterBackend` sends each model to the one of the two that serves it.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from ray.serve.handle import DeploymentHandle

from placement.alpaserve.dispatch import make_dispatch
from placement.alpaserve.placement_rollout import SlotLayout
from placement.core.deployment_spec import DeploymentSpec
from rayserve_apps.ingress.forwarding import BatchForwarder
from rayserve_apps.ingress.group_dispatch import GroupDispatcher

#: Dispatch policy used when the spec names none.
DEFAULT_DISPATCH = "shortest_queue"
#: The replica method a text request goes to; it arrives there batched with the others (`embed_batch`).
TEXT_METHOD = "embed_token_ids"
BATCHED_TEXT_METHOD = "embed_batch"


def _batched_sender(handle: DeploymentHandle, model: str):
    """send(payloads, budgets_s) for a `BatchForwarder`: one `embed_batch` call to `handle`."""

    async def send(payloads: list[Any], budgets_s: list[float]) -> list[Any]:
        return await getattr(handle, BATCHED_TEXT_METHOD).remote(model, payloads, budgets_s)

    return send


class Backend(Protocol):
    async def call(self, model: str, method: str, payload: Any, deadline_s: float, options: dict[str, Any]) -> Any: ...

    def describe(self) -> dict[str, Any]: ...


async def call_in_process(server: Any, model: str, method: str, payload: Any, deadline_s: float,
                          options: dict[str, Any]) -> Any:
    """A request to a model whose engine runs in this process (`in_ingress`): a text request enters the engine
    directly with what is left of its SLO, so it is batched with the others there; no call crosses a process."""
    if method == TEXT_METHOD and not options:
        (outcome,) = await server.embed_batch(model, [payload], [deadline_s - time.monotonic()])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
    return await getattr(server, method)(payload, **options)


class ModelDeploymentBackend:
    """One deployment per model: the request goes to its model's deployment (Serve picks the replica), or, for a
    model with `in_ingress`, to its engine in this replica (`local`).

    No SLO admission here (with closed-loop clients at capacity, each refusal's CPU cost lowers throughput and
    causes more refusals; `benchmarks/serve_e2e.py` shows it): the bound on what waits is the ingress's
    `ingress_max_ongoing_requests` / `ingress_max_queued_requests`, enforced before the routes
    (`rayserve_apps/edge/admission.py`).
    """

    def __init__(self, handles: dict[str, DeploymentHandle], batched_models: set[str] | frozenset[str] = frozenset(),
                 local: dict[str, Any] | None = None):
        self.handles = handles
        #: Model -> its `TextModelServer` in this process (models with `in_ingress`).
        self.local = dict(local or {})
        #: Models whose deployment takes batched calls (`embed_batch`: the text replica; Arlo's router does not).
        self.batched_models = frozenset(batched_models)
        self.forwarders: dict[str, BatchForwarder] = {}

    def serves(self, model: str) -> bool:
        return model in self.handles or model in self.local

    def _runs_here(self, model: str) -> bool:
        """The request goes to the engine in this process: the model has no deployment (`in_ingress: always`), or
        nothing of it is in flight (`when_idle`: a lone request skips the hop, load goes to the deployment)."""
        server = self.local.get(model)
        if server is None:
            return False
        if model not in self.handles:
            return True
        forwarder = self.forwarders.get(model)
        return (forwarder is None or forwarder.idle) and server.engine.queued == 0 and server.engine.in_flight == 0

    async def call(self, model: str, method: str, payload: Any, deadline_s: float, options: dict[str, Any]) -> Any:
        if self._runs_here(model):
            return await call_in_process(self.local[model], model, method, payload, deadline_s, options)
        if method == TEXT_METHOD and not options and model in self.batched_models:
            if model not in self.forwarders:
                self.forwarders[model] = BatchForwarder(_batched_sender(self.handles[model], model))
            return await self.forwarders[model].forward(payload, deadline_s)
        return await getattr(self.handles[model], method).remote(payload, **options)

    def describe(self) -> dict[str, Any]:
        return {"deployments": {model: f"model-{model}" for model in self.handles}, "in_ingress": sorted(self.local)}


class GroupBackend:
    """Device groups of a placement, one per group slot: the dispatch policy picks the group, or refuses."""

    def __init__(self, spec: DeploymentSpec, handles: list[DeploymentHandle], layout: SlotLayout):
        self.spec = spec
        self.layout = layout
        self.routes = layout.routes()
        self.version = 0
        self.handles = handles
        dispatch = spec.policy("dispatch")
        policy = make_dispatch(dispatch.name, **dispatch.params) if dispatch else make_dispatch(DEFAULT_DISPATCH)
        self.dispatcher = GroupDispatcher(self.routes, policy)
        #: (group slot, model) -> the forwarder that batches text requests to that slot.
        self.forwarders: dict[tuple[int, str], BatchForwarder] = {}

    def _forwarder(self, group: int, model: str) -> BatchForwarder:
        key = (group, model)
        if key not in self.forwarders:
            self.forwarders[key] = BatchForwarder(_batched_sender(self.handles[group], model))
        return self.forwarders[key]

    def set_layout(self, layout: SlotLayout, routes: list[list[str]], version: int) -> None:
        """Adopt the slots' groups and where each model may be routed (during a rollout step: what serves both
        before and after it, see `placement.alpaserve.placement_rollout.transition_routes`)."""
        if len(layout.slots) != len(self.handles) or len(routes) != len(self.handles):
            raise ValueError(f"layout has {len(layout.slots)} slots and {len(routes)} routes; this application runs "
                             f"{len(self.handles)} group slots")
        self.dispatcher.set_routes(routes)
        self.layout, self.routes, self.version = layout, routes, version

    async def call(self, model: str, method: str, payload: Any, deadline_s: float, options: dict[str, Any]) -> Any:
        async def send(group: int) -> Any:
            if method == TEXT_METHOD:
                return await self._forwarder(group, model).forward(payload, deadline_s)
            return await getattr(self.handles[group], method).remote(model, payload, **options)

        return await self.dispatcher.admit_and_send(model, deadline_s, send)

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, "placement": self.layout.placement().model_dump(mode="json"),
                "slots": self.layout.model_dump(mode="json")["slots"], "routes": self.routes,
                "group_deployments": [f"group-{i}" for i in range(len(self.handles))]}


class ModelRouterBackend:
    """Models hosted by device groups go to the groups; every other model to its own deployment."""

    def __init__(self, groups: GroupBackend | None, singles: ModelDeploymentBackend):
        self.groups = groups
        self.singles = singles

    async def call(self, model: str, method: str, payload: Any, deadline_s: float, options: dict[str, Any]) -> Any:
        if self.singles.serves(model) or self.groups is None:
            return await self.singles.call(model, method, payload, deadline_s, options)
        return await self.groups.call(model, method, payload, deadline_s, options)

    def describe(self) -> dict[str, Any]:
        layout: dict[str, Any] = {"mode": "groups" if self.groups is not None else "per_model",
                                  "single_model_deployments": self.singles.describe()["deployments"],
                                  "in_ingress": sorted(self.singles.local)}
        if self.groups is not None:
            layout.update(self.groups.describe())
        return layout
