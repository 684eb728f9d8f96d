"""The OTAS task profiler: accuracy per (task, gamma) on held-out data, latency per (gamma, batch size) measured here.

OTAS §III-A ("the task profiler calculates the accuracies and inference latencies for different token numbers and
batch sizes on the target device; the profiling data is stored in the metadata storage") and §III-D (the policies
estimate a batch's time and utility from it). The result is a `placement.otas.profile.OtasProfile` JSON.

    python -m models.adaptive_vit_profile [--artifacts models/artifacts/digits_vit] [--out profile.json] [--quick]

Latencies are medians over repeats, with gammas and batch sizes interleaved in every repeat so that a noisy,
shared machine disturbs them alike. Batches mix the registered tasks, as served batches do.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from models.adaptive_vit import load_backbone
from models.task_registry import BACKBONE_FILE, DIGITS_ARTIFACTS_DIR, TaskRegistry
from models.train_adaptive_vit import DIGITS_TASKS_BY_ID, DigitsSplit, load_digits_splits
from placement.otas.profile import OtasProfile

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64]
QUICK_BATCH_SIZES = [1, 8, 32]
DEFAULT_REPEATS = 5
QUICK_REPEATS = 2
WARMUP_CALLS = 2
PROFILE_FILE = "profile.json"


def profile_accuracy(registry: TaskRegistry, held_out: DigitsSplit, gammas: list[int]) -> dict[str, dict[int, float]]:
    """Held-out accuracy of every registered digits task at every gamma it supports."""
    accuracy: dict[str, dict[int, float]] = {}
    for task_id in registry.task_ids:
        if task_id not in DIGITS_TASKS_BY_ID:
            raise ValueError(f"task {task_id!r} has no held-out data in the digits profiler")
        images, labels = held_out.task_data(DIGITS_TASKS_BY_ID[task_id])
        accuracy[task_id] = {}
        for gamma in registry.supported_gammas([task_id]):
            if gamma not in gammas:
                continue
            predictions = torch.tensor(registry.predict(images, [task_id] * len(labels), gamma))
            accuracy[task_id][gamma] = round(float((predictions == labels).float().mean()), 4)
        logger.info("accuracy of %s by gamma: %s", task_id, accuracy[task_id])
    return accuracy


def profile_latency(registry: TaskRegistry, images: torch.Tensor, gammas: list[int], batch_sizes: list[int],
                    repeats: int) -> dict[int, dict[int, float]]:
    """Median seconds of one mixed-task `registry.logits` call per (gamma, batch size)."""
    samples: dict[tuple[int, int], list[float]] = {(g, b): [] for g in gammas for b in batch_sizes}
    tasks = registry.task_ids
    for repeat in range(repeats + WARMUP_CALLS):
        for batch_size in batch_sizes:
            batch = images[torch.arange(batch_size) % len(images)]
            task_ids = [tasks[i % len(tasks)] for i in range(batch_size)]
            for gamma in gammas:
                started = time.perf_counter()
                registry.logits(batch, task_ids, gamma)
                if repeat >= WARMUP_CALLS:
                    samples[(gamma, batch_size)].append(time.perf_counter() - started)
        logger.info("latency repeat %d/%d done", repeat + 1, repeats + WARMUP_CALLS)
    return {g: {b: statistics.median(samples[(g, b)]) for b in batch_sizes} for g in gammas}


def measure_load_s(artifacts: Path, registry: TaskRegistry, repeats: int = 3) -> float:
    """Seconds to load the backbone weights from disk into a fresh model (the model-switching delay of INFaaS)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        load_backbone(artifacts / BACKBONE_FILE, registry.config)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def device_description() -> str:
    return f"CPU {platform.machine()} ({os.cpu_count()} cores, torch threads {torch.get_num_threads()})"


def build_profile(artifacts: Path, batch_sizes: list[int], repeats: int,
                  held_out_subset: int | None = None) -> OtasProfile:
    registry = TaskRegistry.load(artifacts)
    _, held_out = load_digits_splits()
    if held_out_subset:
        held_out = held_out.subset(held_out_subset)
    gammas = registry.gamma_list
    accuracy = profile_accuracy(registry, held_out, gammas)
    latency = profile_latency(registry, held_out.images, gammas, batch_sizes, repeats)
    return OtasProfile(source=f"{artifacts} on {len(held_out.digits)} held-out digits", device=device_description(),
                       gamma_list=gammas, batch_sizes=batch_sizes, latency_s=latency, accuracy=accuracy,
                       model_load_s=measure_load_s(artifacts, registry))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifacts", type=Path, default=DIGITS_ARTIFACTS_DIR)
    parser.add_argument("--out", type=Path, default=None, help="profile JSON (default: <artifacts>/profile.json)")
    parser.add_argument("--quick", action="store_true", help="fewer batch sizes and repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    profile = build_profile(args.artifacts, QUICK_BATCH_SIZES if args.quick else DEFAULT_BATCH_SIZES,
                            QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    out = args.out or args.artifacts / PROFILE_FILE
    profile.save(out)
    print(json.dumps({"out": str(out), "accuracy": profile.accuracy}))


if __name__ == "__main__":
    main()
