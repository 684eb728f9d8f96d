"""Profiler: per-layer latency, weight and activation bytes, and the cost of sends and collectives between actors.

AlpaServe §4.1 profiles only the K layers of a model (latency(i, k) of a stage is then the sum over its layers);
this module measures them on the device at hand, one thread as in a stage actor:

* `profile_layers`: forward latency of every layer of the layer view for each (batch size, sequence length),
  the bytes of every layer's weights and of the activation it hands to the next layer, and the shapes of its
  blocks (for the intra-op pass);
* `profile_comm`: the time to hand an activation from one pipeline stage to the next (one more hop over the
  stage transport, `profile_link_sends`) and of gloo all-reduce / all-gather among `degree` actors, for
  several sizes, fitted with the alpha-beta model (`parallel.comm_model`); and the runtime's
  per-hop overhead (`profile_hop_overhead`): an activation-sized payload relayed through chains of 1 and 2 actors
  with the group runtime's own call pattern, timed sequentially (wall per hop) and pipelined while the CPU time of
  every process of the Ray cluster is counted (host CPU per hop and per request), the cost of AlpaServe §3.3's
  inter-op communication overhead as this runtime pays it.

Results are a `LayerProfileSet` JSON file; `merge` combines repeated runs (latencies are averaged, weighted by
their sample counts; communication fits are replaced by the newer run's). Each block's latency sharded over several
actors is measured by `parallel.sharded_profile`.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from models.layers import ActivationState, parameter_bytes, run_layers
from parallel.comm_model import AlphaBeta, CommModel, HopOverhead, fit_alpha_beta
from parallel.host_cpu import read_host_cpu_s
from parallel.intra_op import BlockShape
from parallel.stage_layers import ModelSource, example_input, load_model, standalone_layers
from parallel.stage_transport import PipelineTransport, StageTransportEndpoint
from parallel.tensor_parallel import BlockParts, text_block_parts, vit_block_parts

logger = logging.getLogger(__name__)

DEFAULT_WARMUP = 2
DEFAULT_REPEATS = 5
#: Activation sizes (bytes) at which sends and collectives are timed.
DEFAULT_COMM_SIZES_BYTES = (4_096, 65_536, 524_288, 2_097_152)
DEFAULT_COMM_REPEATS = 10
COMM_PROBE_NUM_CPUS = 0.5
FP32_BYTES = 4
#: The activation relayed to price a hop: 64 tokens x 384 fp32 features (a MiniLM / ViT-S activation at batch 1).
DEFAULT_HOP_PAYLOAD_BYTES = 64 * 384 * FP32_BYTES
#: Requests in flight per timed pipelined run of the hop probe, and timed runs per chain length (median).
HOP_REQUESTS = 200
HOP_REPEATS = 3
#: Sequential requests timed (median) per chain length for the wall time of a hop.
HOP_SEQUENTIAL_REQUESTS = 60
#: Chain lengths of the hop probe: the slope between them is the cost of one more stage call.
HOP_CHAIN_LENGTHS = (1, 2)
#: Seconds the hop probe counts the CPU of the idle Ray cluster (its background rate).
BACKGROUND_SECONDS = 1.0
PROC_ROOT = Path("/proc")
#: The co-run probe: processes that run at once, seconds per phase, and phases (alone, together, alone, ...: a drift of
#: the shared machine's speed then hits both kinds of phase alike).
CO_RUN_PROCESSES = 2
CO_RUN_PHASE_SECONDS = 0.5
CO_RUN_PHASES = 6


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
    sharded_latency_s: dict[int, dict[str, float]] = Field(
        default_factory=dict,
        description="Blocks: intra-op degree -> '<batch>x<tokens>' -> forward seconds of the block Megatron-sharded "
                    "over that many actors, timed by running it there (`parallel.sharded_profile`).")
    sharded_samples: dict[int, dict[str, int]] = Field(
        default_factory=dict,
        description="Blocks: intra-op degree -> '<batch>x<tokens>' -> timed runs behind sharded_latency_s.")


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
    co_run_slowdown: float | None = Field(
        default=None, ge=1.0,
        description="How much slower a whole forward pass runs while another process runs it on the other core at the "
                    "same time (`measure_co_run_slowdown`); prices the CPU per request on a host whose cores the "
                    "stages share. None: not measured (1).")
    co_run_samples: int = Field(default=1, ge=0,
                                description="Co-run probes averaged into co_run_slowdown (ignored while it is None).")

    def shapes(self) -> list[tuple[int, int]]:
        keys = set(self.layers[0].latency_s)
        return sorted(tuple(int(part) for part in key.split("x")) for key in keys)  # type: ignore[misc]

    def merge(self, other: "ModelLayerProfile") -> "ModelLayerProfile":
        """Another run's profile of the same model merged in: every timed figure (whole layers, sharded blocks, the
        co-run slowdown) is the mean of both runs' weighted by the timed runs behind each; the rest is the newer
        run's."""
        if len(other.layers) != len(self.layers):
            raise ValueError(f"model {self.name!r}: {len(other.layers)} layers in the new profile, {len(self.layers)} "
                             "before")
        layers = []
        for mine, theirs in zip(self.layers, other.layers):
            latency, samples = _sample_weighted(mine.latency_s, mine.samples, theirs.latency_s, theirs.samples)
            sharded, sharded_samples = {}, {}
            for degree in sorted({*mine.sharded_latency_s, *theirs.sharded_latency_s}):
                sharded[degree], sharded_samples[degree] = _sample_weighted(
                    mine.sharded_latency_s.get(degree, {}), mine.sharded_samples.get(degree, {}),
                    theirs.sharded_latency_s.get(degree, {}), theirs.sharded_samples.get(degree, {}))
            layers.append(theirs.model_copy(update={"latency_s": latency, "samples": samples,
                                                    "output_bytes": {**mine.output_bytes, **theirs.output_bytes},
                                                    "sharded_latency_s": sharded, "sharded_samples": sharded_samples}))
        co_run = [(p.co_run_slowdown, p.co_run_samples) for p in (self, other)
                  if p.co_run_slowdown is not None and p.co_run_samples > 0]
        co_run_samples = sum(n for _, n in co_run)
        return other.model_copy(update={
            "layers": layers, "input_bytes": {**self.input_bytes, **other.input_bytes},
            "co_run_slowdown": sum(x * n for x, n in co_run) / co_run_samples if co_run else None,
            "co_run_samples": co_run_samples})


def _sample_weighted(mine: dict[str, float], mine_samples: dict[str, int], theirs: dict[str, float],
                     theirs_samples: dict[str, int]) -> tuple[dict[str, float], dict[str, int]]:
    """Per shape key: both runs' seconds averaged, each weighted by its timed runs (a figure stored without a count
    counts once); the counts added."""
    seconds, samples = dict(mine), {key: mine_samples.get(key, 1) for key in mine}
    for key, value in theirs.items():
        old_n, new_n = samples.get(key, 0), theirs_samples.get(key, 1)
        seconds[key] = (seconds.get(key, 0.0) * old_n + value * new_n) / (old_n + new_n)
        samples[key] = old_n + new_n
    return seconds, samples


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


def synchronize(device: torch.device | str | None) -> None:
    """Wait until `device` ran every kernel queued on it: CUDA runs kernels asynchronously, so a clock read right
    after a launch would time the launch, not the work. Nothing to wait for on the CPU (or the meta device)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], warmup: int, repeats: int, device: torch.device | str | None = None) -> float:
    """Median wall seconds of `fn`, the device synchronized before the clock starts and before it stops."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_layer_times(layers: Sequence, inputs: Sequence[ActivationState], warmup: int,
                             repeats: int, device: torch.device | str | None = None) -> list[float]:
    """Median seconds of each layer on its input, timed in `repeats` passes over the whole model (layer after
    layer, as a forward pass runs) rather than all repeats of one layer before the next: a slow spell of a shared
    machine then lands on every layer alike instead of on a few, and the DP's stage cuts do not follow the noise.
    On CUDA the device is synchronized around every timed layer (`synchronize`)."""
    for _ in range(warmup):
        for layer, state in zip(layers, inputs):
            layer(state)
    times: list[list[float]] = [[] for _ in layers]
    for _ in range(repeats):
        for index, (layer, state) in enumerate(zip(layers, inputs)):
            synchronize(device)
            start = time.perf_counter()
            layer(state)
            synchronize(device)
            times[index].append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def profile_layers(source: ModelSource, batch_sizes: Sequence[int], seq_lens_tokens: Sequence[int] = (),
                   warmup: int = DEFAULT_WARMUP, repeats: int = DEFAULT_REPEATS, num_threads: int = 1,
                   model=None, device: torch.device | str = "cpu") -> ModelLayerProfile:
    """Time every layer of `source`'s layer view for each batch size x sequence length (text) or batch size (vision),
    on `device` (its layers and inputs moved there; CUDA synchronized around every timed layer)."""
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes must be a non-empty list of sizes >= 1, got {list(batch_sizes)}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        device = torch.device(device)
        model = model if model is not None else load_model(source)
        layers = [layer.to(device) for layer in standalone_layers(model)]
        vision = source.kind == "vision"
        if not vision and (not seq_lens_tokens or min(seq_lens_tokens) < 2):
            raise ValueError("seq_lens_tokens must be a non-empty list of lengths >= 2 for a text model, got "
                             f"{list(seq_lens_tokens)}")
        measurements = []
        for index, layer in enumerate(layers):
            measurement = LayerMeasurement(index=index, kind=layer.kind, weight_bytes=parameter_bytes(layer))
            if layer.kind == "block":
                parts = text_block_parts(layer.block) if source.kind == "text" else vit_block_parts(layer.block)
                measurement.block_shape = _block_shape(parts)
                measurement.other_weight_bytes = max(0, measurement.weight_bytes - _linear_bytes(parts))
            measurements.append(measurement)
        tokens_per_sequence = None
        input_bytes: dict[str, int] = {}
        shapes = [(b, None) for b in batch_sizes] if vision else [(b, s) for b in batch_sizes for s in seq_lens_tokens]
        for number, (batch, seq) in enumerate(shapes, start=1):
            with torch.inference_mode():
                inputs = [example_input(model, batch, seq).to(device)]
                for layer in layers:
                    inputs.append(layer(inputs[-1]))
                hidden_tokens = inputs[1].hidden.shape[1] if inputs[1].hidden.dim() == 3 else seq
                tokens_per_sequence = hidden_tokens if vision else None
                key = shape_key(batch, seq if not vision else hidden_tokens)
                input_bytes[key] = state_bytes(inputs[0])
                seconds = interleaved_layer_times(layers, inputs, warmup, repeats, device)
            for index, measurement in enumerate(measurements):
                measurement.latency_s[key] = seconds[index]
                measurement.samples[key] = repeats
                measurement.output_bytes[key] = state_bytes(inputs[index + 1])
            logger.info("profiled %s shape %d/%d (batch %d, %s tokens): %.2f ms", source.name, number, len(shapes),
                        batch, hidden_tokens, 1e3 * sum(m.latency_s[key] for m in measurements))
        return ModelLayerProfile(name=source.name, source=source, tokens_per_sequence=tokens_per_sequence,
                                 input_bytes=input_bytes, layers=measurements)
    finally:
        torch.set_num_threads(previous_threads)


def _co_run_worker(source_json: str, batch_size: int, seq_len_tokens: int | None, rank: int, phase_seconds: float,
                   phases: int, barrier, results) -> None:
    """One co-runner: load the model, then in each phase wait for the others and run whole forward passes for
    `phase_seconds` (1 thread); in the even ('alone') phases only rank 0 runs and the others wait."""
    torch.set_num_threads(1)
    model = load_model(ModelSource.model_validate_json(source_json))
    state = example_input(model, batch_size, seq_len_tokens)
    layers = model.layers()
    with torch.inference_mode():
        run_layers(layers, state)  # warm-up
        for phase in range(phases):
            barrier.wait()
            if phase % 2 == 0 and rank != 0:
                continue
            passes, start, cpu_start = 0, time.perf_counter(), time.process_time()
            while time.perf_counter() - start < phase_seconds:
                run_layers(layers, state)
                passes += 1
            results.put((phase, (time.perf_counter() - start) / passes, (time.process_time() - cpu_start) / passes))


def measure_co_run_slowdown(source: ModelSource, batch_size: int, seq_len_tokens: int | None = None,
                            phase_seconds: float = CO_RUN_PHASE_SECONDS, phases: int = CO_RUN_PHASES,
                            processes: int = CO_RUN_PROCESSES) -> float:
    """CPU seconds per forward pass with `processes` processes running the model at once over the same with one
    alone (>= 1): what compute costs when every core of a shared host is busy (memory bandwidth and caches are
    shared, which a per-layer profile, timed alone, does not see). CPU seconds, not wall: a process of another
    tenant that takes a core meanwhile stretches the wall time of the passes it preempts, not their CPU time, so
    the figure prices the co-runners' own interference only (the wall-time ratio is logged beside it). The same
    processes alternate phases alone and together and the median of the paired ratios is kept. The cost model
    multiplies a request's compute CPU by it where the devices are CPU shares of one host
    (`placement.core.profiles.ConfigProfile.cpu_per_batch_s`)."""
    import multiprocessing

    if processes < 2:
        raise ValueError(f"processes must be >= 2 to measure co-running, got {processes}")
    if phases < 2 or phases % 2:
        raise ValueError(f"phases must be an even number >= 2 (alone, together, ...), got {phases}")
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=_co_run_worker, args=(source.model_dump_json(), batch_size, seq_len_tokens, rank,
                                                             phase_seconds, phases, barrier, results))
               for rank in range(processes)]
    for worker in workers:
        worker.start()
    per_pass: dict[int, list[float]] = {}
    cpu_per_pass: dict[int, list[float]] = {}
    for _ in range(phases // 2 * (1 + processes)):
        phase, seconds, cpu_seconds = results.get()
        per_pass.setdefault(phase, []).append(seconds)
        cpu_per_pass.setdefault(phase, []).append(cpu_seconds)
    for worker in workers:
        worker.join()

    def median_ratio(figures: dict[int, list[float]]) -> float:
        return statistics.median(statistics.mean(figures[phase + 1]) / figures[phase][0]
                                 for phase in range(0, phases, 2))

    slowdown = max(1.0, median_ratio(cpu_per_pass))
    logger.info("%s: %.2f ms CPU per pass alone, %.2f ms with %d co-running (median phases): slowdown %.2f "
                "(wall time: %.2f)", source.name,
                1e3 * statistics.median(cpu_per_pass[p][0] for p in range(0, phases, 2)),
                1e3 * statistics.median(statistics.mean(cpu_per_pass[p]) for p in range(1, phases, 2)), processes,
                slowdown, median_ratio(per_pass))
    return slowdown


class CommProbe(StageTransportEndpoint):
    """A Ray actor body that relays activations over the stage transport and runs collectives for `profile_comm`."""

    def __init__(self, rank: int = 0, degree: int = 1):
        torch.set_num_threads(1)
        self.rank, self.degree = rank, degree

    def init_group(self, address: str, port: int) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=self.rank, world_size=self.degree)

    def forward(self, state: ActivationState) -> ActivationState:
        """Relay a stage's input unchanged (the hop probe's zero-compute stage)."""
        return state

    def process_ids(self) -> tuple[int, int]:
        """This worker's pid and its parent's (the raylet), whose CPU the hop probe counts."""
        return os.getpid(), os.getppid()

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


def _clock_ticks_per_s() -> int:
    return os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process from /proc; None when it is gone or unreadable."""
    try:
        fields = (PROC_ROOT / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command name: state, ppid, ..., utime (11th), stime (12th), counted from 0 (proc(5)).
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _clock_ticks_per_s()


def process_tree(root_pid: int) -> set[int]:
    """`root_pid` and all its live descendants (a local Ray's GCS, raylet and workers descend from the driver)."""
    children: dict[int, list[int]] = {}
    for entry in PROC_ROOT.iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry.name))
    found, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds a live process has used so far (/proc); None when it is gone or unreadable."""
    stat = _proc_stat(pid)
    return stat[1] if stat is not None else None


def processes_cpu_s(pids: set[int]) -> float:
    """CPU seconds the live processes `pids` have used so far."""
    return sum(seconds for seconds in map(process_cpu_s, pids) if seconds is not None)


def interleaved_relay_latency_s(chains: dict[int, PipelineTransport], state: ActivationState, warmup: int,
                           requests: int) -> dict[int, float]:
    """Median wall seconds of one request relayed through each chain, requests one after another, the chains taking
    turns request by request: a drift of the shared machine's speed lands on every chain alike, and their difference
    (one more hop) does not follow it."""
    for links in chains.values():
        for _ in range(warmup):
            links.submit(state).result()
    times: dict[int, list[float]] = {length: [] for length in chains}
    for _ in range(requests):
        for length, links in chains.items():
            start = time.perf_counter()
            links.submit(state).result()
            times[length].append(time.perf_counter() - start)
    return {length: statistics.median(samples) for length, samples in times.items()}


def _relay_state(payload_bytes: int) -> ActivationState:
    return ActivationState(hidden=torch.ones(max(1, payload_bytes // FP32_BYTES)))


def profile_link_sends(actors: Sequence, sizes_bytes: Sequence[int] = DEFAULT_COMM_SIZES_BYTES,
                       warmup: int = DEFAULT_WARMUP, requests: int = HOP_SEQUENTIAL_REQUESTS) -> AlphaBeta:
    """Alpha-beta fit of handing an activation to the next pipeline stage as the runtime does, over the stage transport
    (`parallel.stage_transport`): for each size, the slope of the sequential relay latency between chains of 1 and 2
    `CommProbe` actors is one more hop (a frame out of one actor, into the next, and its relay loop)."""
    short, long = HOP_CHAIN_LENGTHS
    if len(actors) < long:
        raise ValueError(f"profile_link_sends needs {long} actors, got {len(actors)}")
    chains = {length: PipelineTransport([[actor] for actor in actors[:length]]) for length in HOP_CHAIN_LENGTHS}
    sizes, hops = [], []
    try:
        for num_bytes in sizes_bytes:
            state = _relay_state(num_bytes)
            latency = interleaved_relay_latency_s(chains, state, warmup, requests)
            sizes.append(state_bytes(state))
            hops.append(max(0.0, (latency[long] - latency[short]) / (long - short)))
    finally:
        for links in chains.values():
            links.close()
    logger.info("link sends: one more hop %s", dict(zip(sizes, hops)))
    return fit_alpha_beta(sizes, hops)


def profile_hop_overhead(actors: Sequence, payload_bytes: int = DEFAULT_HOP_PAYLOAD_BYTES,
                         requests: int = HOP_REQUESTS, repeats: int = HOP_REPEATS,
                         warmup: int = DEFAULT_WARMUP) -> HopOverhead:
    """Per-hop overhead of the runtime (AlpaServe §3.3's communication overhead of inter-op parallelism, as a
    pipeline stage of this runtime really costs it): relay an ActivationState of `payload_bytes` through chains of 1
    and 2 `CommProbe` actors over the group runtime's stage transport (`parallel.stage_transport.PipelineTransport`).
    Wall per hop and per request: slope and intercept of sequential request latency over the chain length. CPU per
    hop and per request: slope and intercept of the CPU time all processes of the Ray cluster (driver tree, the
    actors and their raylet) spend per request while `requests` are in flight, less what they spend anyway: their
    background rate, counted over `BACKGROUND_SECONDS` with nothing in flight (Ray's raylet, GCS and agents poll and
    report whatever the load, which a fast probe would amortise over thousands of requests per second and a model
    serving tens would not). The CPU other processes of the host spend meanwhile is reported beside it
    (`HopOverhead.foreign_cpu_cores`). Off Linux (no /proc) the wall times stand in for CPU and the background is 0."""
    import ray

    if len(actors) < max(HOP_CHAIN_LENGTHS):
        raise ValueError(f"profile_hop_overhead needs {max(HOP_CHAIN_LENGTHS)} actors, got {len(actors)}")
    state = _relay_state(payload_bytes)
    actor_pids = ray.get([actor.process_ids.remote() for actor in actors])
    pids = (process_tree(os.getpid()) | {pid for pair in actor_pids for pid in pair}) if PROC_ROOT.is_dir() else None
    meter = ForeignLoadMeter(extra_pids=pids)
    meter.start()
    background = background_cpu_cores(pids) if pids is not None else 0.0
    chains = {length: PipelineTransport([[actor] for actor in actors[:length]]) for length in HOP_CHAIN_LENGTHS}
    cpu_s = {}
    try:
        latency_s = interleaved_relay_latency_s(chains, state, warmup, HOP_SEQUENTIAL_REQUESTS)
        for length, links in chains.items():
            if pids is None:
                cpu_s[length] = latency_s[length]
                continue
            samples = []
            for _ in range(repeats):
                before, started = processes_cpu_s(pids), time.perf_counter()
                for pending in [links.submit(state) for _ in range(requests)]:
                    pending.result()
                spent = processes_cpu_s(pids) - before - background * (time.perf_counter() - started)
                samples.append(max(0.0, spent) / requests)
            cpu_s[length] = statistics.median(samples)
    finally:
        for links in chains.values():
            links.close()
    short, long = HOP_CHAIN_LENGTHS
    hop_latency = max(0.0, (latency_s[long] - latency_s[short]) / (long - short))
    hop_cpu = max(0.0, (cpu_s[long] - cpu_s[short]) / (long - short))
    hop = HopOverhead(payload_bytes=state_bytes(state), latency_s=hop_latency, cpu_s=hop_cpu,
                      request_cpu_s=max(0.0, cpu_s[short] - short * hop_cpu),
                      request_latency_s=max(0.0, latency_s[short] - short * hop_latency), host_cores=host_cores(),
                      background_cpu_cores=background, foreign_cpu_cores=meter.stop() or 0.0)
    logger.info("hop overhead: sequential latency %s s, CPU per request %s s -> %s", latency_s, cpu_s, hop)
    return hop


def host_busy_cpu_s() -> float | None:
    """CPU seconds the whole host has been busy so far, every core and every process, the hypervisor's steal
    included (/proc/stat: all but idle and iowait, `parallel.host_cpu`); None off Linux."""
    cpu = read_host_cpu_s(PROC_ROOT / "stat", ticks_per_s=_clock_ticks_per_s())
    return None if cpu is None else cpu.busy_s


class ForeignLoadMeter:
    """The CPU load on this host that is not ours, over a span: the host's busy cores (steal included) less those of
    the process tree under `root_pid` (a local Ray's GCS, raylet and actors descend from its driver) and `extra_pids`.
    Another tenant's processes on the cores the stages share slow them without showing in any profile; the cost
    model's throughput on CPU shares is priced on the cores left to them."""

    def __init__(self, root_pid: int | None = None, extra_pids: set[int] | None = None):
        self.root_pid = os.getpid() if root_pid is None else root_pid
        self.extra_pids = set(extra_pids or ())
        self._start: tuple[float, float | None, dict[int, float]] | None = None

    def _own_cpu_s(self) -> dict[int, float]:
        pids = process_tree(self.root_pid) | self.extra_pids
        return {pid: seconds for pid in pids if (seconds := process_cpu_s(pid)) is not None}

    def start(self) -> None:
        self._start = (time.perf_counter(), host_busy_cpu_s(), self._own_cpu_s())

    def stop(self) -> float | None:
        """Foreign cores (CPU seconds per second) since `start`; None off Linux."""
        if self._start is None:
            raise RuntimeError("ForeignLoadMeter.stop before start")
        started, host_before, own_before = self._start
        host_after = host_busy_cpu_s()
        if host_before is None or host_after is None:
            return None
        own_after = self._own_cpu_s()
        # A process of ours that started meanwhile spent all its CPU in the span; one that ended took its count
        # along (at most what it spent since it was last read, a sliver against the span).
        own = sum(seconds - own_before.get(pid, 0.0) for pid, seconds in own_after.items())
        elapsed = time.perf_counter() - started
        return max(0.0, (host_after - host_before) - max(0.0, own)) / elapsed


def background_cpu_cores(pids: set[int], seconds: float = BACKGROUND_SECONDS) -> float:
    """Cores the processes `pids` keep busy over `seconds` with no work given to them (CPU seconds per second)."""
    before, started = processes_cpu_s(pids), time.perf_counter()
    time.sleep(seconds)
    return max(0.0, processes_cpu_s(pids) - before) / (time.perf_counter() - started)


def host_cores() -> int:
    """CPU cores this process may run on (its affinity), the cores stage actors on this host share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def profile_comm(degrees: Sequence[int] = (2,), sizes_bytes: Sequence[int] = DEFAULT_COMM_SIZES_BYTES,
                 repeats: int = DEFAULT_COMM_REPEATS, warmup: int = DEFAULT_WARMUP,
                 num_cpus_per_actor: float = COMM_PROBE_NUM_CPUS,
                 hop_payload_bytes: int = DEFAULT_HOP_PAYLOAD_BYTES) -> CommModel:
    """Fit alpha-beta models of a send between pipeline stages over the stage transport (`profile_link_sends`) and
    of gloo collectives over each degree, and measure the per-hop overhead (`profile_hop_overhead`) with an
    activation of `hop_payload_bytes` (Ray must be up)."""
    import ray

    probe = ray.remote(CommProbe)
    group_degrees = sorted({d for d in degrees if d >= 2})
    # The first group's actors (or a pair) also relay the sends, so each profile starts as few actors as possible.
    first = group_degrees[0] if group_degrees else 2
    actors = [probe.options(num_cpus=num_cpus_per_actor).remote(rank, first) for rank in range(first)]
    try:
        model = CommModel(send=profile_link_sends(actors[:max(HOP_CHAIN_LENGTHS)], sizes_bytes, warmup),
                          hop=profile_hop_overhead(actors[:max(HOP_CHAIN_LENGTHS)], hop_payload_bytes,
                                                   warmup=warmup))
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
