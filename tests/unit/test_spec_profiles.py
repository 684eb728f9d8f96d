"""`python -m parallel profile-spec`: profiles of every model of a spec, in the file the planner reads.

Small: two copies of all-MiniLM-L6-v2 and the digits adaptive ViT, group size 1 (no Ray), one batch size, a short
sequence, one timed run per layer.
"""

from __future__ import annotations

import pytest
import yaml

from parallel.__main__ import main
from parallel.spec_profiles import load_spec_file, profile_spec, spec_model_source
from placement.core.profiles import ProfileSet

MIB = 2**20


def spec_dict(device_memory_bytes: int = 800 * MIB) -> dict:
    return {
        "cluster": {"num_devices": 2, "device_memory_bytes": device_memory_bytes, "device_resource": "CPU"},
        "models": [
            {"name": "copy-a", "kind": "text", "source": "package:all-minilm-l6-v2"},
            {"name": "copy-b", "kind": "text", "source": "package:all-minilm-l6-v2", "max_input_length_tokens": 6},
            {"name": "copy-c", "kind": "text", "source": "package:all-minilm-l6-v2"},
            {"name": "digits", "kind": "vision", "source": "timm:vit_tiny_patch16_224", "num_classes": 10,
             "image_size_px": 32, "in_chans": 1,
             "policies": {"token_adaptation": {"name": "otas", "params": {"default_task": "digit"}}}},
        ],
    }


def serve_config(spec: dict) -> dict:
    return {"applications": [{"name": "plexserve", "route_prefix": "/", "import_path": "rayserve_apps.app:build_app",
                              "args": spec}]}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profile-spec")
    spec_path, out = folder / "spec.yaml", folder / "profiles.json"
    spec_path.write_text(yaml.safe_dump(serve_config(spec_dict())))
    code = main(["profile-spec", str(spec_path), "--out", str(out), "--group-sizes", "1", "--batch-sizes", "1", "2",
                 "--seq-len", "8", "--repeats", "1"])
    return code, ProfileSet.load(out)


def test_every_model_of_the_spec_gets_a_profile_the_planner_reads(written):
    code, profiles = written
    assert code == 0 and profiles.source == "measured"
    assert set(profiles.models) == {"copy-a", "copy-b", "copy-c", "digits"}
    for model in profiles.models.values():
        assert [c.config.key() for c in model.configs] == ["op1-pp1"]
        assert set(model.configs[0].stages[0].latency_s) == {1, 2}


def test_copies_of_one_checkpoint_share_one_measurement_and_their_weights(written):
    _, profiles = written
    a, c = profiles.models["copy-a"].configs[0], profiles.models["copy-c"].configs[0]
    assert a.stages == c.stages  # measured once, stored under each name
    # copy-b is capped at 6 tokens, so it is measured on its own, with the same weights.
    b = profiles.models["copy-b"].configs[0]
    assert b.weight_bytes_per_device() == a.weight_bytes_per_device()
    assert 80 * MIB < a.weight_bytes_per_device() < 95 * MIB  # all-MiniLM-L6-v2 in fp32
    assert profiles.models["digits"].configs[0].weight_bytes_per_device() < 2 * MIB


def test_a_model_that_fits_no_device_is_named(tmp_path):
    from placement.core.deployment_spec import parse_spec

    spec = parse_spec(spec_dict(device_memory_bytes=40 * MIB))
    with pytest.raises(ValueError, match=r"models \['copy-a', 'copy-b', 'copy-c'\] fit no configuration"):
        profile_spec(spec, group_sizes=[1], batch_sizes=[1], seq_len_tokens=4, repeats=1)


def test_bad_spec_files_and_arguments_are_clear_errors(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        main(["profile-spec", str(tmp_path / "absent.yaml"), "--out", str(tmp_path / "x.json")])
    two = tmp_path / "two.yaml"
    config = serve_config(spec_dict())
    config["applications"].append(dict(config["applications"][0], name="other"))
    two.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit, match="expected one application"):
        main(["profile-spec", str(two), "--out", str(tmp_path / "x.json")])
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump(spec_dict()))  # a bare spec is read too
    assert len(load_spec_file(one).models) == 4
    with pytest.raises(SystemExit, match="group sizes"):
        main(["profile-spec", str(one), "--out", str(tmp_path / "x.json"), "--group-sizes", "3"])


def test_a_token_adaptation_model_is_profiled_as_its_adaptive_backbone():
    from models.task_registry import DIGITS_ARTIFACTS_DIR
    from placement.core.deployment_spec import parse_spec

    spec = parse_spec(spec_dict())
    source = spec_model_source(spec.model("digits"))
    assert source.adaptive_artifacts == str(DIGITS_ARTIFACTS_DIR) and source.timm_kwargs == {"in_chans": 1}
    assert spec_model_source(spec.model("copy-a")).adaptive_artifacts is None
