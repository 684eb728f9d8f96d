"""Latency and memory profiles: what the simulator and the planner know of each model.

A profile holds, for each parallel configuration a device group can run (intra-op degree x pipeline stages,
AlpaServe §4.1), the latency of every pipeline stage for each batch size and the weight memory of every stage.
Profiles are plain data: `parallel/` measures and writes them, the paper's reproduction profiles are built by
`placement.alpaserve.paper_profiles`, and both round-trip through JSON unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from placement.core.latency_table import LatencyTable, table_latency_s


class ParallelConfig(BaseModel):
    """How one model is split over a device group: `pipeline_stages` stages of `intra_op_degree` devices each."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    intra_op_degree: int = Field(default=1, ge=1, description="Devices that shard each stage (tensor parallelism).")
    pipeline_stages: int = Field(default=1, ge=1, description="Number of pipeline stages (inter-op parallelism).")

    @property
    def num_devices(self) -> int:
        return self.intra_op_degree * self.pipeline_stages

    def key(self) -> str:
        return f"op{self.intra_op_degree}-pp{self.pipeline_stages}"


class StageProfile(BaseModel):
    """One pipeline stage: its latency by batch size and the weight bytes on each of its devices."""

    model_config = ConfigDict(extra="forbid")

    latency_s: LatencyTable = Field(description="Batch size -> seconds the stage takes for one batch.")
    weight_bytes_per_device: int = Field(ge=0,
                                         description="Weight memory of this stage on each of its devices, in bytes.")

    def latency(self, batch_size: int) -> float:
        """Latency of one batch; between profiled sizes linear interpolation, beyond the largest linear
        extrapolation."""
        return table_latency_s(self.latency_s, batch_size, beyond="last_slope")


class ConfigProfile(BaseModel):
    """A model under one parallel configuration."""

    model_config = ConfigDict(extra="forbid")

    config: ParallelConfig
    stages: list[StageProfile] = Field(min_length=1)
    load_s: float | None = Field(
        default=None, ge=0,
        description="Seconds to load this model's weights onto a group of this configuration and serve its first "
                    "request (measured; null: not measured, the controller's transition model uses its stand-in).")
    plan: dict[str, Any] | None = Field(
        default=None, description="The plan `python -m parallel configs` chose for this configuration (stage layer "
                                  "boundaries, shard layout), as `parallel.plan.ParallelPlan` JSON; opaque here: the "
                                  "group replica runs it. None: not planned (the runtime cuts the model evenly).")

    @model_validator(mode="after")
    def _check(self) -> "ConfigProfile":
        if len(self.stages) != self.config.pipeline_stages:
            raise ValueError(f"{len(self.stages)} stage profiles for {self.config.pipeline_stages} pipeline stages")
        return self

    def stage_latencies(self, batch_size: int = 1) -> list[float]:
        return [stage.latency(batch_size) for stage in self.stages]

    def latency(self, batch_size: int = 1) -> float:
        """End-to-end latency of one batch through all stages."""
        return sum(self.stage_latencies(batch_size))

    def max_stage_latency(self, batch_size: int = 1) -> float:
        """The pipeline's period: a new batch can enter every this many seconds."""
        return max(self.stage_latencies(batch_size))

    def weight_bytes_per_device(self) -> int:
        return max(stage.weight_bytes_per_device for stage in self.stages)


class ModelProfile(BaseModel):
    """All profiled parallel configurations of one model."""

    model_config = ConfigDict(extra="forbid")

    name: str
    configs: list[ConfigProfile] = Field(min_length=1)

    def get(self, config: ParallelConfig) -> ConfigProfile:
        for profile in self.configs:
            if profile.config == config:
                return profile
        raise KeyError(f"model {self.name!r} has no profile for {config.key()}")

    def has(self, config: ParallelConfig) -> bool:
        return any(profile.config == config for profile in self.configs)

    def single_device_latency(self, batch_size: int = 1) -> float:
        return self.get(ParallelConfig()).latency(batch_size)


class ProfileSet(BaseModel):
    """Profiles of several models, and where they come from."""

    model_config = ConfigDict(extra="forbid")

    source: Literal["measured", "paper-reproduction", "synthetic"] = Field(
        description="'measured' on a real device, 'paper-reproduction' from a paper's tables, 'synthetic' for tests."
    )
    device: str = Field(description="The device the figures describe, e.g. 'cpu: 1 thread' or 'V100 (AlpaServe Table "
                                    "1)'.")
    models: dict[str, ModelProfile] = Field(default_factory=dict)

    def merge(self, other: "ProfileSet") -> "ProfileSet":
        """Profiles of `other` override or extend this set's, configuration by configuration."""
        merged = {name: profile.model_copy(deep=True) for name, profile in self.models.items()}
        for name, profile in other.models.items():
            if name not in merged:
                merged[name] = profile.model_copy(deep=True)
                continue
            by_key = {c.config.key(): c for c in merged[name].configs}
            for config_profile in profile.configs:
                by_key[config_profile.config.key()] = config_profile
            merged[name] = ModelProfile(name=name, configs=list(by_key.values()))
        return ProfileSet(source=other.source, device=other.device, models=merged)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "ProfileSet":
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"profile file {path} does not exist")
        return cls.model_validate(json.loads(path.read_text()))
