"""Devices in `parallel/` without a GPU and without Ray: the meta device stands in for CUDA where layers must run
somewhere other than the CPU, and a recorded `torch.cuda.synchronize` shows where the profiler waits for CUDA."""

from __future__ import annotations

import pytest
import torch

from models.device import CPU_RESOURCE
from models.layers import run_layers
from parallel import profiler
from parallel.plan import ParallelPlan
from parallel.stage_actor import StageShard
from parallel.stage_layers import example_input, load_model
from parallel.tiny_models import make_tiny_bert

SEQ_LEN_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("bert"))


@pytest.fixture
def cuda_syncs(monkeypatch):
    """Every `torch.cuda.synchronize` call, recorded instead of run (this machine has no GPU)."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    return calls


def test_timed_regions_on_cuda_are_synchronized_before_and_after(cuda_syncs):
    runs: list[str] = []

    def work():
        runs.append("run")
        cuda_syncs.append("run")

    profiler._timed(work, warmup=1, repeats=3, device="cuda")
    assert len(runs) == 4
    assert cuda_syncs == ["run"] + ["sync", "run", "sync"] * 3  # the warm-up is not timed


def test_interleaved_layer_times_synchronize_around_every_layer_on_cuda(cuda_syncs):
    layers = [lambda state: cuda_syncs.append("layer")] * 2
    times = profiler.interleaved_layer_times(layers, [None, None], warmup=0, repeats=2, device=torch.device("cuda"))
    assert len(times) == 2
    assert cuda_syncs == ["sync", "layer", "sync"] * 4


def test_nothing_waits_for_cuda_on_the_cpu_or_the_meta_device(cuda_syncs):
    profiler._timed(lambda: None, warmup=0, repeats=2, device="cpu")
    profiler._timed(lambda: None, warmup=0, repeats=2, device="meta")
    assert cuda_syncs == []


def test_a_layer_profile_runs_on_the_device_it_is_given(tiny):
    on_cpu = profiler.profile_layers(tiny, [2], [SEQ_LEN_TOKENS], warmup=0, repeats=1)
    on_meta = profiler.profile_layers(tiny, [2], [SEQ_LEN_TOKENS], warmup=0, repeats=1, device="meta")
    assert [m.output_bytes for m in on_meta.layers] == [m.output_bytes for m in on_cpu.layers]
    assert all(m.latency_s for m in on_meta.layers)


def test_a_stage_actor_keeps_its_layers_inputs_and_output_on_its_device(tiny):
    """The stage actor's body without Ray: with its device set to meta (standing in for its GPU), it loads its
    layers there, moves each input there and hands its output on from there (the transport moves it per hop)."""
    model = load_model(tiny)
    plan = ParallelPlan.even(len(model.layers()), pipeline_stages=2)
    shard = StageShard(tiny, plan.stages[1], 1, 0, 1, device_resource=CPU_RESOURCE)
    assert shard.device == torch.device("cpu")  # no GPU reserved: the CPU
    shard.device = torch.device("meta")
    shard.setup()
    assert all(p.device.type == "meta" for layer in shard.layers for p in layer.parameters())
    with torch.inference_mode():
        state = model.layers()[0](example_input(model, 2, SEQ_LEN_TOKENS))
        for layer in model.layers()[1:plan.stages[0].end_layer]:
            state = layer(state)
        expected = run_layers(model.layers()[plan.stages[1].start_layer:], state)
    out = shard.forward(state)
    assert out.hidden.device.type == "meta" and out.hidden.shape == expected.hidden.shape
    assert len(shard.call_log()) == 1
