"""Reproduction profiles from AlpaServe Table 1, with a named, parameterised model-parallel overhead model.

These are *stand-in* profiles, built from the paper's published single-GPU latencies and weight sizes (V100,
sequence length 2048, AlpaServe §6.1 Table 1), never measured here. Split configurations are derived with the
overhead model of AlpaServe §3.3:

* inter-op parallelism (``pipeline_stages = n``): every stage boundary adds a communication overhead, and the
  stages are uneven (Fig. 8a: uneven partition dominates), so the slowest stage is slower than ``L / n``;
* intra-op parallelism (``intra_op_degree = o``): the latency drops to ``L / o`` times a collective-communication
  overhead that grows with ``o`` (Fig. 8b, Fig. 9a);
* batching (§6.5): latency grows linearly with the batch size.

Every constant is named and every one can be overridden through :class:`OverheadModel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from placement.core.profiles import ConfigProfile, ModelProfile, ParallelConfig, ProfileSet, StageProfile

GB = 10**9

#: AlpaServe Table 1: name -> (weight bytes, single-GPU latency in seconds for one 2048-token query).
#: BERT-104B's latency is the paper's figure "using a minimal degree of inter-op parallelism" (16 stages).
TABLE1_MODELS: dict[str, tuple[int, float]] = {
    "bert-1.3b": (int(2.4 * GB), 0.151),
    "bert-2.7b": (int(5.4 * GB), 0.238),
    "bert-6.7b": (int(13.4 * GB), 0.395),
    "bert-104b": (int(208 * GB), 4.600),
    "moe-1.3b": (int(2.6 * GB), 0.150),
    "moe-2.4b": (int(4.8 * GB), 0.171),
    "moe-5.3b": (int(10.6 * GB), 0.234),
}

#: AlpaServe Table 1: model sets S1-S4 as {model: number of instances}.
TABLE1_MODEL_SETS: dict[str, dict[str, int]] = {
    "S1": {"bert-1.3b": 32},
    "S2": {"bert-6.7b": 32},
    "S3": {"bert-1.3b": 10, "bert-2.7b": 10, "bert-6.7b": 10, "moe-1.3b": 10, "moe-2.4b": 10, "moe-5.3b": 10},
    "S4": {"bert-104b": 4},
}

#: The V100's usable memory for weights (AlpaServe §6.2 footnote 6: 16 GB, about 13 GB left for weights).
V100_WEIGHT_BUDGET_BYTES = 13 * GB

#: Fraction of the single-device latency added per pipeline-stage boundary (inter-op communication, §3.3 Fig. 8a).
INTER_OP_COMM_OVERHEAD_PER_BOUNDARY = 0.01
#: Slowest stage relative to the mean stage, per extra stage (uneven partition overhead, §3.3 Fig. 8a).
INTER_OP_UNEVEN_PER_EXTRA_STAGE = 0.02
#: Per extra intra-op device, the fraction of the ideal sharded latency lost to collectives (§3.3 Fig. 8b, 9a).
INTRA_OP_COMM_OVERHEAD_PER_EXTRA_DEVICE = 0.25
#: Latency growth per extra request in a batch, relative to batch size 1 (§6.5: grows about linearly; a batch of
#: 2 long sequences already saturates the GPU).
BATCH_LATENCY_SLOPE = 0.9
#: Batch sizes written into each stage profile (others interpolate / extrapolate linearly).
PROFILED_BATCH_SIZES = (1, 2, 4, 8, 16)
#: Intra-op degrees and pipeline-stage counts enumerated by default.
DEFAULT_INTRA_OP_DEGREES = (1, 2, 4, 8)
DEFAULT_PIPELINE_STAGES = (1, 2, 4, 8, 16)
#: Largest device group built by default (AlpaServe §6.3 uses groups of up to 32 GPUs for BERT-104B).
DEFAULT_MAX_GROUP_DEVICES = 32


@dataclass(frozen=True)
class OverheadModel:
    """The named constants of the overhead model above; override any to explore (AlpaServe §3.3 Fig. 7b)."""

    inter_op_comm_per_boundary: float = INTER_OP_COMM_OVERHEAD_PER_BOUNDARY
    inter_op_uneven_per_extra_stage: float = INTER_OP_UNEVEN_PER_EXTRA_STAGE
    intra_op_comm_per_extra_device: float = INTRA_OP_COMM_OVERHEAD_PER_EXTRA_DEVICE
    batch_latency_slope: float = BATCH_LATENCY_SLOPE
    batch_sizes: tuple[int, ...] = PROFILED_BATCH_SIZES
    intra_op_degrees: tuple[int, ...] = DEFAULT_INTRA_OP_DEGREES
    pipeline_stages: tuple[int, ...] = DEFAULT_PIPELINE_STAGES
    max_group_devices: int = DEFAULT_MAX_GROUP_DEVICES

    def stage_latencies(self, single_device_latency_s: float, config: ParallelConfig) -> list[float]:
        """Per-stage latency at batch size 1 of a model that takes `single_device_latency_s` on one device."""
        o, n = config.intra_op_degree, config.pipeline_stages
        sharded = single_device_latency_s / o * (1.0 + self.intra_op_comm_per_extra_device * (o - 1))
        total = sharded * (1.0 + self.inter_op_comm_per_boundary * (n - 1))
        if n == 1:
            return [total]
        mean = total / n
        # The first stage (embeddings + first layers) is the slowest; the rest share what is left evenly.
        # (The factor stays below n for any sensible constant, so every other stage keeps a positive latency.)
        slowest = mean * (1.0 + self.inter_op_uneven_per_extra_stage * (n - 1))
        rest = (total - slowest) / (n - 1)
        return [slowest] + [rest] * (n - 1)

    def batch_factor(self, batch_size: int) -> float:
        return 1.0 + self.batch_latency_slope * (batch_size - 1)

    def configs(self) -> list[ParallelConfig]:
        return [
            ParallelConfig(intra_op_degree=o, pipeline_stages=n)
            for o in self.intra_op_degrees for n in self.pipeline_stages if o * n <= self.max_group_devices
        ]


@dataclass
class PaperModelSet:
    """A reproduction profile set and the model instances it names (instance -> Table 1 model)."""

    profiles: ProfileSet
    instance_of: dict[str, str] = field(default_factory=dict)


def model_profile(name: str, weight_bytes: int, single_device_latency_s: float,
                  overhead: OverheadModel | None = None) -> ModelProfile:
    """A profile for every configuration of `overhead.configs()` (weights split evenly over all devices)."""
    overhead = overhead or OverheadModel()
    configs = []
    for config in overhead.configs():
        per_device = weight_bytes // config.num_devices
        stages = [
            StageProfile(
                latency_s={b: lat * overhead.batch_factor(b) for b in overhead.batch_sizes},
                weight_bytes_per_device=per_device,
            )
            for lat in overhead.stage_latencies(single_device_latency_s, config)
        ]
        configs.append(ConfigProfile(config=config, stages=stages))
    return ModelProfile(name=name, configs=configs)


def table1_profiles(overhead: OverheadModel | None = None) -> ProfileSet:
    """One profile per Table 1 model, named as in :data:`TABLE1_MODELS`."""
    models = {name: model_profile(name, size, lat, overhead) for name, (size, lat) in TABLE1_MODELS.items()}
    return ProfileSet(source="paper-reproduction", device="V100 16GB (AlpaServe Table 1)", models=models)


def table1_model_set(set_name: str, overhead: OverheadModel | None = None) -> PaperModelSet:
    """Profiles for model set S1-S4 of Table 1: instances named '<model>-<i>' (e.g. 'bert-1.3b-0')."""
    if set_name not in TABLE1_MODEL_SETS:
        raise ValueError(f"model set {set_name!r}: choose one of {sorted(TABLE1_MODEL_SETS)}")
    return replicate_profiles(table1_profiles(overhead), TABLE1_MODEL_SETS[set_name])


def replicate_profiles(profiles: ProfileSet, counts: dict[str, int]) -> PaperModelSet:
    """Instances '<model>-<i>' of the named profiles, `counts[model]` of each."""
    models: dict[str, ModelProfile] = {}
    instance_of: dict[str, str] = {}
    for model, count in counts.items():
        if model not in profiles.models:
            raise ValueError(f"counts names {model!r}, which has no profile")
        for i in range(count):
            instance = f"{model}-{i}"
            models[instance] = profiles.models[model].model_copy(update={"name": instance})
            instance_of[instance] = model
    return PaperModelSet(profiles=ProfileSet(source=profiles.source, device=profiles.device, models=models),
                         instance_of=instance_of)


#: The `alpa/bert-1.3b` profile that AlpaServe's own code ships for its tests: pipeline stages -> (per-stage
#: latency at batch size 1 in seconds, weight bytes per device of each stage). Single-device latency 0.099 s.
ALPASERVE_TEST_BERT_1_3B: dict[int, tuple[tuple[float, ...], int]] = {
    1: ((0.099,), int(2.6 * GB)),
    2: ((0.051, 0.052), int(1.3 * GB)),
    4: ((0.028, 0.027, 0.027, 0.029), int(0.65 * GB)),
    8: ((0.015,) + (0.014,) * 6 + (0.016,), int(0.325 * GB)),
}


def alpaserve_test_profiles(count: int) -> ProfileSet:
    """`count` copies ('bert-1.3b-<i>') of :data:`ALPASERVE_TEST_BERT_1_3B` (pipeline configurations only, batch
    size 1 only: the AlpaServe test case runs without batching)."""
    if count < 1:
        raise ValueError(f"count={count}: must be >= 1")
    configs = [ConfigProfile(config=ParallelConfig(pipeline_stages=stages),
                             stages=[StageProfile(latency_s={1: latency}, weight_bytes_per_device=weight)
                                     for latency in latencies])
               for stages, (latencies, weight) in ALPASERVE_TEST_BERT_1_3B.items()]
    models = {f"bert-1.3b-{i}": ModelProfile(name=f"bert-1.3b-{i}", configs=configs) for i in range(count)}
    return ProfileSet(source="paper-reproduction", device="V100 16GB (AlpaServe test profile)", models=models)
