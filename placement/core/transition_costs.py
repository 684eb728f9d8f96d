"""The stand-in costs of a rollout step, where measurement has none: what the live controller's transition model
(`placement/alpaserve/transition.py`) charges for loading models, starting replicas and serving while loading.

Plain data (a spec's `controller.transition` section); measured load times per model and parallel configuration
live with the profiles (`ConfigProfile.load_s`) and win over `load_bandwidth_bytes_per_s`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from placement.core.placement_plan import GroupPlacement
from placement.core.profiles import ProfileSet

#: Stand-in weight loading bandwidth per device where a profile has no measured load time, bytes per second
#: (a local disk read plus deserialisation on a CPU, order of magnitude).
DEFAULT_LOAD_BANDWIDTH_BYTES_PER_S = 200e6
#: Stand-in seconds to start a group replica (a Serve replica on new devices) before it loads its models.
DEFAULT_REPLICA_START_S = 5.0
#: Stand-in seconds to start a model's stage actor processes (a Python process importing torch and the model
#: library) before it loads its weights, where the step frees no actors the model can reuse.
DEFAULT_ACTOR_START_S = 4.0
#: Stand-in seconds of a rollout step besides loading: the three Serve config updates of `live_update.py`.
DEFAULT_STEP_OVERHEAD_S = 2.0
#: Stand-in slowdown of serving while a step loads (2 = devices serve at half speed).
DEFAULT_LOADING_SLOWDOWN = 2.0


class TransitionModel(BaseModel):
    """How a rollout step is priced (see the module doc); defaults are stand-ins, the fidelity benchmark measures."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    load_bandwidth_bytes_per_s: float = Field(default=DEFAULT_LOAD_BANDWIDTH_BYTES_PER_S, gt=0,
                                              description="Per-device weight loading bandwidth where a profile has no "
                                                          "load_s, bytes/s.")
    replica_start_s: float = Field(default=DEFAULT_REPLICA_START_S, ge=0,
                                   description="Seconds to start a replica on new devices (start / replace), before "
                                               "loading.")
    actor_start_s: float = Field(default=DEFAULT_ACTOR_START_S, ge=0,
                                 description="Seconds to start a model's stage actor processes before it loads, "
                                             "where no dropped model's actors are reused (a rehost that drops one "
                                             "model and adds another reloads the dropped model's actors).")
    step_overhead_s: float = Field(default=DEFAULT_STEP_OVERHEAD_S, ge=0,
                                   description="Seconds of each rollout step besides loading (config updates, "
                                               "routing).")
    loading_slowdown: float = Field(default=DEFAULT_LOADING_SLOWDOWN, ge=1,
                                    description="Factor by which every latency grows while a step loads (shared "
                                                "devices).")

    def load_s(self, profiles: ProfileSet, model: str, group: GroupPlacement) -> float:
        """Seconds to load `model`'s weights on `group` into running stage actors: the profile's measured load_s,
        or weight bytes / bandwidth."""
        profile = profiles.models[model].get(group.config)
        if profile.load_s is not None:
            return profile.load_s
        return profile.weight_bytes_per_device() / self.load_bandwidth_bytes_per_s
