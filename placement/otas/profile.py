"""The OTAS profile: accuracy per (task, gamma) and batch latency per (gamma, batch size), measured.

OTAS §III-A ("the task profiler calculates the accuracies and inference latencies for different token numbers and
batch sizes on the target device") and §III-D (last paragraph: execution time and utility of a batch are estimated
from the profile). `models/adaptive_vit_profile.py` measures it on the machine at hand and writes this JSON; the
policies in `placement/otas_*.py` read it. Pure pydantic: no torch here.

Batch latency is interpolated linearly between the measured batch sizes (the paper multiplies per-sample latencies
instead; measuring whole batches keeps the batching gain of Fig. 7), and extrapolated per sample beyond the largest.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from placement.core.latency_table import LatencyTable, table_latency_s


class OtasProfile(BaseModel):
    """Measured accuracy and latency of one adaptive ViT with its registered tasks on one device."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(description="What was profiled (artefact directory, data split).")
    device: str = Field(description="The device the latencies were measured on.")
    gamma_list: list[int] = Field(min_length=1,
                                  description="The configured gammas (tokens per layer: <0 merge, >0 prompts).")
    batch_sizes: list[int] = Field(min_length=1, description="Measured batch sizes, ascending.")
    latency_s: dict[int, LatencyTable] = Field(description="gamma -> batch size -> forward latency of one batch, in "
                                                           "seconds.")
    accuracy: dict[str, dict[int, float]] = Field(description="task id -> gamma -> held-out accuracy in [0, 1].")
    model_load_s: float | None = Field(default=None, ge=0,
                                       description="Measured time to load the model weights from disk, in seconds.")

    @model_validator(mode="after")
    def _complete(self) -> "OtasProfile":
        self.gamma_list = sorted(self.gamma_list)
        self.batch_sizes = sorted(self.batch_sizes)
        for gamma in self.gamma_list:
            if gamma not in self.latency_s:
                raise ValueError(f"latency_s has no entry for gamma {gamma}")
            missing = [b for b in self.batch_sizes if b not in self.latency_s[gamma]]
            if missing:
                raise ValueError(f"latency_s[{gamma}] misses batch sizes {missing}")
        for task, by_gamma in self.accuracy.items():
            missing = [g for g in self.gamma_list if g not in by_gamma]
            if missing:
                raise ValueError(f"accuracy[{task!r}] misses gammas {missing}")
        return self

    def batch_latency_s(self, gamma: int, batch_size: int) -> float:
        """Estimated latency of one batch of `batch_size` at `gamma` (linear between measured batch sizes)."""
        if gamma not in self.latency_s:
            raise ValueError(f"gamma {gamma} is not profiled; profiled gammas: {self.gamma_list}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return table_latency_s(self.latency_s[gamma], batch_size, beyond="per_sample")

    def task_accuracy(self, task_id: str, gamma: int) -> float:
        if task_id not in self.accuracy:
            raise ValueError(f"task {task_id!r} is not profiled; profiled tasks: {sorted(self.accuracy)}")
        return self.accuracy[task_id][gamma]

    def throughput_rps(self, gamma: int, batch_size: int) -> float:
        return batch_size / self.batch_latency_s(gamma, batch_size)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "OtasProfile":
        return cls.model_validate(json.loads(Path(path).read_text()))
