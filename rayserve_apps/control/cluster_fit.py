"""Does a placement fit the running Ray cluster? Checked before anything is deployed.

Each device group needs its devices on one node (its placement group is STRICT_PACK): the amount of the device
resource its bundles ask for (n devices; with 'CPU' as the device resource, the CPUs of all its bundles). Groups
are assigned to
nodes largest first, each to the fullest node that still has room (best-fit decreasing); a group that finds no
node is refused with a message naming it, its size and what the nodes have.
"""

from __future__ import annotations

import logging

import ray

from placement.core.deployment_spec import DeploymentSpec

logger = logging.getLogger(__name__)


def free_devices_per_node(device_resource: str) -> dict[str, float]:
    """Devices (the spec's device resource) of each alive node of the connected Ray cluster."""
    return {node["NodeID"]: node["Resources"].get(device_resource, 0.0) for node in ray.nodes() if node.get("Alive")}


def check_placement_fits(spec: DeploymentSpec, demands: list[float],
                         nodes: dict[str, float] | None = None) -> dict[int, str]:
    """Map each group (needing `demands[i]` of the device resource) to a node, or raise ValueError; without a Ray
    connection (and no `nodes`), skip the check."""
    assert spec.placement is not None
    resource = spec.cluster.device_resource
    if nodes is None:
        if not ray.is_initialized():
            logger.warning("not connected to Ray: placement fit against the cluster is not checked")
            return {}
        nodes = free_devices_per_node(resource)
    free = dict(nodes)
    assignment: dict[int, str] = {}
    order = sorted(range(len(demands)), key=lambda i: -demands[i])
    for index in order:
        need = demands[index]
        fitting = [n for n in free if free[n] >= need]
        node = min(fitting, key=lambda n: free[n], default=None)
        if node is None:
            have = sorted((round(v, 2) for v in nodes.values()), reverse=True)
            raise ValueError(
                f"placement.groups.{index} needs {need:g} '{resource}' on one node, but the cluster's nodes have "
                f"{have} (with {sorted((round(v, 2) for v in free.values()), reverse=True)} left after larger groups); "
                "nothing was deployed"
            )
        free[node] -= need
        assignment[index] = node
    return assignment
