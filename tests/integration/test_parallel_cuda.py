"""A pipeline group on the GPU: its stage actors compute on CUDA, the stage transport carries requests of varying
shapes between them (NCCL between two GPUs; through host memory between two actors sharing one GPU) and the answers
equal the unsplit model's on the CPU. Skipped without a GPU (run by benchmarks/device_check.sh)."""

from __future__ import annotations

import pytest
import torch

from models.layers import run_layers
from parallel.group_runtime import ModelParallelGroup
from parallel.plan import ParallelPlan
from parallel.stage_layers import example_input, load_model
from parallel.tiny_models import make_tiny_bert

MAX_ABS_DIFF = 1e-4  # fp32 on GPU: reduction order differs from the CPU's
SEQ_LENS_TOKENS = (6, 12, 9)
STAGES = 2

pytestmark = [pytest.mark.ray, pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_a_pipeline_on_the_gpu_runs_on_cuda_and_matches_the_cpu_model(ray_serve, tmp_path):
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus < 1:
        pytest.skip("the test's Ray declares no GPU")
    source = make_tiny_bert(tmp_path)
    model = load_model(source)
    states = [example_input(model, 2, seq, seed=i) for i, seq in enumerate(SEQ_LENS_TOKENS)]
    with torch.inference_mode():
        expected = [run_layers(model.layers(), state).hidden for state in states]
    plan = ParallelPlan.even(len(model.layers()), pipeline_stages=STAGES)
    group = ModelParallelGroup(source, plan, num_gpus_per_actor=min(1.0, gpus / STAGES))
    try:
        infos = ray.get([row[0].placement_info.remote() for row in group.actors])
        assert all(info["device"].startswith("cuda") for info in infos)
        assert all(device.startswith("cuda:") for device in group.transport.devices)
        outputs = group.infer_many(states)
        assert max((out.hidden - exp).abs().max().item() for out, exp in zip(outputs, expected)) <= MAX_ABS_DIFF
    finally:
        group.shutdown()
