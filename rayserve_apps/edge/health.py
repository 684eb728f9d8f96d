"""Readiness of the served models, for `/v2/health/ready`, `/v2/models/{name}/ready` and `/healthz`.

A model is ready when every copy of it answers now: a model in device groups when every group routed to it reports
it ready (not while one group's stage actors for it are being rebuilt after a failure, nor while a re-placement hosts
it nowhere); a model with a deployment of its own when Serve reports that deployment healthy. The server is ready
when every model is.
Readiness never waits on a model: each check has a short timeout and a model that does not answer in time is not
ready.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ray import serve

if TYPE_CHECKING:
    from rayserve_apps.ingress.deployment import Ingress

logger = logging.getLogger("ray.serve")

#: Seconds a readiness check waits for a group replica or for Serve's controller.
READINESS_TIMEOUT_S = 2.0
#: Seconds `GET /v1/placement` waits for a group replica's report (it waits while a hosted model is rebuilt).
GROUP_INFO_TIMEOUT_S = 10.0
#: Serve's status of a deployment whose replicas are all running and healthy.
HEALTHY = "HEALTHY"


def _deployment_statuses() -> dict[str, str]:
    app_name = serve.get_replica_context().app_name
    application = serve.status().applications.get(app_name)
    return ({} if application is None
            else {name: str(getattr(d.status, "value", d.status)) for name, d in application.deployments.items()})


async def _grouped_ready(ingress: "Ingress", models: set[str]) -> dict[str, bool]:
    groups = ingress.groups
    if groups is None:
        return {model: False for model in models}
    slots = [index for index, routed in enumerate(groups.routes) if models & set(routed)]
    hosted = {model: any(model in groups.routes[index] for index in slots) for model in models}
    ready = dict(hosted)  # a model no group hosts right now (mid re-placement) is not ready

    async def ask(index: int) -> dict[str, bool]:
        try:
            return await asyncio.wait_for(ingress.group_handles[index].models_ready.remote(), READINESS_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - a group that cannot answer hosts nothing ready
            logger.info("readiness: group slot %d did not answer (%s)", index, type(error).__name__)
            return {}

    for index, answer in zip(slots, await asyncio.gather(*(ask(index) for index in slots))):
        for model in models & set(groups.routes[index]):
            ready[model] = ready[model] and bool(answer.get(model))
    return ready


async def models_ready(ingress: "Ingress", names: list[str] | None = None) -> dict[str, bool]:
    """Per model (all served models unless `names`), whether it can answer now."""
    names = [m.name for m in ingress.spec.models] if names is None else names
    local = ingress.backend.singles.local
    singles = [name for name in names if name in ingress.backend.singles.handles]
    ready = await _grouped_ready(ingress, set(names) - set(singles) - set(local))
    ready.update({name: local[name].engine.healthy() for name in names if name in local})
    if singles:
        try:
            statuses = await asyncio.wait_for(asyncio.to_thread(_deployment_statuses), READINESS_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - no answer from Serve's controller: nothing is known ready
            logger.info("readiness: Serve status unavailable (%s)", type(error).__name__)
            statuses = {}
        deployments = ingress.backend.singles.describe()["deployments"]
        ready.update({name: statuses.get(deployments[name]) == HEALTHY for name in singles})
    return ready


async def group_info(handle, index: int) -> dict:
    """What group slot `index` reports for `GET /v1/placement`, or a note naming it when it does not answer in time
    (so the route never hangs on a group whose model is being rebuilt)."""
    try:
        return await asyncio.wait_for(handle.info.remote(), GROUP_INFO_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - a group that cannot report is shown as such, not as a failed route
        return {"group": f"group-{index}",
                "unavailable": f"no report within {GROUP_INFO_TIMEOUT_S:g} s ({type(error).__name__}); "
                "a hosted model may be rebuilding"}
