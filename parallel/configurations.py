"""Configurations: for a device group, every (intra-op degree, pipeline stages) split, planned by both passes.

AlpaServe §4.1: "enumerate different inter- and intra-op device partition setups and generate a list of parallel
strategies for the placement algorithm". For a group of n devices this module tries every intra-op degree d
dividing n with n / d pipeline stages; the inter-op DP (`parallel.inter_op`) cuts the layer view into stages,
pricing each candidate stage by the intra-op ILP (`parallel.intra_op`) on d devices under the per-device memory
budget. The plan is chosen at one reference batch size (the runtime runs one plan); its stage latencies are then
evaluated for every profiled batch size. The result is a `placement.core.profiles.ProfileSet` with source
'measured', exactly what `placement/` reads, each configuration carrying the `ParallelPlan` the runtime executes
(`ConfigProfile.plan`; a group replica runs it, `parallel.plan.stored_or_even`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

from parallel.comm_model import CommModel
from parallel.inter_op import StagePartition, slice_stages
from parallel.intra_op import BlockCost, IntraOpSolution, StageCost, evaluate, solve_intra_op, stage_problem
from parallel.plan import ParallelPlan, StagePlan
from parallel.profiler import LayerProfileSet, ModelLayerProfile, shape_key
from parallel.tensor_parallel import BlockShardingPlan
from placement.core.profiles import ConfigProfile, ModelProfile, ParallelConfig, ProfileSet, StageProfile

logger = logging.getLogger(__name__)


def enumerate_configs(group_size: int) -> list[ParallelConfig]:
    """Every (intra-op degree d, pipeline stages n / d) with d dividing the group size n."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return [ParallelConfig(intra_op_degree=d, pipeline_stages=group_size // d)
            for d in range(1, group_size + 1) if group_size % d == 0]


def block_prefix(index: int) -> str:
    return f"layer{index}."


@dataclass(frozen=True)
class RuntimeOverhead:
    """The runtime's per-hop and per-request overhead beyond what the stage latencies price (their receive at the
    alpha-beta send cost): the fields of `placement.core.profiles.ConfigProfile`'s cost model (AlpaServe §3.3)."""

    hop_overhead_s: float = 0.0
    hop_cpu_s: float = 0.0
    request_cpu_s: float = 0.0
    request_overhead_s: float = 0.0
    background_cpu_cores: float = 0.0
    co_run_slowdown: float = 1.0

    @classmethod
    def from_comm(cls, comm: CommModel, co_run_slowdown: float | None = None) -> "RuntimeOverhead":
        """From the measured hop (none measured: zero) and the model's co-run slowdown (none measured: 1). A stage's
        latency already holds the send of an input of the relayed payload's size, so only what the hop costs
        beyond that send is added."""
        slowdown = 1.0 if co_run_slowdown is None else co_run_slowdown
        if comm.hop is None:
            return cls(co_run_slowdown=slowdown)
        wall, cpu = comm.hop.beyond_send(comm.send_s(comm.hop.payload_bytes))
        return cls(hop_overhead_s=wall, hop_cpu_s=cpu, request_cpu_s=comm.hop.request_cpu_s,
                   request_overhead_s=comm.hop.request_latency_s, background_cpu_cores=comm.hop.background_cpu_cores,
                   co_run_slowdown=slowdown)

    def profile_fields(self) -> dict[str, float]:
        """The `ConfigProfile` fields of this overhead."""
        return asdict(self)


@dataclass
class PlannedConfig:
    """One configuration of one model: the plan the runtime runs and its predicted stage latencies."""

    config: ParallelConfig
    plan: ParallelPlan
    stage_latency_s: dict[int, list[float]]  # batch size -> latency of each stage
    stage_weight_bytes: list[int]  # per device of each stage
    overhead: RuntimeOverhead = field(default_factory=RuntimeOverhead)
    stage_cpu_s: dict[int, list[float]] | None = None  # intra-op: batch size -> compute of each stage's shards

    def to_profile(self) -> ConfigProfile:
        stages = [StageProfile(latency_s={b: lat[s] for b, lat in self.stage_latency_s.items()},
                               weight_bytes_per_device=self.stage_weight_bytes[s],
                               cpu_s=None if self.stage_cpu_s is None else {b: cpu[s]
                                                                            for b, cpu in self.stage_cpu_s.items()})
                  for s in range(len(self.plan.stages))]
        return ConfigProfile(config=self.config, stages=stages, plan=self.plan.model_dump(mode="json"),
                             **self.overhead.profile_fields())


class ModelPlanner:
    """Runs both passes on one model's layer profile for one sequence length."""

    def __init__(self, profile: ModelLayerProfile, comm: CommModel, seq_len_tokens: int | None = None,
                 memory_budget_bytes: float = math.inf):
        self.profile = profile
        self.comm = comm
        self.memory_budget_bytes = memory_budget_bytes
        if profile.tokens_per_sequence is not None:
            seq_len_tokens = profile.tokens_per_sequence
        if seq_len_tokens is None:
            seq_len_tokens = profile.shapes()[0][1]  # the shortest profiled length
        self.seq_len_tokens = seq_len_tokens
        self._solved: dict[tuple[int, int, int, int], IntraOpSolution | None] = {}
        self.batch_sizes = sorted(b for b, s in profile.shapes() if s == seq_len_tokens)
        if not self.batch_sizes:
            raise ValueError(f"model {profile.name!r} has no measurement at {seq_len_tokens} tokens; "
                             f"profiled shapes: {profile.shapes()}")

    def _key(self, batch_size: int) -> str:
        return shape_key(batch_size, self.seq_len_tokens)

    def receive_s(self, layer_index: int, batch_size: int) -> float:
        """Cost of handing a stage starting at `layer_index` its input (from the caller or the previous stage)."""
        key = self._key(batch_size)
        num_bytes = (self.profile.input_bytes[key] if layer_index == 0
                     else self.profile.layers[layer_index - 1].output_bytes[key])
        return self.comm.send_s(num_bytes)

    def stage_cost(self, start: int, end: int, degree: int, batch_size: int) -> StageCost:
        key = self._key(batch_size)
        # A block run sharded was timed with every shard computing at once; `ConfigProfile.stage_latencies` applies
        # that co-run slowdown to an intra-op stage itself, so the measurement enters in the units of one alone.
        co_run = self.profile.co_run_slowdown or 1.0
        stage = StageCost()
        for layer in self.profile.layers[start:end]:
            if layer.kind == "block" and layer.block_shape is not None:
                sharded = layer.sharded_latency_s.get(degree, {}).get(key)
                stage.blocks.append(BlockCost(prefix=block_prefix(layer.index), shape=layer.block_shape,
                                              latency_s=layer.latency_s[key],
                                              other_weight_bytes=layer.other_weight_bytes,
                                              batch_size=batch_size, tokens_per_sequence=self.seq_len_tokens,
                                              sharded_latency_s=None if sharded is None else sharded / co_run))
            else:
                stage.other_latency_s += layer.latency_s[key]
                stage.other_weight_bytes += layer.weight_bytes
        return stage

    def solve_stage(self, start: int, end: int, degree: int, batch_size: int) -> IntraOpSolution | None:
        """The intra-op optimum of layers [start, end) on `degree` devices (cached: configurations share stages)."""
        key = (start, end, degree, batch_size)
        if key not in self._solved:
            problem = stage_problem(self.stage_cost(start, end, degree, batch_size), degree, self.comm,
                                    self.memory_budget_bytes)
            self._solved[key] = solve_intra_op(problem)
        return self._solved[key]

    def plan(self, config: ParallelConfig, reference_batch_size: int | None = None) -> PlannedConfig | None:
        """Both passes for one configuration; None when it does not fit the memory budget."""
        num_layers = len(self.profile.layers)
        if config.pipeline_stages > num_layers:
            return None
        reference = reference_batch_size or self.batch_sizes[0]
        solutions: dict[tuple[int, int], IntraOpSolution | None] = {}

        def latency(i: int, k: int) -> float:
            solution = self.solve_stage(i, k, config.intra_op_degree, reference)
            solutions[(i, k)] = solution
            return math.inf if solution is None else solution.latency_s + self.receive_s(i, reference)

        partition: StagePartition | None = slice_stages(num_layers, config.pipeline_stages, latency)
        if partition is None:
            return None
        stages = []
        for i, k in partition.bounds:
            shardings = {}
            for layer in self.profile.layers[i:k]:
                if layer.kind == "block" and config.intra_op_degree > 1:
                    shardings[layer.index] = solutions[(i, k)].block_plan(block_prefix(layer.index)).as_dict()
            stages.append(StagePlan(start_layer=i, end_layer=k, block_shardings=shardings))
        return self.price(ParallelPlan(intra_op_degree=config.intra_op_degree, stages=stages))

    def stage_choices(self, stage: StagePlan) -> dict[str, str]:
        """The sharding of every linear of `stage`'s blocks, as the intra-op pass names them (replicated where the
        plan names none)."""
        shardings = stage.block_plans()
        return {f"{block_prefix(m.index)}{name}": choice
                for m in self.profile.layers[stage.start_layer:stage.end_layer] if m.kind == "block"
                for name, choice in shardings.get(m.index, BlockShardingPlan.replicated()).as_dict().items()}

    def price(self, plan: ParallelPlan) -> PlannedConfig:
        """A fixed `plan` as the cost model sees it: each stage's latency (and, sharded, what each shard computes) at
        every profiled batch size, and its weight bytes per device."""
        degree = plan.intra_op_degree
        stages = [(st.start_layer, st.end_layer, self.stage_choices(st)) for st in plan.stages]
        latencies = {b: [self.predict_stage_s(i, k, degree, b, choices) for i, k, choices in stages]
                     for b in self.batch_sizes}
        compute = None if degree == 1 else {
            b: [self.predict_stage_compute_s(i, k, degree, b, choices) for i, k, choices in stages]
            for b in self.batch_sizes}
        weight_bytes = [int(math.ceil(self._evaluate(i, k, degree, self.batch_sizes[0], choices).memory_bytes))
                        for i, k, choices in stages]
        return PlannedConfig(config=ParallelConfig(intra_op_degree=degree, pipeline_stages=len(plan.stages)),
                             plan=plan, stage_latency_s=latencies, stage_weight_bytes=weight_bytes,
                             overhead=RuntimeOverhead.from_comm(self.comm, self.profile.co_run_slowdown),
                             stage_cpu_s=compute)

    def _evaluate(self, start: int, end: int, degree: int, batch_size: int, choices: dict[str, str]) -> IntraOpSolution:
        problem = stage_problem(self.stage_cost(start, end, degree, batch_size), degree, self.comm, math.inf)
        return evaluate(problem, choices)

    def predict_stage_s(self, start: int, end: int, degree: int, batch_size: int, choices: dict[str, str]) -> float:
        """A stage's latency at `batch_size` under fixed shardings: receive + replicated layers + sharded blocks."""
        return self.receive_s(start, batch_size) + self._evaluate(start, end, degree, batch_size, choices).latency_s

    def predict_stage_compute_s(self, start: int, end: int, degree: int, batch_size: int,
                                choices: dict[str, str]) -> float:
        """What each shard of the stage computes at `batch_size` under fixed shardings, in the units of the layer
        profile: its latency without the collectives, in which a shard waits rather than computes (the cost model's
        shared-host CPU cap, `ConfigProfile.cpu_per_batch_s`)."""
        stage = self.stage_cost(start, end, degree, batch_size)
        stage.blocks = [replace(block, sharded_latency_s=None) for block in stage.blocks]
        return evaluate(stage_problem(stage, degree, self.comm.without_collectives(degree), math.inf),
                        choices).latency_s


def model_configurations(profile: ModelLayerProfile, comm: CommModel, group_sizes: Sequence[int],
                         seq_len_tokens: int | None = None,
                         memory_budget_bytes: float = math.inf) -> list[PlannedConfig]:
    planner = ModelPlanner(profile, comm, seq_len_tokens, memory_budget_bytes)
    planned = []
    for size in group_sizes:
        for config in enumerate_configs(size):
            result = planner.plan(config)
            if result is None:
                logger.info("%s: %s does not fit %.0f bytes per device", profile.name, config.key(),
                            memory_budget_bytes)
                continue
            logger.info("%s %s: stages %s, stage latency at batch %d %s ms", profile.name, config.key(),
                        [(s.start_layer, s.end_layer) for s in result.plan.stages], planner.batch_sizes[0],
                        [round(1e3 * x, 3) for x in result.stage_latency_s[planner.batch_sizes[0]]])
            planned.append(result)
    return planned


def emit_profile_set(layer_profiles: LayerProfileSet, group_sizes: Sequence[int],
                     seq_len_tokens: dict[str, int] | None = None, memory_budget_bytes: float = math.inf) -> ProfileSet:
    """The `placement.core.profiles.ProfileSet` (source 'measured') of every model and configuration that fits."""
    if layer_profiles.comm is None:
        raise ValueError("the layer profile has no communication model: run the profiler with comm profiling first")
    seq_len_tokens = seq_len_tokens or {}
    models = {}
    for name, profile in layer_profiles.models.items():
        planned = model_configurations(profile, layer_profiles.comm, group_sizes, seq_len_tokens.get(name),
                                       memory_budget_bytes)
        if planned:
            models[name] = ModelProfile(name=name, configs=[p.to_profile() for p in planned])
    host_cores = layer_profiles.comm.hop.host_cores if layer_profiles.comm.hop is not None else None
    return ProfileSet(source="measured", device=layer_profiles.device, models=models, host_cores=host_cores)
