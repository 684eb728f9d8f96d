"""One Ray actor per (pipeline stage, tensor-parallel shard): it loads only its layers and runs them.

The actor builds the model named by a `ModelSource` without weights, reads from the checkpoint only the tensors of
its stage's layers (`parallel.stage_layers.load_stage_layers`), keeps of each block only its shard's slices, and
runs `forward` on its requests in arrival order (over the stage transport, `parallel.stage_transport`);
`memory_report` gives its resident memory around the load. With a GPU in its bundle (and the cluster's device
resource 'GPU') its layers and every input live on CUDA. The shards of one stage form a `torch.distributed` process
group (gloo on CPU, nccl on GPU) for the collectives of the tensor-parallel blocks; every shard of a stage receives
the same input and computes the same output, and only shard 0 sends it on.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import time
from collections import deque

import ray
import torch

from models.device import GPU_RESOURCE, select_device
from models.layers import ActivationState, run_layers
from parallel.plan import StagePlan
from parallel.stage_layers import ModelSource, import_loader, load_stage_layers
from parallel.stage_transport import StageTransportEndpoint
from parallel.tensor_parallel import Collectives, NoCollectives, ProcessGroupCollectives

logger = logging.getLogger(__name__)

#: Forward calls whose timing an actor keeps (for pipelining checks and benchmarks).
CALL_LOG_LENGTH = 1024
#: How long a collective may wait for a peer shard before gloo gives up (a dead peer surfaces as an error).
COLLECTIVE_TIMEOUT_S = 60
KIB = 1024


def _proc_status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status ('VmRSS', 'VmHWM') in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * KIB
    except OSError:
        return None
    return None


def resident_bytes() -> int | None:
    """This process's resident memory (RSS)."""
    return _proc_status_bytes("VmRSS")


def peak_resident_bytes() -> int | None:
    """This process's peak resident memory so far (high-water mark)."""
    return _proc_status_bytes("VmHWM")


class StageShard(StageTransportEndpoint):
    """The body of a stage actor (a plain class so it can be wrapped by `ray.remote` with any options). Requests
    reach `forward` over the group's stage transport (`parallel.stage_transport`) or as a Ray call."""

    def __init__(self, source: ModelSource, stage: StagePlan, stage_index: int, rank: int, degree: int,
                 num_threads: int = 1, device_resource: str = GPU_RESOURCE):
        torch.set_num_threads(num_threads)
        self.source = source
        self.stage = stage
        self.stage_index = stage_index
        self.rank = rank
        self.degree = degree
        self.layers = None
        self.weight_bytes = 0
        self.memory: dict[str, int | None] = {}
        #: CUDA when the actor reserved a GPU and torch sees one (`models.device.select_device`).
        self.device = select_device(device_resource)
        #: (start, end) wall-clock seconds of every forward call, for checking that stages overlap.
        #: (start, end) wall times of the latest forward calls; bounded so a long-running server does not grow.
        self.calls: deque[tuple[float, float]] = deque(maxlen=CALL_LOG_LENGTH)

    def transport_label(self) -> str:
        return f"stage {self.stage_index} shard {self.rank} of {self.source.name!r}"

    def setup(self, master_address: str | None = None, master_port: int | None = None) -> int:
        """Join the stage's process group, load this shard's weights; returns the weight bytes it holds."""
        collectives: Collectives = NoCollectives()
        if self.degree > 1:
            import torch.distributed as dist

            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if self.device.type == "cuda":
                torch.cuda.set_device(0)  # Ray exposes only this actor's GPU
            dist.init_process_group(backend, init_method=f"tcp://{master_address}:{master_port}", rank=self.rank,
                                    world_size=self.degree, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            collectives = ProcessGroupCollectives()
        import_loader(self.source)  # the library's code is not the stage's memory
        # Only an actor's first load collects garbage, to measure its memory on a settled heap. A full collection
        # walks the half a million objects of torch and transformers (about 0.2 s of CPU, taken from the models that
        # serve beside a reload), and a stage's layers hold no reference cycles: dropping them frees them.
        first_load = not self.memory
        if first_load:
            gc.collect()
        before = resident_bytes()
        skeleton: list[int | None] = []
        stage = load_stage_layers(self.source, self.stage.start_layer, self.stage.end_layer, collectives,
                                  self.stage.block_plans(), on_skeleton=lambda: skeleton.append(resident_bytes()))
        if first_load:
            gc.collect()
        self.layers = [layer.to(self.device) for layer in stage.layers]
        self.weight_bytes = stage.weight_bytes
        self.memory = {"weight_bytes": self.weight_bytes, "rss_before_load_bytes": before,
                       "rss_after_skeleton_bytes": skeleton[0] if skeleton else None,
                       "rss_after_load_bytes": resident_bytes(), "peak_rss_after_load_bytes": peak_resident_bytes()}
        logger.info("stage %d shard %d/%d holds layers [%d, %d): %d weight bytes (pid %d)", self.stage_index, self.rank,
                    self.degree, self.stage.start_layer, self.stage.end_layer, self.weight_bytes, os.getpid())
        return self.weight_bytes

    def reload(self, source: ModelSource, stage: StagePlan, stage_index: int) -> int:
        """Free this actor's layers and load another model's stage in the same process (its imports, its Ray
        worker and its device bundle stay): a group that swaps one model for another reuses the dropped model's
        actors instead of starting processes, the seconds-long part of a load. Unsharded stages only: a shard's
        process group is bound to its peers. Returns the weight bytes it holds."""
        if self.degree != 1:
            raise ValueError(f"stage {self.stage_index} shard {self.rank}: a tensor-parallel shard (degree "
                             f"{self.degree}) cannot be reloaded with another model")
        self.layers = None  # freed here (no reference cycles; see `setup`)
        self.weight_bytes = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.source, self.stage, self.stage_index = source, stage, stage_index
        self.calls.clear()
        return self.setup()

    def forward(self, state: ActivationState) -> ActivationState | None:
        """Run this stage on one batch, on this actor's device; shards other than 0 return None (their output
        equals shard 0's). The output stays on the device: the stage transport moves it where its next hop wants it
        (device to device between GPUs)."""
        if self.layers is None:
            raise RuntimeError(f"stage {self.stage_index} shard {self.rank} was not set up")
        started = time.time()
        with torch.inference_mode():
            out = run_layers(self.layers, state.to(self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the call log holds when the kernels ended, not when they started
        self.calls.append((started, time.time()))
        if self.rank != 0:
            return None
        return out

    def placement_info(self) -> dict[str, str | None]:
        """Where this shard computes: its torch device and its stage's collective backend (None unsharded)."""
        import torch.distributed as dist

        backend = dist.get_backend() if self.degree > 1 and dist.is_initialized() else None
        return {"device": str(self.device), "collective_backend": backend}

    def memory_report(self) -> dict[str, int | None]:
        """Resident memory of this actor in bytes (None where /proc is missing): before loading its layers (the
        loader's modules already imported), after building the weightless model (None for models loaded whole),
        after reading its tensors, the peak right after loading and so far, now, and the weight bytes it holds."""
        return {**self.memory, "rss_now_bytes": resident_bytes(), "peak_rss_bytes": peak_resident_bytes()}

    def ping(self) -> int:
        return os.getpid()

    def call_log(self) -> list[tuple[float, float]]:
        """(start, end) wall-clock seconds of each forward call so far, in order."""
        return list(self.calls)

    def placement_group_id(self) -> str | None:
        """The placement group this actor was scheduled in, if any (hex id)."""
        group_id = ray.get_runtime_context().get_placement_group_id()
        return group_id if group_id else None


#: The Ray actor class; options (resources, placement-group bundle) are given at creation.
StageActor = ray.remote(StageShard)
