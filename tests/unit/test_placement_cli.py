"""`python -m placement plan / simulate / schema`: end to end on a small spec, and bad specs named."""

import json
import subprocess
import sys

import pytest

from placement.cli import main
from placement.core.placement_plan import Placement


@pytest.fixture()
def spec_path(tmp_path):
    spec = {
        "profiles": {"paper_models": {"bert-1.3b": 3}},
        "workload": {"kind": "gamma", "total_rate_per_s": 10, "cv": 3, "duration_s": 60, "popularity_exponent": 0.5},
        "cluster": {"num_devices": 2, "device_memory_bytes": 6_000_000_000},
        "planner": {"max_group_devices": 2},
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def test_plan_then_simulate(spec_path, tmp_path, capsys):
    out = tmp_path / "placement.json"
    assert main(["-q", "plan", str(spec_path), "-o", str(out)]) == 0
    placement = Placement.load(out)
    assert placement.models() == {"bert-1.3b-0", "bert-1.3b-1", "bert-1.3b-2"}
    assert placement == placement.normalize()
    assert "predicted SLO attainment" in capsys.readouterr().out
    summary = tmp_path / "sim.json"
    assert main(["-q", "simulate", str(spec_path), "--placement", str(out), "-o", str(summary)]) == 0
    data = json.loads(summary.read_text())
    assert data["slo_attainment"] == pytest.approx(placement.predicted_slo_attainment)
    assert "SLO attainment" in capsys.readouterr().out


def test_bad_spec_names_the_field(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"profiles": {"paper_models": {"bert-9b": 1}}, "workload": {"cv": -1}}))
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "paper_models" in err and "workload.cv" in err


def test_schema_subcommand_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "placement", "schema"], capture_output=True, text=True, check=True)
    schema = json.loads(done.stdout)
    assert "ClusterSpec" in json.dumps(schema)


def test_plan_from_a_profile_set_file(tmp_path):
    """Profiles written by parallel/ (a ProfileSet JSON) are read through `profiles.path`."""
    from placement.alpaserve.paper_profiles import replicate_profiles, table1_profiles
    profiles = replicate_profiles(table1_profiles(), {"moe-1.3b": 2}).profiles
    profiles.save(tmp_path / "profiles.json")
    spec = {"profiles": {"path": "profiles.json"}, "models": ["moe-1.3b-0", "moe-1.3b-1"],
            "slo_ms": {"moe-1.3b-0": 600}, "workload": {"kind": "poisson", "total_rate_per_s": 5, "duration_s": 30},
            "cluster": {"num_devices": 2, "device_memory_bytes": 4_000_000_000}, "planner": {"max_group_devices": 2}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "placement.json"
    assert main(["-q", "plan", str(tmp_path / "spec.json"), "-o", str(out)]) == 0
    assert Placement.load(out).models() == {"moe-1.3b-0", "moe-1.3b-1"}
    spec["slo_ms"] = {"other": 1}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert main(["-q", "plan", str(tmp_path / "spec.json"), "-o", str(out)]) == 2
