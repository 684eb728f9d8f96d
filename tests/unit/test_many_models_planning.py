"""configs/many_models.yaml: the planner places every model within each device's memory, from the measured profiles
that the spec names (configs/profiles/many-models-measured.json, written by `python -m parallel profile-spec`)."""

from __future__ import annotations

import pytest
from repo_paths import REPO_ROOT

from parallel.spec_profiles import load_spec_file
from placement.alpaserve.deployment_planning import plan_deployment, planning_spec
from placement.core.deployment_spec import DeploymentSpec
from placement.core.placement_plan import Placement
from placement.core.profiles import ProfileSet

CONFIG = REPO_ROOT / "configs" / "many_models.yaml"


@pytest.fixture(scope="module")
def spec() -> DeploymentSpec:
    return load_spec_file(CONFIG)


@pytest.fixture(scope="module")
def profiles(spec) -> ProfileSet:
    return planning_spec(spec).profiles.load(REPO_ROOT)


@pytest.fixture(scope="module")
def placement(spec) -> Placement:
    return plan_deployment(spec, base_dir=REPO_ROOT)


def device_weight_bytes(placement: Placement, profiles: ProfileSet) -> list[int]:
    """Weight bytes each group puts on each of its devices: its models' configurations summed."""
    totals = []
    for group in placement.groups:
        per_device = 0
        for name in group.models:
            config = next(c for c in profiles.models[name].configs if c.config == group.config)
            per_device += config.weight_bytes_per_device()
        totals.append(per_device)
    return totals


def test_the_spec_is_what_the_issue_describes(spec, profiles):
    kinds = {m.name: (m.kind, m.source) for m in spec.models}
    assert sorted(n for n, (_, s) in kinds.items() if s == "package:all-minilm-l6-v2") == [
        "minilm-a", "minilm-b", "minilm-c", "minilm-d"]
    assert sorted(n for n, (_, s) in kinds.items() if s == "package:all-mpnet-base-v2") == ["mpnet-a", "mpnet-b"]
    assert [n for n, (k, _) in kinds.items() if k == "vision"] == ["digits-vit"]
    assert spec.placement is None and spec.planning is not None and spec.controller_enabled()
    # Every model fits once on the devices together, but not all of them on any one device.
    single = {name: min(c.weight_bytes_per_device() for c in profiles.models[name].configs
                        if c.config.num_devices == 1) for name in kinds}
    budget = spec.cluster.device_memory_bytes
    assert budget < sum(single.values()) <= spec.cluster.num_devices * budget
    assert single["mpnet-a"] + single["mpnet-b"] > budget  # the two MPNet copies never share one device whole


def test_the_planner_places_every_model_within_each_devices_memory(spec, profiles, placement):
    assert placement.models() == {m.name for m in spec.models}
    assert placement.num_devices <= spec.cluster.num_devices
    assert all(total <= spec.cluster.device_memory_bytes for total in device_weight_bytes(placement, profiles))
    for group in placement.groups:
        for name in group.models:
            assert any(c.config == group.config for c in profiles.models[name].configs), (name, group.config)


def test_mpnet_is_never_placed_with_tensor_parallelism(profiles):
    for name in ("mpnet-a", "mpnet-b", "digits-vit"):
        assert all(c.config.intra_op_degree == 1 for c in profiles.models[name].configs)
    assert {c.config.key() for c in profiles.models["mpnet-a"].configs} == {"op1-pp1", "op1-pp2"}
