"""benchmarks/device_check.sh --dry-run (no GPU, no Ray): every step's command exists and accepts its arguments,
the plan fits in 8 minutes, and nothing is measured; `--steps`; the result record built from a check's outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from repo_paths import REPO_ROOT

from benchmarks import _device_check as device_check

DRY_RUN_TIMEOUT_S = 300




def _run(*args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(["bash", str(REPO_ROOT / "benchmarks" / "device_check.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S)


def test_the_dry_run_checks_every_step_and_prints_the_plan(tmp_path):
    result = _run("--dry-run", out=tmp_path / "out")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for step in ("cuda-tests", "serve_e2e", "parallel_runtime"):
        assert any(line.startswith(f"plan: {step} (at most ") for line in lines), result.stdout
        assert any(line.startswith(f"check: {step}: ") for line in lines), result.stdout
    assert any("-m pytest -q -m cuda tests" in line for line in lines)
    assert any("serve_e2e.py --quick --device cuda" in line for line in lines)
    assert any("parallel_runtime.py --quick --device cuda" in line for line in lines)
    many_models = (REPO_ROOT / "benchmarks" / "many_models.py").exists()
    assert any(line.startswith("plan: many_models") for line in lines)
    assert any(line.startswith("check: many_models: ") for line in lines) == many_models
    total = next(line for line in lines if line.startswith("plan: at most "))
    assert int(total.split()[3]) <= 480
    assert f"outputs under {tmp_path / 'out'}" in total
    assert lines[-1] == "dry run: every step's command exists and accepts its arguments"
    assert not (tmp_path / "out").exists()  # a dry run measures and writes nothing


def test_an_unknown_argument_is_refused_naming_it():
    result = _run("--dryrun")
    assert result.returncode == 2 and "unknown argument '--dryrun'" in result.stderr


def test_steps_keeps_the_steps_named_and_refuses_an_unknown_one(tmp_path):
    result = _run("--dry-run", "--steps", "cuda-tests,many_models", out=tmp_path / "out")
    assert result.returncode == 0, result.stderr
    plans = [line for line in result.stdout.splitlines() if line.startswith("plan: ")]
    assert [line.split()[1] for line in plans[:-1]] == ["cuda-tests", "many_models"]
    assert "beside the first GPU step" in plans[1]
    assert plans[-1].startswith("plan: at most 80 s")  # many_models runs beside the CUDA tests, not after them
    refused = _run("--steps", "cuda-tests,nope")
    assert refused.returncode == 2 and "unknown step 'nope'" in refused.stderr


def _check_output(folder: Path, summary: str, logs: dict[str, str], env: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "summary.txt").write_text(summary)
    for name, text in logs.items():
        (folder / f"{name}.log").write_text(text)
    if env is not None:
        (folder / "env.json").write_text(json.dumps(env))
    return folder


def test_the_record_keeps_each_steps_status_and_figures_a_later_run_replacing_an_earlier_one(tmp_path):
    env = {"gpus": ["NVIDIA H200"], "driver": "580", "cuda": "13.0", "torch": "2.11", "ray": "2.60",
           "python": "3.12", "cpu_cores": 16, "date": "the date", "commit": "abc"}
    first = _check_output(tmp_path / "1", "cuda-tests rc=2 seconds=30\nserve_e2e rc=124 seconds=130\n",
                          {"cuda-tests": "ERROR collecting\n1 error in 3.0s\n", "serve_e2e": "INFO ...\n"}, env)
    second = _check_output(tmp_path / "2", "cuda-tests rc=0 seconds=49\n",
                           {"cuda-tests": ".s\n1 passed, 1 skipped, 835 deselected in 46.15s\n"})
    third = _check_output(tmp_path / "3", "many_models rc=0 seconds=61\n",
                          {"many_models": 'INFO a\n{"sim_rate_at_99_vs_sr": 10.7}\n(raylet) shutdown\n'})
    record = device_check.record([first, second, third], results_dir=tmp_path / "results")
    steps = record["figures"]["steps"]
    assert steps["cuda-tests"] == {"exit_status": 0, "seconds": 49, "timed_out": False,
                                   "figures": {"passed": 1, "skipped": 1, "deselected": 835}}
    assert steps["serve_e2e"]["timed_out"] and steps["serve_e2e"]["figures"] is None
    assert steps["many_models"]["figures"] == {"sim_rate_at_99_vs_sr": 10.7}
    assert record["figures"]["passed"] is False
    assert record["machine"].startswith("NVIDIA H200 (driver 580, CUDA 13.0), 16 cores")
    assert record["commit"] == "abc" and record["command"] == "bash benchmarks/device_check.sh"
    written = json.loads((tmp_path / "results" / "device_check.json").read_text())
    assert written == record == json.loads((first / "device_check.json").read_text())


def test_a_folder_without_a_summary_is_refused_naming_it(tmp_path, capsys):
    assert device_check.main(["record", str(tmp_path), "--results-dir", str(tmp_path / "results")]) == 1
    assert f"{tmp_path}: no summary.txt" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for a GPU machine's Python: torch sees a GPU, pytest and the benchmarks print what they would.
case "$1 ${2:-}" in
    "-c "*) exit 0 ;;
    "-m pytest") echo ".s"; echo "1 passed, 1 skipped, 9 deselected in 1.00s" ;;
    "-m benchmarks._device_check")
        shift 2
        if [[ "$1" == env ]]; then echo '{"gpus": ["Fake GPU"], "commit": "abc", "date": "the date"}'
        elif [[ "$1" == preflight ]]; then @PREFLIGHT@
        else exec @REAL@ -m benchmarks._device_check "$@" --results-dir "@RESULTS@"; fi ;;
    *) echo "progress on stderr" >&2; echo "{\\"script\\": \\"$1\\"}" ;;
esac
"""


def _fake_run(tmp_path: Path, preflight: str = "exit 0") -> subprocess.CompletedProcess:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.replace("@REAL@", sys.executable).replace("@RESULTS@", str(tmp_path / "results"))
                    .replace("@PREFLIGHT@", preflight))
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", str(REPO_ROOT / "benchmarks" / "device_check.sh")], env=env,
                          capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S)


def test_a_run_logs_every_step_and_records_them(tmp_path):
    result = _fake_run(tmp_path)
    out = tmp_path / "out"
    assert result.returncode == 0, result.stderr
    summary = (out / "summary.txt").read_text().split()
    assert {"cuda-tests", "serve_e2e", "parallel_runtime", "many_models"} <= set(summary)
    record = json.loads((tmp_path / "results" / "device_check.json").read_text())
    steps = record["figures"]["steps"]
    assert steps["cuda-tests"]["figures"] == {"passed": 1, "skipped": 1, "deselected": 9}
    assert steps["serve_e2e"]["figures"] == {"script": "benchmarks/serve_e2e.py"}
    assert steps["many_models"]["figures"] == {"script": "benchmarks/many_models.py"}
    assert record["figures"]["passed"] and record["machine"].startswith("Fake GPU")
    assert "progress on stderr" in (out / "parallel_runtime.log").read_text()
    assert json.loads((out / "device_check.json").read_text()) == record


def test_a_run_stops_before_its_steps_when_a_module_does_not_import(tmp_path):
    result = _fake_run(tmp_path, preflight="echo 'device_check: cannot import ray.serve: RuntimeError: grpc' >&2; "
                                           "exit 1")
    assert result.returncode == 2
    assert "cannot import ray.serve" in result.stderr and "nothing ran" in result.stderr
    assert not (tmp_path / "out").exists()


def test_preflight_names_each_module_that_does_not_import_and_why(capsys):
    assert device_check.preflight(("json", "no_such_module_here")) == [
        "no_such_module_here: ModuleNotFoundError: No module named 'no_such_module_here'"]
    assert device_check.main(["preflight", "--modules", "json", "no_such_module_here"]) == 1
    assert "cannot import no_such_module_here" in capsys.readouterr().err
    assert device_check.main(["preflight", "--modules", "json"]) == 0
