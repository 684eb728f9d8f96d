"""Profiles for every model of a deployment spec, measured by one command.

    python -m parallel profile-spec configs/many_models.yaml --out configs/profiles/many-models-measured.json

The spec file is a Serve config (its plexserve application's `args`) or a bare deployment spec. Every model is
profiled as its group replicas load it (`spec_model_source`: a token-adaptation ViT as its adaptive backbone);
models that load the same weights at the same input length (copies of one checkpoint under several names) are
measured once and the profile is stored under each name. Then, as `python -m parallel profile` and `configs` do
one model at a time: the layer profiles, the communication model between Ray actors (a group of more than one
device), each block sharded where the model supports tensor parallelism, and both passes of the auto-parallelizer
for every configuration of every group size up to the cluster's device count under its per-device memory
(AlpaServe §4.1). The result is the `ProfileSet` that the spec's `planning.profiles.path` names.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Sequence

import yaml

from parallel.comm_model import AlphaBeta, CommModel
from parallel.configurations import emit_profile_set
from parallel.profiler import LayerProfileSet, ModelLayerProfile, device_description, now_utc, profile_layers
from parallel.stage_layers import ModelSource, load_model
from placement.core.deployment_spec import DeploymentSpec, ModelSpec, parse_spec
from placement.core.profiles import ProfileSet

logger = logging.getLogger(__name__)

#: The Serve application builder whose `args` are a plexserve deployment spec.
PLEXSERVE_IMPORT_PATH = "rayserve_apps.app:build_app"
#: Tokens per sequence a text model is profiled at when its spec gives no input limit.
DEFAULT_SEQ_LEN_TOKENS = 32
#: Logical CPUs declared to a Ray that profile-spec starts itself (the communication probes' actors).
RAY_NUM_CPUS = 4
#: The policy role that makes a vision model a token-adaptation (OTAS) model, and its artefacts parameter.
TOKEN_ADAPTATION_ROLE = "token_adaptation"


def load_spec_file(path: str | Path) -> DeploymentSpec:
    """The deployment spec of a YAML or JSON file: a Serve config's plexserve application, or a bare spec."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"spec file {path} does not exist")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping (a Serve config or a deployment spec)")
    if "applications" in data:
        apps = [app for app in data["applications"] or [] if app.get("import_path") == PLEXSERVE_IMPORT_PATH]
        if len(apps) != 1:
            raise ValueError(f"{path}: expected one application with import_path {PLEXSERVE_IMPORT_PATH}, found "
                             f"{len(apps)}")
        data = apps[0].get("args") or {}
    return parse_spec(data)


def spec_model_source(model: ModelSpec) -> ModelSource:
    """What a group replica's stage actors load for `model` (rayserve_apps/replicas/group.py does the same)."""
    timm_kwargs = dict(model.timm_kwargs)
    if model.kind == "vision" and model.in_chans != 3:
        timm_kwargs["in_chans"] = model.in_chans
    artifacts = None
    policy = model.policies.get(TOKEN_ADAPTATION_ROLE)
    if model.kind == "vision" and policy is not None:
        from models.task_registry import DIGITS_ARTIFACTS_DIR

        artifacts = str(policy.params.get("artifacts", DIGITS_ARTIFACTS_DIR))
    return ModelSource(name=model.name, kind=model.kind, source=model.source, checkpoint_path=model.checkpoint_path,
                       num_classes=model.num_classes or 1000, image_size_px=model.image_size_px or 224,
                       timm_kwargs=timm_kwargs, adaptive_artifacts=artifacts)


def _seq_len(model: ModelSpec, default: int) -> int | None:
    if model.kind != "text":
        return None
    return min(default, model.max_input_length_tokens) if model.max_input_length_tokens else default


def _weights_key(source: ModelSource, seq_len: int | None) -> str:
    """Equal for models that load the same weights the same way (their names aside)."""
    return json.dumps([source.model_dump(mode="json", exclude={"name"}), seq_len], sort_keys=True)


def supports_tensor_parallelism(model) -> bool:
    """Whether every block of a loaded model's layer view can be split across devices (`shard_block_layer`)."""
    from models.adaptive_vit_layers import AdaptiveBlockLayer
    from models.mpnet_layers import MPNetBlockLayer

    return not any(isinstance(layer, (AdaptiveBlockLayer, MPNetBlockLayer)) for layer in model.layers())


def default_group_sizes(spec: DeploymentSpec) -> list[int]:
    """Every group size from 1 to the cluster's device count."""
    return list(range(1, spec.cluster.num_devices + 1))


def profile_spec(spec: DeploymentSpec, group_sizes: Sequence[int] | None = None,
                 batch_sizes: Sequence[int] = (1, 2, 4), seq_len_tokens: int = DEFAULT_SEQ_LEN_TOKENS,
                 repeats: int = 5, layers_out: str | Path | None = None) -> ProfileSet:
    """Measure every model of `spec` and plan every configuration (see the module docstring).

    Group sizes above 1 need the communication model, measured between Ray actors (Ray is started when it is not
    up); with group size 1 alone no actor is started and handing the first stage its input is priced at zero."""
    group_sizes = sorted(set(group_sizes or default_group_sizes(spec)))
    if min(group_sizes) < 1 or max(group_sizes) > spec.cluster.num_devices:
        raise ValueError(f"group sizes {group_sizes} must lie in [1, cluster.num_devices={spec.cluster.num_devices}]")
    measured: dict[str, ModelLayerProfile] = {}
    tensor_parallel: dict[str, bool] = {}
    keys: dict[str, str] = {}
    sources: dict[str, ModelSource] = {}
    seq_lens: dict[str, int] = {}
    for model in spec.models:
        source = spec_model_source(model)
        seq_len = _seq_len(model, seq_len_tokens)
        key = _weights_key(source, seq_len)
        keys[model.name], sources[model.name] = key, source
        if seq_len is not None:
            seq_lens[model.name] = seq_len
        if key in measured:
            logger.info("%s loads the same weights as an already profiled model: its profile is copied", model.name)
            continue
        loaded = load_model(source)
        tensor_parallel[key] = supports_tensor_parallelism(loaded)
        logger.info("profiling %s (%s%s)", model.name, model.source,
                    f", {seq_len} tokens" if seq_len is not None else "")
        measured[key] = profile_layers(source, batch_sizes, [seq_len] if seq_len is not None else (),
                                       repeats=repeats, model=loaded)
        del loaded
    degrees = [size for size in group_sizes if size >= 2]
    comm = CommModel(send=AlphaBeta(alpha_s=0.0, beta_s_per_byte=0.0))
    if degrees:
        comm = _measure_comm(measured, tensor_parallel, degrees, repeats)
    profiles = {name: measured[key].model_copy(update={"name": name, "source": sources[name]})
                for name, key in keys.items()}
    layer_set = LayerProfileSet(device=device_description(), models=profiles, comm=comm, updated=now_utc())
    if layers_out is not None:
        layer_set.save(layers_out)
    result = emit_profile_set(layer_set, group_sizes, seq_lens, float(spec.cluster.device_memory_bytes))
    for name, model_profile in list(result.models.items()):
        if not tensor_parallel[keys[name]]:
            kept = [c for c in model_profile.configs if c.config.intra_op_degree == 1]
            result.models[name] = model_profile.model_copy(update={"configs": kept})
    unfit = sorted(m.name for m in spec.models if m.name not in result.models or not result.models[m.name].configs)
    if unfit:
        raise ValueError(f"models {unfit} fit no configuration of group sizes {group_sizes} within "
                         f"cluster.device_memory_bytes={spec.cluster.device_memory_bytes}")
    return result


def _measure_comm(measured: dict[str, ModelLayerProfile], tensor_parallel: dict[str, bool], degrees: list[int],
                  repeats: int) -> CommModel:
    """Sends, collectives and hop overhead between Ray actors; each tensor-parallel model's blocks sharded."""
    import ray

    from parallel.profiler import profile_comm
    from parallel.sharded_profile import profile_sharded_blocks

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False)
    try:
        comm = profile_comm(degrees, repeats=repeats)
        for key, profile in list(measured.items()):
            if tensor_parallel[key]:
                measured[key] = profile_sharded_blocks(profile, degrees, repeats=repeats)
    finally:
        if started:
            ray.shutdown()
    return comm


def summary_lines(profiles: ProfileSet) -> list[str]:
    """One line per model and configuration: latency, pipeline period and weights per device at the smallest batch."""
    lines = []
    for name, model in profiles.models.items():
        for config in model.configs:
            batch = min(config.stages[0].latency_s)
            lines.append(f"{name:16s} {config.config.key():10s} latency {1e3 * config.latency(batch):8.2f} ms  "
                         f"period {1e3 * config.max_stage_latency(batch):8.2f} ms  "
                         f"weights/device {config.weight_bytes_per_device() / 2**20:7.1f} MiB  (batch {batch})")
    return lines


def add_arguments(parser: Any) -> None:
    parser.add_argument("spec", help="a Serve config with a plexserve application, or a bare deployment spec")
    parser.add_argument("--out", required=True, help="the ProfileSet JSON the spec's planning.profiles.path names")
    parser.add_argument("--group-sizes", type=int, nargs="+",
                        help="device group sizes to plan (default: 1 .. cluster.num_devices)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN_TOKENS,
                        help="text: tokens per sequence (capped by a model's max_input_length_tokens)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers-out", help="also write the layer profiles (input of `python -m parallel configs`)")


def run(args: Any) -> int:
    try:
        spec = load_spec_file(args.spec)
        if args.seq_len < 2 or min(args.batch_sizes) < 1 or args.repeats < 1:
            raise ValueError("--seq-len must be >= 2, --batch-sizes >= 1 and --repeats >= 1")
        profiles = profile_spec(spec, args.group_sizes, args.batch_sizes, args.seq_len, args.repeats,
                                args.layers_out)
    except ValueError as error:
        raise SystemExit(f"profile-spec: {error}") from None
    profiles.save(args.out)
    for line in summary_lines(profiles):
        print(line)
    budget = math.ceil(spec.cluster.device_memory_bytes / 2**20)
    print(f"wrote {args.out}: {len(profiles.models)} models, device memory {budget} MiB")
    return 0
