"""Profiler: per-layer latency, weight and activation bytes, and the cost of sends and collectives between actors.

AlpaServe §4.1 profiles only the K layers of a model (latency(i, k) of a stage is then the sum over its layers);
this module measures them on the device at hand, one thread as in a stage actor:

* `profile_layers`: forward latency of every layer of the layer view for each (batch size, sequence length),
  the bytes of every layer's weights and of the activation it hands to the next layer, and the shapes of its
  blocks (for the intra-op pass);
* `profile_comm`: the time to hand an activation from one Ray actor to the next (an actor call with a tensor
  argument held by another actor, as between pipeline stages) and of gloo all-reduce / all-gather among
  `degree` actors, for several sizes, fitted with the alpha-beta model (`parallel.comm_model`).

Results are a `LayerProfileSet` JSON file; `merge` combines repeated runs (latencies are averaged, weighted by
their sample counts; communication fits are replaced by the newer run's).
"""

from __future__ import annotations

import datetime
import logging
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from models.layers import ActivationState, parameter_bytes
from parallel.comm_model import CommModel, fit_alpha_beta
from parallel.intra_op import BlockShape
from parallel.stage_layers import ModelSource, example_input, load_model, standalone_layers
from parallel.tensor_parallel import BlockParts, bert_block_parts, vit_block_parts

logger = logging.getLogger(__name__)

DEFAULT_WARMUP = 2
DEFAULT_REPEATS = 5
#: Activation sizes (bytes) at which sends and collectives are timed.
DEFAULT_COMM_SIZES_BYTES = (4_096, 65_536, 524_288, 2_097_152)
DEFAULT_COMM_REPEATS = 10
COMM_PROBE_NUM_CPUS = 0.5
FP32_BYTES = 4


def shape_key(batch_size: int, seq_len_tokens: int) -> str:
    """The key of one measured shape: '<batch>x<tokens>'."""
    return f"{batch_size}x{seq_len_tokens}"


def state_bytes(state: ActivationState) -> int:
    tensors = [state.hidden, state.attention_mask, state.attention_bias, *state.extras.values()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class LayerMeasurement(BaseModel):
    """One layer of a model's layer view."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0, description="Position in the layer view.")
    kind: str = Field(description="'embeddings', 'block' or 'head'.")
    weight_bytes: int = Field(ge=0, description="Bytes of the layer's weights, unsplit.")
    latency_s: dict[str, float] = Field(default_factory=dict,
                                        description="'<batch>x<tokens>' -> forward seconds (1 thread).")
    samples: dict[str, int] = Field(default_factory=dict,
                                    description="'<batch>x<tokens>' -> timed runs behind latency_s.")
    output_bytes: dict[str, int] = Field(default_factory=dict,
                                         description="'<batch>x<tokens>' -> bytes of the state it outputs.")
    block_shape: BlockShape | None = Field(default=None,
                                           description="Blocks: shapes of the linears (for the intra-op pass).")
    other_weight_bytes: int = Field(default=0, ge=0,
                                    description="Blocks: weight bytes outside the four linears (norms).")


class ModelLayerProfile(BaseModel):
    """All layers of one model."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Model name.")
    source: ModelSource = Field(description="Where the model was loaded from.")
    tokens_per_sequence: int | None = Field(default=None,
                                            description="Vision: tokens per image (fixed by the image size).")
    input_bytes: dict[str, int] = Field(default_factory=dict,
                                        description="'<batch>x<tokens>' -> bytes of the model input.")
    layers: list[LayerMeasurement] = Field(description="Every layer, in order.")

    def shapes(self) -> list[tuple[int, int]]:
        keys = set(self.layers[0].latency_s)
        return sorted(tuple(int(part) for part in key.split("x")) for key in keys)  # type: ignore[misc]

    def merge(self, other: "ModelLayerProfile") -> "ModelLayerProfile":
        if len(other.layers) != len(self.layers):
            raise ValueError(f"model {self.name!r}: {len(other.layers)} layers in the new profile, {len(self.layers)} "
                             "before")
        layers = []
        for mine, theirs in zip(self.layers, other.layers):
            latency, samples = dict(mine.latency_s), dict(mine.samples)
            for key, seconds in theirs.latency_s.items():
                old_n, new_n = samples.get(key, 0), theirs.samples.get(key, 1)
                latency[key] = (latency.get(key, 0.0) * old_n + seconds * new_n) / (old_n + new_n)
                samples[key] = old_n + new_n
            layers.append(theirs.model_copy(update={"latency_s": latency, "samples": samples,
                                                    "output_bytes": {**mine.output_bytes, **theirs.output_bytes}}))
        return other.model_copy(update={"layers": layers, "input_bytes": {**self.input_bytes, **other.input_bytes}})


class LayerProfileSet(BaseModel):
    """The profile file: layer profiles of several models and the fitted communication model."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field(description="What was measured, e.g. 'cpu: 1 thread per actor (host)'.")
    models: dict[str, ModelLayerProfile] = Field(default_factory=dict, description="Model name -> layer profile.")
    comm: CommModel | None = Field(default=None, description="Fitted send and collective costs.")
    updated: str = Field(default="", description="UTC time of the last run merged in.")

    def merge(self, other: "LayerProfileSet") -> "LayerProfileSet":
        models = dict(self.models)
        for name, profile in other.models.items():
            models[name] = models[name].merge(profile) if name in models else profile
        comm = other.comm if self.comm is None else (self.comm if other.comm is None else self.comm.merge(other.comm))
        return LayerProfileSet(device=other.device, models=models, comm=comm, updated=other.updated or self.updated)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "LayerProfileSet":
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"layer profile file {path} does not exist")
        return cls.model_validate_json(path.read_text())

    def save_merged(self, path: str | Path) -> "LayerProfileSet":
        """Merge into the file at `path` if there is one, write it, and return what was written."""
        path = Path(path)
        merged = LayerProfileSet.load(path).merge(self) if path.exists() else self
        merged.save(path)
        return merged


def device_description(num_threads: int = 1) -> str:
    return f"cpu ({platform.processor() or platform.machine()}): {num_threads} thread per actor"


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _block_shape(parts: BlockParts) -> BlockShape:
    return BlockShape(hidden_size=parts.attn_out.out_features, num_heads=parts.num_heads, head_dim=parts.head_dim,
                      intermediate_size=parts.fc1.out_features, has_bias=parts.qkv_bias is not None,
                      dtype_bytes=parts.qkv_weight.element_size())


def _linear_bytes(parts: BlockParts) -> int:
    tensors = [parts.qkv_weight, parts.qkv_bias, parts.attn_out.weight, parts.attn_out.bias, parts.fc1.weight,
               parts.fc1.bias, parts.fc2.weight, parts.fc2.bias]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _timed(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_layers(source: ModelSource, batch_sizes: Sequence[int], seq_lens_tokens: Sequence[int] = (),
                   warmup: int = DEFAULT_WARMUP, repeats: int = DEFAULT_REPEATS, num_threads: int = 1,
                   model=None) -> ModelLayerProfile:
    """Time every layer of `source`'s layer view for each batch size x sequence length (text) or batch size (vision)."""
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes must be a non-empty list of sizes >= 1, got {list(batch_sizes)}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        model = model if model is not None else load_model(source)
        layers = standalone_layers(model)
        vision = source.kind == "vision"
        if not vision and (not seq_lens_tokens or min(seq_lens_tokens) < 2):
            raise ValueError("seq_lens_tokens must be a non-empty list of lengths >= 2 for a text model, got "
                             f"{list(seq_lens_tokens)}")
        measurements = []
        for index, layer in enumerate(layers):
            measurement = LayerMeasurement(index=index, kind=layer.kind, weight_bytes=parameter_bytes(layer))
            if layer.kind == "block":
                parts = bert_block_parts(layer.block) if source.kind == "text" else vit_block_parts(layer.block)
                measurement.block_shape = _block_shape(parts)
                measurement.other_weight_bytes = max(0, measurement.weight_bytes - _linear_bytes(parts))
            measurements.append(measurement)
        tokens_per_sequence = None
        input_bytes: dict[str, int] = {}
        shapes = [(b, None) for b in batch_sizes] if vision else [(b, s) for b in batch_sizes for s in seq_lens_tokens]
        for number, (batch, seq) in enumerate(shapes, start=1):
            state = example_input(model, batch, seq)
            with torch.inference_mode():
                hidden_tokens = None
                key = None
                for index, layer in enumerate(layers):
                    current = state
                    seconds = _timed(lambda: layer(current), warmup, repeats)
                    state = layer(current)
                    if index == 0:
                        hidden_tokens = state.hidden.shape[1] if state.hidden.dim() == 3 else seq
                        tokens_per_sequence = hidden_tokens if vision else None
                        key = shape_key(batch, seq if not vision else hidden_tokens)
                        input_bytes[key] = state_bytes(current)
                    measurements[index].latency_s[key] = seconds
                    measurements[index].samples[key] = repeats
                    measurements[index].output_bytes[key] = state_bytes(state)
            logger.info("profiled %s shape %d/%d (batch %d, %s tokens): %.2f ms", source.name, number, len(shapes),
                        batch, hidden_tokens, 1e3 * sum(m.latency_s[key] for m in measurements))
        return ModelLayerProfile(name=source.name, source=source, tokens_per_sequence=tokens_per_sequence,
                                 input_bytes=input_bytes, layers=measurements)
    finally:
        torch.set_num_threads(previous_threads)


class CommProbe:
    """A Ray actor body that sends, receives and runs collectives for `profile_comm`."""

    def __init__(self, rank: int = 0, degree: int = 1):
        torch.set_num_threads(1)
        self.rank, self.degree = rank, degree

    def rendezvous_address(self) -> tuple[str, int]:
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_group(self, address: str, port: int) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=self.rank, world_size=self.degree)

    def produce(self, num_bytes: int) -> torch.Tensor:
        return torch.ones(max(1, num_bytes // FP32_BYTES))

    def consume(self, tensor: torch.Tensor) -> int:
        return int(tensor.numel())

    def time_collective(self, kind: str, num_bytes: int, warmup: int, repeats: int) -> float:
        import torch.distributed as dist

        tensor = torch.ones(max(self.degree, num_bytes // FP32_BYTES // self.degree * self.degree))
        if kind == "all_reduce":
            op = lambda: dist.all_reduce(tensor)  # noqa: E731
        elif kind == "all_gather":
            part = tensor[: tensor.numel() // self.degree].clone()
            parts = [torch.empty_like(part) for _ in range(self.degree)]
            op = lambda: dist.all_gather(parts, part)  # noqa: E731
        else:
            raise ValueError(f"unknown collective {kind!r}")
        dist.barrier()
        return _timed(op, warmup, repeats)


def profile_comm(degrees: Sequence[int] = (2,), sizes_bytes: Sequence[int] = DEFAULT_COMM_SIZES_BYTES,
                 repeats: int = DEFAULT_COMM_REPEATS, warmup: int = DEFAULT_WARMUP,
                 num_cpus_per_actor: float = COMM_PROBE_NUM_CPUS) -> CommModel:
    """Fit alpha-beta models of an actor-to-actor send and of gloo collectives over each degree (Ray must be up)."""
    import ray

    probe = ray.remote(CommProbe)
    group_degrees = sorted({d for d in degrees if d >= 2})
    # The first group's actors (or a pair) also do the sends, so each profile starts as few actors as possible.
    first = group_degrees[0] if group_degrees else 2
    actors = [probe.options(num_cpus=num_cpus_per_actor).remote(rank, first) for rank in range(first)]
    send_sizes, send_times = [], []
    try:
        for num_bytes in sizes_bytes:
            held = actors[0].produce.remote(num_bytes)
            ray.wait([held], fetch_local=False)

            def call() -> None:
                ray.get(actors[1].consume.remote(held))

            send_sizes.append(num_bytes)
            send_times.append(_timed(call, warmup, repeats))
        logger.info("send times %s", dict(zip(send_sizes, send_times)))
        model = CommModel(send=fit_alpha_beta(send_sizes, send_times))
        for degree in group_degrees:
            if degree != first:
                for actor in actors:
                    ray.kill(actor)
                actors = [probe.options(num_cpus=num_cpus_per_actor).remote(rank, degree) for rank in range(degree)]
            address, port = ray.get(actors[0].rendezvous_address.remote())
            ray.get([actor.init_group.remote(address, port) for actor in actors])
            for kind, fits in (("all_reduce", model.all_reduce), ("all_gather", model.all_gather)):
                times = [max(ray.get([a.time_collective.remote(kind, n, warmup, repeats) for a in actors]))
                         for n in sizes_bytes]
                fits[degree] = fit_alpha_beta(list(sizes_bytes), times)
                logger.info("%s over %d actors: %s", kind, degree, dict(zip(sizes_bytes, times)))
    finally:
        for actor in actors:
            ray.kill(actor)
    return model
