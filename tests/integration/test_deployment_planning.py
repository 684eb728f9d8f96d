"""A deployment spec without a placement but with a planning section gets one planned before deploying."""

import pytest

from placement.core.deployment_spec import parse_spec
from placement.core.profiles import ConfigProfile, ModelProfile, ParallelConfig, ProfileSet, StageProfile
from rayserve_apps.app import resolve_placement

GIB = 1024**3


def synthetic_profiles() -> ProfileSet:
    """Two models with single-device and 2-stage configurations (synthetic figures, named as such)."""
    def model(name: str, latency_s: float) -> ModelProfile:
        one = ConfigProfile(config=ParallelConfig(),
                            stages=[StageProfile(latency_s={1: latency_s}, weight_bytes_per_device=GIB)])
        two = ConfigProfile(config=ParallelConfig(pipeline_stages=2), stages=[
            StageProfile(latency_s={1: latency_s * 0.55}, weight_bytes_per_device=GIB // 2) for _ in range(2)])
        return ModelProfile(name=name, configs=[one, two])
    return ProfileSet(source="synthetic", device="test",
                      models={"alpha": model("alpha", 0.05), "beta": model("beta", 0.02)})


def spec_dict(profiles_path: str, **planning) -> dict:
    return {
        "cluster": {"num_devices": 2, "device_memory_bytes": 4 * GIB, "device_resource": "plex_device"},
        "models": [{"name": "alpha", "kind": "text", "source": "package:all-minilm-l6-v2", "slo_ms": 500},
                   {"name": "beta", "kind": "text", "source": "package:all-minilm-l6-v2", "slo_ms": 200}],
        "planning": {"profiles": {"path": profiles_path},
                     "workload": {"kind": "gamma", "total_rate_per_s": 20, "cv": 3, "duration_s": 60}, **planning},
    }


def test_planning_section_yields_a_valid_placement(tmp_path):
    path = tmp_path / "profiles.json"
    synthetic_profiles().save(path)
    spec = resolve_placement(parse_spec(spec_dict(str(path))))
    assert spec.placement is not None
    assert spec.placement.models() == {"alpha", "beta"}
    assert spec.placement.num_devices <= 2
    assert spec.placement.predicted_slo_attainment is not None


def test_bad_planning_field_is_named(tmp_path):
    path = tmp_path / "profiles.json"
    synthetic_profiles().save(path)
    with pytest.raises(ValueError, match=r"planning\.planner\.beam_size"):
        resolve_placement(parse_spec(spec_dict(str(path), planner={"beam_size": 0})))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_placement(parse_spec(spec_dict(str(tmp_path / "absent.json"))))


def test_controller_section_sets_the_policys_horizon_resamples_and_transition_costs(tmp_path):
    from placement.alpaserve.deployment_planning import replan_policy

    path = tmp_path / "profiles.json"
    synthetic_profiles().save(path)
    data = spec_dict(str(path))
    data["placement"] = {"groups": [{"num_devices": 1, "config": {}, "models": ["alpha"]},
                                    {"num_devices": 1, "config": {}, "models": ["beta"]}]}
    data["controller"] = {"period_s": 15, "horizon_periods": 2, "held_out_resamples": 5, "group_slots": 3,
                          "transition": {"replica_start_s": 7.5}}
    policy = replan_policy(parse_spec(data))
    assert (policy.horizon_s, policy.held_out_resamples, policy.num_slots) == (30.0, 5, 3)
    assert policy.transition is not None and policy.transition.replica_start_s == 7.5
    data["controller"] = {"period_s": 15, "price_transitions": False}
    assert replan_policy(parse_spec(data)).transition is None
    data["controller"] = {"transition": {"loading_slowdown": 0.5}}
    with pytest.raises(ValueError, match="loading_slowdown"):
        parse_spec(data)
