"""Tensor-parallel shards and stage slices reproduce the unsplit model (in one process, shards on threads)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from models.layers import parameter_bytes, run_layers
from parallel.plan import ParallelPlan, StagePlan
from parallel.stage_layers import (
    build_stage_layers,
    example_input,
    load_model,
    load_stage_layers,
    standalone_layers,
)
from parallel.tensor_parallel import BlockShardingPlan, NoCollectives, ThreadCollectives
from parallel.tiny_models import make_tiny_bert, make_tiny_vit

#: fp32 exactness target of every configuration against the unsplit model.
MAX_ABS_DIFF = 1e-5
#: Weight memory per shard may exceed (blocks / degree + whole embeddings and head) by this fraction.
MEMORY_SLACK = 0.10
PLANS = [
    BlockShardingPlan.megatron(),
    BlockShardingPlan(qkv="column", attn_out="column", fc1="replicated", fc2="column"),
    BlockShardingPlan(qkv="replicated", attn_out="row", fc1="row", fc2="replicated"),
]


@pytest.fixture(scope="module", autouse=True)
def _threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return load_model(make_tiny_bert(tmp_path_factory.mktemp("bert")))


@pytest.fixture(scope="module")
def tiny_vit(tmp_path_factory):
    return load_model(make_tiny_vit(tmp_path_factory.mktemp("vit")))


def run_sharded(model, plan: BlockShardingPlan, degree: int, state, start: int = 0, end: int | None = None):
    """Run layers [start, end) on `degree` thread shards; returns (outputs, weight bytes) per shard."""
    end = len(model.layers()) if end is None else end
    group = ThreadCollectives.group(degree)
    results: list = [None] * degree
    errors: list = []

    def shard(rank: int) -> None:
        try:
            with torch.inference_mode():
                stage = build_stage_layers(model, start, end, group[rank], {i: plan for i in range(start, end)})
                results[rank] = (run_layers(stage.layers, state).hidden, stage.weight_bytes)
        except Exception as error:  # noqa: BLE001 - re-raised below
            errors.append(error)
            group[rank]._shared.barrier.abort()

    threads = [threading.Thread(target=shard, args=(rank,)) for rank in range(degree)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "-".join(p.as_dict().values()))
@pytest.mark.parametrize("degree", [2, 4])
def test_sharded_text_and_vision_models_match_unsplit(tiny_bert, tiny_vit, plan, degree):
    for model, state in ((tiny_bert, example_input(tiny_bert, 3, 10)), (tiny_vit, example_input(tiny_vit, 2))):
        with torch.inference_mode():
            expected = run_layers(model.layers(), state).hidden
        for output, _ in run_sharded(model, plan, degree, state):
            assert output.shape == expected.shape
            assert (output - expected).abs().max().item() <= MAX_ABS_DIFF


def test_sharding_changes_the_weights_a_shard_holds(tiny_vit):
    """Sanity: the test above could fail -- a shard with wrong weights gives a different output."""
    state = example_input(tiny_vit, 2)
    with torch.inference_mode():
        expected = run_layers(tiny_vit.layers(), state).hidden
        group = NoCollectives()
        stage = build_stage_layers(tiny_vit, 0, len(tiny_vit.layers()), group)
        block = stage.layers[1].block
        block.mlp.fc1.weight.mul_(1.5)
        try:
            assert (run_layers(stage.layers, state).hidden - expected).abs().max().item() > MAX_ABS_DIFF
        finally:
            block.mlp.fc1.weight.div_(1.5)


@pytest.mark.parametrize("degree", [2, 4])
def test_megatron_shard_memory_is_its_share(tiny_bert, tiny_vit, degree):
    for model, state in ((tiny_bert, example_input(tiny_bert, 1, 4)), (tiny_vit, example_input(tiny_vit, 1))):
        layers = standalone_layers(model)
        whole = sum(parameter_bytes(layer) for layer in layers if layer.kind != "block")
        blocks = sum(parameter_bytes(layer) for layer in layers if layer.kind == "block")
        share = whole + blocks / degree
        for _, weight_bytes in run_sharded(model, BlockShardingPlan.megatron(), degree, state):
            assert share <= weight_bytes <= (1 + MEMORY_SLACK) * share


def test_vit_stage_slices_hold_only_their_layers(tiny_vit):
    layers = tiny_vit.layers()
    total = tiny_vit.weight_bytes()
    first = build_stage_layers(tiny_vit, 0, 2, NoCollectives())
    second = build_stage_layers(tiny_vit, 2, len(layers), NoCollectives())
    assert first.weight_bytes + second.weight_bytes == total
    state = example_input(tiny_vit, 2)
    with torch.inference_mode():
        expected = run_layers(layers, state).hidden
        output = run_layers(second.layers, run_layers(first.layers, state)).hidden
    assert torch.equal(output, expected)


def test_a_loaded_stage_is_freed_when_dropped_without_a_garbage_collection(tmp_path):
    """A stage actor reloads without collecting garbage (a full collection costs it about 0.2 s of CPU): the old
    stage's weights must go with its last reference, so its layers may hold no reference cycles."""
    sources = [make_tiny_bert(tmp_path / "bert"), make_tiny_vit(tmp_path / "vit")]
    gc.collect()
    gc.disable()
    try:
        for source in sources:
            num_layers = len(standalone_layers(load_model(source, weights="none")))
            stage = load_stage_layers(source, 0, num_layers, NoCollectives())
            weights = [weakref.ref(p) for layer in stage.layers for p in layer.parameters()]
            assert weights
            del stage
            alive = sum(ref() is not None for ref in weights)
            assert alive == 0, f"{source.name}: {alive} of {len(weights)} weights outlive their stage"
    finally:
        gc.enable()


def test_minilm_megatron_two_way_matches_unsplit():
    model = load_model(__import__("parallel.stage_layers", fromlist=["ModelSource"]).ModelSource(
        name="all-minilm-l6-v2", kind="text", source="package:all-minilm-l6-v2"))
    state = example_input(model, 2, 16)
    with torch.inference_mode():
        expected = run_layers(model.layers(), state).hidden
    for output, _ in run_sharded(model, BlockShardingPlan.megatron(), 2, state):
        assert (output - expected).abs().max().item() <= MAX_ABS_DIFF


def test_indivisible_heads_are_refused(tiny_bert):
    with pytest.raises(ValueError, match="attention heads"):
        run_sharded(tiny_bert, BlockShardingPlan.megatron(), 3, example_input(tiny_bert, 1, 4))


def test_plan_validation_names_the_problem():
    with pytest.raises(ValueError, match="contiguous"):
        ParallelPlan(stages=[StagePlan(start_layer=0, end_layer=2), StagePlan(start_layer=3, end_layer=4)])
    with pytest.raises(ValueError, match="outside the stage"):
        StagePlan(start_layer=0, end_layer=2, block_shardings={5: {"qkv": "column"}})
    with pytest.raises(ValueError, match="unknown linears"):
        StagePlan(start_layer=0, end_layer=2, block_shardings={1: {"proj": "column"}})
    plan = ParallelPlan.even(8, pipeline_stages=3, intra_op_degree=2)
    assert [(s.start_layer, s.end_layer) for s in plan.stages] == [(0, 3), (3, 5), (5, 8)]
