"""Latency and memory profiles: what the simulator and the planner know of each model.

A profile holds, for each parallel configuration a device group can run (intra-op degree x pipeline stages,
AlpaServe §4.1), the latency of every pipeline stage for each batch size and the weight memory of every stage.
Profiles are plain data: `parallel/` measures and writes them, the paper's reproduction profiles are built by
`placement.alpaserve.paper_profiles`, and both round-trip through JSON unchanged.

The cost model of a configuration (AlpaServe §3.3, "Overhead of Model Parallelism", and §4.1): a request's latency
is the sum of its stage latencies and a pipeline admits a new batch every slowest-stage time; beyond AlpaServe, a
measured profile also prices the runtime's per-hop overhead (each stage is a Ray actor call: submission,
serialization, scheduling, the result's return) and, where the devices are logical CPU shares of one host, the
host's cores, which bound throughput by the whole request's CPU (`ConfigProfile.period_s`). Profiles without those
fields (files written without them, paper reproductions) price them at zero and no shared host.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from placement.core.latency_table import LatencyTable, table_latency_s

#: The device resource whose devices are independent accelerators (`ClusterSpec.device_resource`); any other
#: resource stands for logical shares of CPU hosts.
GPU_DEVICE_RESOURCE = "GPU"


def shared_host_cores(device_resource: str, host_cores: float | None) -> float | None:
    """The cores a group's devices share when they are logical CPU shares of one host (`device_resource` is not
    'GPU'); None for GPUs, whose devices run independently (throughput stays 1 / slowest stage)."""
    if device_resource == GPU_DEVICE_RESOURCE or host_cores is None:
        return None
    if host_cores <= 0:
        raise ValueError(f"host_cores must be > 0, got {host_cores}")
    return float(host_cores)


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
    cpu_s: LatencyTable | None = Field(
        default=None,
        description="Batch size -> seconds each of the stage's devices computes for one batch, where that is less "
                    "than the latency: the shards of an intra-op stage wait in their collectives without computing. "
                    "None: the latency.")

    def latency(self, batch_size: int) -> float:
        """Latency of one batch; between profiled sizes linear interpolation, beyond the largest linear
        extrapolation."""
        return table_latency_s(self.latency_s, batch_size, beyond="last_slope")

    def compute(self, batch_size: int) -> float:
        """Seconds each device of the stage computes for one batch (interpolated as the latency is)."""
        if self.cpu_s is None:
            return self.latency(batch_size)
        return table_latency_s(self.cpu_s, batch_size, beyond="last_slope")


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
    hop_overhead_s: float = Field(
        default=0.0, ge=0,
        description="Wall seconds each stage call adds beyond its stage latency (the runtime's per-hop overhead: "
                    "actor call, serialization, scheduling, returning the result), measured by the profiler; added to "
                    "every stage's time and so to the latency. 0 in profiles that did not measure it.")
    hop_cpu_s: float = Field(
        default=0.0, ge=0,
        description="Host CPU seconds each stage call costs beyond its stage latency, summed over every process "
                    "(caller, Ray, actors); prices throughput where devices share a host's cores. 0: not measured.")
    request_cpu_s: float = Field(
        default=0.0, ge=0,
        description="Host CPU seconds one request costs outside its stage calls (putting its input, collecting its "
                    "result). 0: not measured.")
    request_overhead_s: float = Field(
        default=0.0, ge=0,
        description="Wall seconds one request spends outside its stage calls (putting its input, waiting for and "
                    "collecting the results), added once to the latency. 0: not measured.")
    background_cpu_cores: float = Field(
        default=0.0, ge=0,
        description="Cores of a shared host that the serving system keeps busy on its own, whatever the load (Ray's "
                    "raylet, GCS and agents; CPU seconds per second, measured by the profiler), not left to requests "
                    "in the shared-host cap. 0: not measured.")
    co_run_slowdown: float = Field(
        default=1.0, ge=1.0,
        description="Factor by which compute slows while every core of a shared host runs (measured with the model "
                    "co-running on the other cores, where the devices are a host's CPU cores); multiplies the compute "
                    "CPU of the shared-host cap and the latency of an intra-op stage, whose shards always compute at "
                    "once. 1: not measured.")

    @model_validator(mode="after")
    def _check(self) -> "ConfigProfile":
        if len(self.stages) != self.config.pipeline_stages:
            raise ValueError(f"{len(self.stages)} stage profiles for {self.config.pipeline_stages} pipeline stages")
        return self

    def stage_latencies(self, batch_size: int = 1) -> list[float]:
        """Each stage's time for one batch: its profiled latency plus the per-hop overhead of its call. The shards of
        an intra-op stage compute at the same time, so where that slows compute (`co_run_slowdown`, measured on
        hosts whose devices are CPU cores) their stage runs that much slower even for one request alone."""
        slowdown = self.co_run_slowdown if self.config.intra_op_degree > 1 else 1.0
        return [stage.latency(batch_size) * slowdown + self.hop_overhead_s for stage in self.stages]

    def latency(self, batch_size: int = 1) -> float:
        """End-to-end latency of one batch through all stages (AlpaServe §3.3: compute plus communication), plus
        the request's own overhead outside its stage calls."""
        return sum(self.stage_latencies(batch_size)) + self.request_overhead_s

    def max_stage_latency(self, batch_size: int = 1) -> float:
        """The pipeline's period on independent devices: a new batch can enter every this many seconds."""
        return max(self.stage_latencies(batch_size))

    def cpu_per_batch_s(self, batch_size: int = 1) -> float:
        """Host CPU seconds one batch costs when the devices are CPU cores, all of them busy: every shard of every
        stage computes for its stage's compute time (its latency less the waits in collectives) slowed by
        co-running, plus the overhead CPU of each shard's call and of the request itself."""
        compute = self.config.intra_op_degree * sum(stage.compute(batch_size) for stage in self.stages)
        compute *= self.co_run_slowdown  # at saturation every core of the host computes at once
        return compute + self.config.num_devices * self.hop_cpu_s + self.request_cpu_s  # one call per shard

    def period_s(self, batch_size: int = 1, host_cores: float | None = None) -> float:
        """Seconds between batches at saturation. Independent devices (`host_cores` None, e.g. GPUs): the slowest
        stage (AlpaServe §3.3, uneven partition overhead). Devices that are shares of one host's `host_cores`
        cores (see `shared_host_cores`): also no less than the whole batch's CPU spread over those cores."""
        period = self.max_stage_latency(batch_size)
        if host_cores is None:
            return period
        available = host_cores - self.background_cpu_cores
        if available <= 0:
            raise ValueError(f"host_cores ({host_cores}) must exceed the background CPU ({self.background_cpu_cores} "
                             "cores)")
        return max(period, self.cpu_per_batch_s(batch_size) / available)

    def burst_s(self, num_batches: int, batch_size: int = 1, host_cores: float | None = None) -> float:
        """Seconds to serve `num_batches` batches submitted at once: the first after the latency, each next one a
        period later (a pipeline's fill, then its steady state)."""
        if num_batches < 1:
            raise ValueError(f"num_batches must be >= 1, got {num_batches}")
        return self.latency(batch_size) + (num_batches - 1) * self.period_s(batch_size, host_cores)

    def throughput_rps(self, batch_size: int = 1, host_cores: float | None = None) -> float:
        """Requests per second at saturation: `batch_size` / `period_s`."""
        return batch_size / self.period_s(batch_size, host_cores)

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
    host_cores: float | None = Field(
        default=None, gt=0,
        description="Cores of the host the profile was measured on (the profiler's count); with a device resource "
                    "other than 'GPU' the devices share them (`shared_host_cores`). None: not recorded.")

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
        return ProfileSet(source=other.source, device=other.device, models=merged,
                          host_cores=other.host_cores if other.host_cores is not None else self.host_cores)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "ProfileSet":
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"profile file {path} does not exist")
        return cls.model_validate(json.loads(path.read_text()))
