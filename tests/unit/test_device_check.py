"""benchmarks/device_check.sh --dry-run (no GPU, no Ray): every step's command exists and accepts its arguments,
the plan fits in 8 minutes, and nothing is measured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from repo_paths import REPO_ROOT

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
