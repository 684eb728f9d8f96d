"""Every decision plexserve makes, as pure policy objects: no torch, no ray.

Specs and profiles, workloads and traces, the discrete-event simulator, the placement planner, runtime
allocation, dispatch, batch forming and token allocation. The simulator and the live Ray Serve apps call the
same objects.
"""

from placement.profiles import ConfigProfile, ModelProfile, ParallelConfig, ProfileSet, StageProfile
from placement.spec import ClusterSpec, DeploymentSpec, ModelSpec, PolicySpec, parse_spec

__all__ = [
    "ConfigProfile", "ModelProfile", "ParallelConfig", "ProfileSet", "StageProfile",
    "ClusterSpec", "DeploymentSpec", "ModelSpec", "PolicySpec", "parse_spec",
]
