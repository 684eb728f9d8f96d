"""A placement as plain data: device groups, each with a parallel configuration and the models it hosts.

AlpaServe §4.2 calls the triple (cluster group partition, model selection, parallel configuration) a placement.
It round-trips through JSON, prints for people, and `normalize()` gives one canonical form (models sorted in each
group, groups sorted), so two equal placements compare and diff equal.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from placement.core.profiles import ParallelConfig, ProfileSet


class GroupPlacement(BaseModel):
    """One device group: its devices, its shared parallel configuration, and the models it hosts."""

    model_config = ConfigDict(extra="forbid")

    num_devices: int = Field(ge=1, description="Devices in the group (= intra_op_degree x pipeline_stages).")
    config: ParallelConfig = Field(description="The model-parallel configuration every hosted model runs with.")
    models: list[str] = Field(default_factory=list, description="Names of the models this group hosts.")

    @model_validator(mode="after")
    def _check(self) -> "GroupPlacement":
        if self.config.num_devices != self.num_devices:
            raise ValueError(f"num_devices={self.num_devices} but config {self.config.key()} uses "
                             f"{self.config.num_devices}")
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"group hosts a model twice: {self.models}")
        return self

    def weight_bytes_per_device(self, profiles: ProfileSet) -> int:
        """The largest per-device weight memory over the group's stages (AlpaServe §4.2 memory constraint)."""
        if not self.models:
            return 0
        totals = [0] * self.config.pipeline_stages
        for name in self.models:
            stages = profiles.models[name].get(self.config).stages
            for k, stage in enumerate(stages):
                totals[k] += stage.weight_bytes_per_device
        return max(totals)


class SearchStats(BaseModel):
    """What the search did, for people and benchmarks."""

    model_config = ConfigDict(extra="forbid")

    planner: str = Field(default="", description="Which planner produced this placement.")
    wall_time_s: float = Field(default=0.0, ge=0, description="Wall time of the search, seconds.")
    simulations: int = Field(default=0, ge=0, description="Simulator calls made.")
    candidates: int = Field(default=0, ge=0, description="Group partitions x parallel configurations evaluated.")
    notes: list[str] = Field(default_factory=list, description="Free-form remarks (pruning, skipped devices, ...).")


class Placement(BaseModel):
    """Groups, the predicted SLO attainment, and how the search got there."""

    model_config = ConfigDict(extra="forbid")

    groups: list[GroupPlacement] = Field(default_factory=list, description="The device groups.")
    predicted_slo_attainment: float | None = Field(default=None, ge=0, le=1,
                                                   description="SLO attainment the simulator predicts, 0..1.")
    stats: SearchStats = Field(default_factory=SearchStats, description="Search statistics.")

    @property
    def num_devices(self) -> int:
        return sum(group.num_devices for group in self.groups)

    def models(self) -> set[str]:
        return {name for group in self.groups for name in group.models}

    def normalize(self) -> "Placement":
        """Canonical form: models sorted inside groups; groups sorted by (devices, config, models)."""
        groups = [group.model_copy(update={"models": sorted(group.models)}) for group in self.groups]
        groups.sort(key=lambda g: (-g.num_devices, g.config.intra_op_degree, g.config.pipeline_stages, g.models))
        return self.model_copy(update={"groups": groups})

    def check_memory(self, profiles: ProfileSet, device_memory_bytes: int) -> None:
        """Raise ValueError naming the first group whose weights exceed a device's memory."""
        for index, group in enumerate(self.groups):
            used = group.weight_bytes_per_device(profiles)
            if used > device_memory_bytes:
                raise ValueError(f"groups.{index}: {used} weight bytes per device exceed "
                                 f"device_memory_bytes={device_memory_bytes}")

    def describe(self) -> str:
        lines = [f"placement: {len(self.groups)} groups on {self.num_devices} devices, predicted SLO attainment "
                 f"{self.predicted_slo_attainment if self.predicted_slo_attainment is not None else 'n/a'}"]
        for index, group in enumerate(self.groups):
            lines.append(f"  group {index}: {group.num_devices} devices, {group.config.key()}, "
                         f"{len(group.models)} models: {', '.join(group.models)}")
        return "\n".join(lines)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "Placement":
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"placement file {path} does not exist")
        return cls.model_validate(json.loads(path.read_text()))
