"""Planned stage cuts: `python -m parallel configs` stores the DP's plan with each configuration's profile, a group
reads it back for its (model, config), and the planned cut runs exactly; without a stored plan the cut is even.
A stage reads from the checkpoint only its own layers' tensors and holds exactly the planned weight share.

No Ray: the group replica's choice is `parallel.plan.stored_or_even` on what `rayserve_apps.contracts.stored_plans`
puts in its user_config."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.layers import run_layers
from models.partial_load import CheckpointTensors, tensor_names
from parallel.__main__ import main as parallel_cli
from parallel.comm_model import AlphaBeta, CommModel
from parallel.plan import ParallelPlan, stored_or_even
from parallel.profiler import LayerProfileSet, profile_layers
from parallel.stage_layers import (
    example_input,
    load_model,
    load_stage_layers,
    run_plan_in_process,
    standalone_layers,
)
from parallel.tensor_parallel import NoCollectives
from parallel.tiny_models import UNEQUAL_VIT_CLASSES, UNEQUAL_VIT_DEPTH, make_unequal_vit
from placement.core.deployment_spec import parse_spec
from placement.core.placement_plan import GroupPlacement
from placement.core.profiles import ParallelConfig, ProfileSet
from rayserve_apps.contracts import group_user_config, stored_plans

MAX_ABS_DIFF = 1e-5
BATCH_SIZES = (1, 2)
#: The unequal stand-in ViT (`parallel.tiny_models.make_unequal_vit`): 6 layers (embeddings, 4 blocks, wide head).
NUM_LAYERS = UNEQUAL_VIT_DEPTH + 2
#: Stated per-layer costs (seconds per image) in the proportions of that model's measured ones: the head costs as
#: much as the four blocks and the embeddings half a block, so the even cut [0, 3) | [3, 6) has a 6-unit stage,
#: [0, 4) | [4, 6) a 5-unit one, and the DP's [0, 5) | [5, 6) at most 4.5.
UNEQUAL_COST_S = (0.5e-3, 1e-3, 1e-3, 1e-3, 1e-3, 4e-3)
EXPECTED_PLANNED_BOUNDS = [(0, 5), (5, 6)]
#: Synthetic stand-in communication costs (sends cheap next to the layers; collectives free).
FREE = AlphaBeta(alpha_s=0.0, beta_s_per_byte=0.0)
STAND_IN_COMM = CommModel(send=AlphaBeta(alpha_s=1e-6, beta_s_per_byte=1e-12), all_reduce={2: FREE},
                          all_gather={2: FREE})
PIPELINE2 = ParallelConfig(intra_op_degree=1, pipeline_stages=2)


def bounds(plan: ParallelPlan) -> list[tuple[int, int]]:
    return [(stage.start_layer, stage.end_layer) for stage in plan.stages]


@pytest.fixture(scope="module")
def unequal(tmp_path_factory):
    """The stand-in ViT, its layer profile with the stated unequal costs, and the profile file `configs` wrote."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("planned")
    source = make_unequal_vit(folder)
    model = load_model(source)
    profile = profile_layers(source, BATCH_SIZES, warmup=0, repeats=1, model=model)
    for layer, cost_s in zip(profile.layers, UNEQUAL_COST_S, strict=True):
        layer.latency_s = {key: cost_s * int(key.split("x")[0]) for key in layer.latency_s}
    layers_path, profiles_path = folder / "layers.json", folder / "measured.json"
    LayerProfileSet(device="stand-in", models={"unequal-vit": profile}, comm=STAND_IN_COMM).save(layers_path)
    assert parallel_cli(["configs", "--layers", str(layers_path), "--group-sizes", "1", "2", "--out",
                         str(profiles_path)]) == 0
    return model, profiles_path, source


def test_configs_store_the_dp_plan_with_each_profile_and_it_differs_from_even(unequal):
    _, path, _ = unequal
    profiles = ProfileSet.load(path)
    model = profiles.models["unequal-vit"]
    assert {c.config.key() for c in model.configs} == {"op1-pp1", "op1-pp2", "op2-pp1"}
    assert all(c.plan is not None for c in model.configs)
    planned = ParallelPlan.model_validate(model.get(PIPELINE2).plan)
    assert bounds(planned) == EXPECTED_PLANNED_BOUNDS
    assert bounds(planned) != bounds(ParallelPlan.even(NUM_LAYERS, pipeline_stages=2))
    # The stored plan agrees with the stage profile the planner reads: stage 0 is everything but the head.
    assert model.get(PIPELINE2).stages[0].latency(1) == pytest.approx(sum(UNEQUAL_COST_S[:5]), rel=0.01)


def test_group_user_config_carries_the_stored_plan_and_the_group_runs_it_exactly(unequal):
    model, path, source = unequal
    checkpoint = source.checkpoint_path
    spec = parse_spec({
        "cluster": {"num_devices": 2},
        "models": [{"name": "unequal-vit", "kind": "vision", "source": "timm:vit_tiny_patch16_224",
                    "checkpoint_path": checkpoint, "num_classes": UNEQUAL_VIT_CLASSES, "image_size_px": 32},
                   {"name": "unprofiled-vit", "kind": "vision", "source": "timm:vit_tiny_patch16_224",
                    "checkpoint_path": checkpoint, "num_classes": UNEQUAL_VIT_CLASSES, "image_size_px": 32}],
        "planning": {"profiles": {"path": str(path)}},
    })
    group = GroupPlacement(num_devices=2, config=PIPELINE2, models=["unequal-vit", "unprofiled-vit"])
    plans = group_user_config(spec, group, version=0)["plans"]
    assert set(plans) == {"unequal-vit"}  # the unprofiled model has no plan: its group cuts it evenly
    assert stored_plans(spec, ["unequal-vit"], ParallelConfig(pipeline_stages=1, intra_op_degree=2))  # per config

    plan, origin = stored_or_even(plans["unequal-vit"], NUM_LAYERS, pipeline_stages=2, intra_op_degree=1)
    assert (origin, bounds(plan)) == ("planned", EXPECTED_PLANNED_BOUNDS)
    even, even_origin = stored_or_even(plans.get("unprofiled-vit"), NUM_LAYERS, pipeline_stages=2, intra_op_degree=1)
    assert (even_origin, bounds(even)) == ("even", [(0, 3), (3, 6)])

    state = example_input(model, 2)
    with torch.inference_mode():
        expected = run_layers(model.layers(), state).hidden
    assert (run_plan_in_process(model, plan, state).hidden - expected).abs().max().item() <= MAX_ABS_DIFF


def test_a_stored_plan_that_does_not_fit_the_model_falls_back_to_even(unequal):
    _, path, _ = unequal
    stored = ProfileSet.load(path).models["unequal-vit"].get(PIPELINE2).plan
    plan, origin = stored_or_even(stored, NUM_LAYERS + 2, pipeline_stages=2, intra_op_degree=1)  # a deeper model
    assert origin == "even" and plan == ParallelPlan.even(NUM_LAYERS + 2, pipeline_stages=2)
    _, origin = stored_or_even(stored, NUM_LAYERS, pipeline_stages=3, intra_op_degree=1)  # another config
    assert origin == "even"


def test_spec_without_a_profile_file_gives_no_plans(unequal, tmp_path):
    spec = parse_spec({"cluster": {"num_devices": 1},
                       "models": [{"name": "unequal-vit", "kind": "vision", "source": "timm:vit_tiny_patch16_224"}],
                       "planning": {"profiles": {"path": str(tmp_path / "missing.json")}}})
    assert stored_plans(spec, ["unequal-vit"], ParallelConfig()) == {}


def test_each_planned_stage_reads_only_its_layers_tensors_and_holds_its_planned_share(unequal, monkeypatch):
    model, path, source = unequal
    stored = ProfileSet.load(path).models["unequal-vit"].get(PIPELINE2)
    plan = ParallelPlan.model_validate(stored.plan)
    read: list[str] = []
    original_get = CheckpointTensors.get
    monkeypatch.setattr(CheckpointTensors, "get", lambda self, name: read.append(name) or original_get(self, name))
    full_layers = standalone_layers(model)
    every_tensor = set(model.model.state_dict())
    state = example_input(model, 2)
    with torch.inference_mode():
        expected = run_layers(model.layers(), state).hidden
    for stage, planned in zip(plan.stages, stored.stages, strict=True):
        read.clear()
        sliced = load_stage_layers(source, stage.start_layer, stage.end_layer, NoCollectives())
        own = full_layers[stage.start_layer:stage.end_layer]
        # Only this stage's tensors were read, each once; the rest of the checkpoint never entered the process.
        assert sorted(read) == sorted(tensor_names(model.model, own))
        assert set(read) < every_tensor
        # Its parameters are exactly its layers' (count and bytes), which is the share the plan was priced with.
        held = nn.ModuleList(sliced.layers)
        assert sum(p.numel() for p in held.parameters()) == sum(p.numel() for p in nn.ModuleList(own).parameters())
        assert sliced.weight_bytes == planned.weight_bytes_per_device
        with torch.inference_mode():
            state = run_layers(sliced.layers, state)
    assert (state.hidden - expected).abs().max().item() <= MAX_ABS_DIFF
