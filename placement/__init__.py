"""Every decision plexserve makes, as pure policy objects: no torch, no ray.

One subpackage per paper over a shared core; the simulators and the live Ray Serve apps call the same objects.

* :mod:`placement.core`: deployment spec, latency/memory profiles, placement data, workloads, traces, traffic window.
* :mod:`placement.alpaserve`: simulator, placement planner and baselines, dispatch, batch forming, re-placement.
* :mod:`placement.arlo`: polymorphing runtimes, runtime allocation, instance replacement, autoscaling, request
  scheduler.
* :mod:`placement.otas`: token adaptation: profile, adaptive batching, token allocation, replica scheduler.
* :mod:`placement.tcb`: ConcatBatching batch schedulers and their trace replay.
"""

from placement.core.deployment_spec import ClusterSpec, DeploymentSpec, ModelSpec, PolicySpec, parse_spec
from placement.core.profiles import ConfigProfile, ModelProfile, ParallelConfig, ProfileSet, StageProfile

__all__ = [
    "ConfigProfile", "ModelProfile", "ParallelConfig", "ProfileSet", "StageProfile",
    "ClusterSpec", "DeploymentSpec", "ModelSpec", "PolicySpec", "parse_spec",
]
