"""The nccl path of a tensor-parallel stage: two shards on two GPUs, joined by nccl, give the unsplit model's output.

Runs only where torch sees at least two GPUs and the test's Ray declares them; skipped on CPU-only machines (the
development VM and CI)."""

from __future__ import annotations

import pytest
import torch

from models.layers import run_layers
from parallel.group_runtime import ModelParallelGroup
from parallel.plan import ParallelPlan
from parallel.stage_layers import example_input, load_model
from parallel.tiny_models import make_tiny_bert

REQUIRED_GPUS = 2
MAX_ABS_DIFF = 1e-4  # fp32 on GPU: reduction order differs from the CPU's
SEQ_LEN_TOKENS = 12

pytestmark = [pytest.mark.ray, pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < REQUIRED_GPUS,
                                 reason=f"needs {REQUIRED_GPUS} GPUs (the nccl path of tensor-parallel stages)")]


def test_tensor_parallel_stage_on_two_gpus_runs_nccl_and_matches_the_unsplit_model(ray_serve, tmp_path):
    import ray

    if ray.cluster_resources().get("GPU", 0) < REQUIRED_GPUS:
        pytest.skip(f"the test's Ray declares fewer than {REQUIRED_GPUS} GPUs")
    source = make_tiny_bert(tmp_path)
    model = load_model(source)
    state = example_input(model, 2, SEQ_LEN_TOKENS, seed=0)
    with torch.inference_mode():
        expected = run_layers(model.layers(), state).hidden
    plan = ParallelPlan.even(len(model.layers()), pipeline_stages=1, intra_op_degree=2)
    group = ModelParallelGroup(source, plan, num_gpus_per_actor=1.0)
    try:
        infos = ray.get([actor.placement_info.remote() for actor in group.actors[0]])
        assert all(info["device"].startswith("cuda") and info["collective_backend"] == "nccl" for info in infos)
        assert (group.infer(state).hidden - expected).abs().max().item() <= MAX_ABS_DIFF
    finally:
        group.shutdown()
