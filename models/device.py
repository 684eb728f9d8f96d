"""Which device a deployment or actor runs its model on, and what share of a device it reserves.

One function for every single-model deployment, group replica and stage actor: with the cluster's device resource
'GPU' (`cluster.device_resource`) and a GPU visible to torch, models run on CUDA and Ray reserves `num_gpus`
(fractional when models share a device); any other device resource (a logical one on CPU-only clusters) keeps
models on the CPU exactly as before. No Ray import: the reservation is plain `ray_actor_options` data.
"""

from __future__ import annotations

from typing import Any

import torch

from placement.core.profiles import GPU_DEVICE_RESOURCE

#: The Ray resource name of a GPU (the spec's `cluster.device_resource`, defined with the profiles' cost model);
#: Ray reserves it through `num_gpus`, never through `resources`.
GPU_RESOURCE = GPU_DEVICE_RESOURCE
#: The device resource of a cluster whose "devices" are plain CPUs (no reservation beyond `num_cpus`).
CPU_RESOURCE = "CPU"


def select_device(device_resource: str, cuda_available: bool | None = None) -> torch.device:
    """CUDA exactly when the cluster's device resource is a GPU and torch sees one (`cuda_available`, default
    `torch.cuda.is_available()`); the CPU otherwise."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if device_resource == GPU_RESOURCE and cuda_available:
        return torch.device("cuda")
    return torch.device("cpu")


def device_reservation(device_resource: str, share: float, logical: bool = True) -> dict[str, Any]:
    """`ray_actor_options` entries reserving `share` of one device: `num_gpus` for a GPU, `resources` for a logical
    device resource (only when `logical`; single-model deployments on CPU-only clusters reserve none, as before),
    nothing for 'CPU'."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1] of one device, got {share}")
    if device_resource == GPU_RESOURCE:
        return {"num_gpus": share}
    if device_resource == CPU_RESOURCE or not logical:
        return {}
    return {"resources": {device_resource: share}}
