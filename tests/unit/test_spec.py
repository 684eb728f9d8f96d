import json

import pytest

from placement.core.deployment_spec import DeploymentSpec, parse_spec, spec_json_schema

MINILM = {"name": "minilm", "kind": "text", "source": "package:all-minilm-l6-v2"}


def test_valid_spec_round_trips_through_json():
    spec = parse_spec({"models": [MINILM], "policies": {"dispatch": {"name": "shortest_queue"}}})
    again = parse_spec(json.loads(spec.model_dump_json()))
    assert again == spec
    assert spec.policy("dispatch").name == "shortest_queue"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"slo_ms": -5}, "models.0.slo_ms"),
        ({"name": "Has Space"}, "models.0.name"),
        ({"kind": "audio"}, "models.0.kind"),
        ({"on_too_long": "ignore"}, "models.0.on_too_long"),
        ({"max_batch_size": 0}, "models.0.max_batch_size"),
        ({"surprise": 1}, "models.0.surprise"),
    ],
)
def test_bad_model_field_is_named(change, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse_spec({"models": [{**MINILM, **change}]})


def test_duplicate_names_and_empty_models_are_refused():
    with pytest.raises(ValueError, match="appears twice"):
        parse_spec({"models": [MINILM, MINILM]})
    with pytest.raises(ValueError, match="models"):
        parse_spec({"models": []})


def test_vision_fields_are_checked_against_kind():
    with pytest.raises(ValueError, match="timm"):
        parse_spec({"models": [{"name": "vit", "kind": "vision", "source": "package:all-minilm-l6-v2"}]})
    with pytest.raises(ValueError, match="num_classes applies to vision models only"):
        parse_spec({"models": [{**MINILM, "num_classes": 3}]})


def test_model_policy_overrides_spec_policy():
    spec = parse_spec({
        "models": [{**MINILM, "policies": {"batching": {"name": "das", "params": {"eta": 0.7}}}}],
        "policies": {"batching": {"name": "fcfs"}},
    })
    assert spec.policy("batching", "minilm").name == "das"
    assert spec.policy("batching").name == "fcfs"
    assert spec.policy("routing", "minilm") is None


def test_json_schema_documents_every_field():
    schema = json.loads(spec_json_schema())
    assert schema["title"] == "DeploymentSpec"
    for definition in schema["$defs"].values():
        for name, prop in definition.get("properties", {}).items():
            assert prop.get("description"), f"{definition['title']}.{name} has no description"
    assert DeploymentSpec.model_json_schema()["required"] == ["models"]


def test_controller_needs_profiles_and_enough_group_slots():
    text = {"name": "t", "kind": "text", "source": "package:all-minilm-l6-v2"}
    group = {"num_devices": 1, "config": {"intra_op_degree": 1, "pipeline_stages": 1}, "models": ["t"]}
    base = {"models": [text], "cluster": {"num_devices": 2}, "placement": {"groups": [group, group]}}
    with pytest.raises(ValueError, match=r"controller: .*planning.profiles"):
        parse_spec({**base, "controller": {}})
    planning = {"profiles": {"path": "profiles.json"}}
    with pytest.raises(ValueError, match="group_slots=1"):
        parse_spec({**base, "planning": planning, "controller": {"group_slots": 1}})
    with pytest.raises(ValueError, match=r"controller\.period_s"):
        parse_spec({**base, "planning": planning, "controller": {"period_s": 0}})
    spec = parse_spec({**base, "planning": planning, "controller": {"period_s": 30}})
    assert spec.controller_enabled() and spec.controller.period_s == 30
    assert not parse_spec({**base, "controller": {"enabled": False}}).controller_enabled()


def test_controller_without_placement_needs_a_polymorphing_model():
    text = {"name": "t", "kind": "text", "source": "package:all-minilm-l6-v2"}
    with pytest.raises(ValueError, match="nothing to control"):
        parse_spec({"models": [text], "controller": {}})
    arlo = {"polymorphing": {"name": "arlo", "params": {"capacities": {16: 2, 64: 8}}}}
    spec = parse_spec({"models": [{**text, "policies": arlo}], "controller": {}})  # runtime allocation only
    assert spec.controller_enabled() and spec.placement is None


def test_autoscaling_replaces_num_replicas_and_checks_its_bounds():
    spec = parse_spec({"models": [{**MINILM, "autoscaling": {"min_replicas": 1, "max_replicas": 3}}]})
    assert spec.models[0].autoscaling.serve_config() == {
        "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2.0, "upscale_delay_s": 30.0,
        "downscale_delay_s": 600.0}
    assert parse_spec(json.loads(spec.model_dump_json())) == spec  # dumped with its defaults, it parses again
    with pytest.raises(ValueError, match=r"num_replicas \(2\) and autoscaling exclude each other"):
        parse_spec({"models": [{**MINILM, "num_replicas": 2, "autoscaling": {"max_replicas": 3}}]})
    with pytest.raises(ValueError, match=r"min_replicas \(4\) exceeds max_replicas \(2\)"):
        parse_spec({"models": [{**MINILM, "autoscaling": {"min_replicas": 4, "max_replicas": 2}}]})
    with pytest.raises(ValueError, match="initial_replicas"):
        parse_spec({"models": [{**MINILM, "autoscaling": {"max_replicas": 2, "initial_replicas": 3}}]})
    with pytest.raises(ValueError, match=r"models\.0\.autoscaling\.target_ongoing_requests"):
        parse_spec({"models": [{**MINILM, "autoscaling": {"target_ongoing_requests": 0}}]})


def test_in_ingress_is_checked_against_kind_replicas_groups_and_polymorphing():
    assert parse_spec({"models": [MINILM]}).models[0].in_ingress == "never"
    when_idle = parse_spec({"models": [{**MINILM, "in_ingress": "when_idle", "num_replicas": 2}]}).models[0]
    assert when_idle.num_replicas == 2
    with pytest.raises(ValueError, match=r"models\.0\.in_ingress"):
        parse_spec({"models": [{**MINILM, "in_ingress": "sometimes"}]})
    vision = {"name": "vit", "kind": "vision", "source": "timm:vit_tiny_patch16_224", "in_ingress": "always"}
    with pytest.raises(ValueError, match="in_ingress applies to text models only"):
        parse_spec({"models": [vision]})
    with pytest.raises(ValueError, match="in_ingress 'always'.*num_replicas and autoscaling do not apply"):
        parse_spec({"models": [{**MINILM, "in_ingress": "always", "num_replicas": 2}]})
    with pytest.raises(ValueError, match="'minilm' sets in_ingress and is in a placement group"):
        parse_spec({"models": [{**MINILM, "in_ingress": "when_idle"}],
                    "placement": {"groups": [{"num_devices": 1, "models": ["minilm"],
                                               "config": {"intra_op_degree": 1, "pipeline_stages": 1}}]}})
    arlo = {"name": "arlo", "params": {"capacities": {"64": 10.0}}}
    with pytest.raises(ValueError, match="'minilm' sets in_ingress and has a polymorphing policy"):
        parse_spec({"models": [{**MINILM, "in_ingress": "always", "policies": {"polymorphing": arlo}}]})
