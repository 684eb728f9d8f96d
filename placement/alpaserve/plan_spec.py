"""The planning spec: what `python -m placement plan` reads (models with profiles, traffic, SLOs, cluster).

A deployment spec says what to serve; a planning spec adds what the planner must know: where the profiles come
from (a ProfileSet JSON written by `parallel/`, or the paper's reproduction profiles), the traffic (a Poisson or
Gamma process, or an Azure Functions trace), the SLOs, the cluster and the planner's knobs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from placement.alpaserve.paper_profiles import TABLE1_MODELS, replicate_profiles, table1_model_set, table1_profiles
from placement.core.arrivals import GammaProcess, PoissonProcess
from placement.core.deployment_spec import ClusterSpec, format_validation_error
from placement.core.profiles import ProfileSet
from placement.core.workload import ModelTraffic, Workload, generate_workload, power_law_popularity, uniform_popularity

logger = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProfilesSpec(_Strict):
    """Where latency and memory profiles come from (exactly one source)."""

    path: str | None = Field(default=None, description="A ProfileSet JSON file (e.g. measured by parallel/).")
    paper_model_set: Literal["S1", "S2", "S3", "S4"] | None = Field(
        default=None,
        description="AlpaServe Table 1 model set; instances are named '<model>-<i>' (reproduction profiles).")
    paper_models: dict[str, int] | None = Field(
        default=None,
        description="Instances of AlpaServe Table 1 models, e.g. {'bert-1.3b': 4} (reproduction profiles).")

    @model_validator(mode="after")
    def _one_source(self) -> "ProfilesSpec":
        given = [name for name in ("path", "paper_model_set", "paper_models") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, paper_model_set, paper_models (got {given or 'none'})")
        if self.paper_models is not None:
            unknown = set(self.paper_models) - set(TABLE1_MODELS)
            if unknown:
                raise ValueError(f"paper_models: unknown {sorted(unknown)}; Table 1 has {sorted(TABLE1_MODELS)}")
        return self

    def load(self, base_dir: Path) -> ProfileSet:
        if self.path is not None:
            path = Path(self.path)
            return ProfileSet.load(path if path.is_absolute() else base_dir / path)
        if self.paper_model_set is not None:
            return table1_model_set(self.paper_model_set).profiles
        return replicate_profiles(table1_profiles(), self.paper_models).profiles


class WorkloadSpec(_Strict):
    """The traffic the planner optimises for (AlpaServe §6.2: Gamma processes, or a trace fitted and resampled)."""

    kind: Literal["poisson", "gamma", "trace"] = Field(default="gamma", description="Arrival process or trace replay.")
    total_rate_per_s: float = Field(default=10.0, gt=0,
                                    description="Requests per second over all models (poisson/gamma).")
    cv: float = Field(default=1.0, gt=0, description="Coefficient of variation of inter-arrival times (gamma).")
    popularity_exponent: float | None = Field(
        default=None, ge=0, description="Power-law exponent splitting the rate over models; null: uniform.")
    duration_s: float = Field(default=600.0, gt=0, description="Length of the generated workload, seconds.")
    seed: int = Field(default=0, description="Random seed.")
    trace_path: str | None = Field(default=None, description="Azure Functions trace file (kind 'trace').")
    trace_format: Literal["maf2019", "maf2021"] | None = Field(default=None, description="Format of trace_path.")
    window_s: float = Field(default=60.0, gt=0, description="Trace windows for the Gamma fit, seconds.")
    rate_scale: float = Field(default=1.0, gt=0, description="Factor on every fitted rate (trace).")
    cv_scale: float = Field(default=1.0, gt=0, description="Factor on every fitted CV (trace).")

    @model_validator(mode="after")
    def _trace_fields(self) -> "WorkloadSpec":
        if self.kind == "trace" and (self.trace_path is None or self.trace_format is None):
            raise ValueError("kind 'trace' needs trace_path and trace_format")
        return self


class PlannerSpec(_Strict):
    """Which planner and its knobs."""

    name: Literal["alpaserve", "selective_replication", "round_robin"] = Field(default="alpaserve",
                                                                               description="The planner.")
    beam_size: int = Field(default=1, ge=1, description="AlpaServe Alg. 1 beam size (used when fast is false).")
    fast: bool = Field(default=True, description="The fast variant of Alg. 1 (one simulation per placed replica).")
    replicas_per_round: int = Field(default=1, ge=0,
                                    description="Fast variant: replicas placed per simulation (0: groups/4).")
    screen_fraction: float | None = Field(default=None, gt=0, le=1,
                                          description="Alg. 2: share of the workload used to screen candidates (None: "
                                                      "the planner's default).")
    max_group_devices: int = Field(default=16, ge=1, description="Largest device group considered.")


class SimulationSpec(_Strict):
    """How the simulated system behaves."""

    dispatch: Literal["shortest_queue", "earliest_finish", "round_robin"] = Field(default="shortest_queue",
                                                                                  description="Dispatch policy.")
    slo_admission: bool = Field(default=True, description="Reject requests that cannot finish by their deadline.")
    max_batch_size: int = Field(default=1, ge=1, le=1024, description="Largest batch; 1 disables batching.")
    request_overhead_ms: float = Field(default=0.0, ge=0,
                                       description="Fixed time before the first stage, milliseconds.")
    response_overhead_ms: float = Field(default=0.0, ge=0, description="Fixed time after the last stage, milliseconds.")
    host_contention_per_busy_device: float = Field(
        default=0.0, ge=0, le=10,
        description="Share by which a batch's stage latencies grow per device of the other groups busy when it "
                    "starts: a stand-in for logical devices that share one host's CPU cores (0: devices of their own, "
                    "as GPUs).")


class PlanSpec(_Strict):
    """Everything `python -m placement plan` and `simulate` need."""

    profiles: ProfilesSpec = Field(description="Where the profiles come from.")
    models: list[str] | None = Field(default=None, description="Models to place (names in the profiles); null: all.")
    slo_scale: float = Field(default=5.0, gt=0,
                             description="SLO = slo_scale x single-device latency, unless slo_ms names the model.")
    slo_ms: dict[str, float] = Field(default_factory=dict, description="Per-model SLO overrides, milliseconds.")
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec, description="The traffic.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Devices and memory per device.")
    planner: PlannerSpec = Field(default_factory=PlannerSpec, description="The planner.")
    simulation: SimulationSpec = Field(default_factory=SimulationSpec, description="The simulated system.")


def load_plan_spec(path: str | Path) -> PlanSpec:
    """Read a JSON or YAML planning spec; raise ValueError naming every offending field."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"spec file {path} does not exist")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml
        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    try:
        return PlanSpec.model_validate(data)
    except ValidationError as error:
        raise ValueError(f"invalid planning spec: {format_validation_error(error)}") from None


def model_names(spec: PlanSpec, profiles: ProfileSet) -> list[str]:
    names = list(spec.models) if spec.models is not None else sorted(profiles.models)
    missing = [n for n in names if n not in profiles.models]
    if missing:
        raise ValueError(f"models: no profile for {missing}")
    unknown = set(spec.slo_ms) - set(names)
    if unknown:
        raise ValueError(f"slo_ms names models that are not placed: {sorted(unknown)}")
    return names


def slos_s(spec: PlanSpec, profiles: ProfileSet, names: list[str]) -> list[float]:
    from placement.alpaserve.planner import _reference_latency
    return [spec.slo_ms[n] / 1e3 if n in spec.slo_ms else spec.slo_scale * _reference_latency(profiles, n)
            for n in names]


def build_workload(spec: PlanSpec, profiles: ProfileSet, names: list[str], base_dir: Path) -> Workload:
    """The workload a spec describes (generated, or fitted from a trace and resampled)."""
    w = spec.workload
    slo = slos_s(spec, profiles, names)
    if w.kind == "trace":
        from placement.core.traces import load_trace, trace_workload
        path = Path(w.trace_path)
        trace = load_trace(path if path.is_absolute() else base_dir / path, w.trace_format)
        return trace_workload(trace, names, slo, window_s=w.window_s, rate_scale=w.rate_scale, cv_scale=w.cv_scale,
                              seed=w.seed)
    shares = (uniform_popularity(len(names)) if w.popularity_exponent is None
              else power_law_popularity(len(names), w.popularity_exponent))
    traffic = [ModelTraffic(PoissonProcess(w.total_rate_per_s * share) if w.kind == "poisson"
                            else GammaProcess(w.total_rate_per_s * share, w.cv), s)
               for share, s in zip(shares, slo)]
    return generate_workload(names, traffic, w.duration_s, seed=w.seed)




def prepare(spec: PlanSpec, base_dir: Path) -> tuple[ProfileSet, list[str], Workload]:
    """Profiles, model names and workload of a planning spec (relative paths are read from `base_dir`)."""
    profiles = spec.profiles.load(base_dir)
    names = model_names(spec, profiles)
    workload = build_workload(spec, profiles, names, base_dir)
    logger.info("spec: %d models, %d devices, workload of %d requests over %.0f s", len(names),
                spec.cluster.num_devices, len(workload), workload.duration_s)
    return profiles, names, workload


def simulator_config(spec: PlanSpec):
    """The simulated system a planning spec describes."""
    from placement.alpaserve.batching import MaxBatchWithinSLO
    from placement.alpaserve.dispatch import make_dispatch
    from placement.alpaserve.simulator import SimulatorConfig
    sim = spec.simulation
    return SimulatorConfig(
        dispatch=make_dispatch(sim.dispatch, slo_admission=sim.slo_admission),
        batching=MaxBatchWithinSLO(sim.max_batch_size) if sim.max_batch_size > 1 else None,
        request_overhead_s=sim.request_overhead_ms / 1e3, response_overhead_s=sim.response_overhead_ms / 1e3,
        host_contention_per_busy_device=sim.host_contention_per_busy_device,
    )


def planner_config(spec: PlanSpec):
    """The AlpaServe planner's knobs and simulated system a planning spec describes."""
    from placement.alpaserve.planner import PlannerConfig
    p = spec.planner
    screening = {} if p.screen_fraction is None else {"screen_fraction": p.screen_fraction}
    return PlannerConfig(beam_size=p.beam_size, fast=p.fast, replicas_per_round=p.replicas_per_round,
                         max_group_devices=p.max_group_devices, **screening,
                         allow_model_parallelism=p.name != "selective_replication",
                         simulator=simulator_config(spec), name=p.name)


def run_planner(spec: PlanSpec, profiles: ProfileSet, names: list[str], workload: Workload):
    """Run the spec's planner (AlpaServe §4.2, or a baseline) and return the normalized placement."""
    from placement.alpaserve.baselines import round_robin, selective_replication
    from placement.alpaserve.planner import plan
    p = spec.planner
    config = planner_config(spec)
    memory, devices = spec.cluster.device_memory_bytes, spec.cluster.num_devices
    if p.name == "alpaserve":
        placement = plan(names, profiles, workload, devices, memory, config)
    elif p.name == "selective_replication":
        placement = selective_replication(names, profiles, workload, devices, memory, config)
    else:
        placement = round_robin(names, profiles, workload, devices, memory, config.simulator)
    return placement.normalize()
