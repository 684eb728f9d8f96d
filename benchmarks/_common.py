"""Shared helpers for benchmarks: `--quick`, progress logging, the final JSON line, and the PNG output folder.

Every benchmark in `benchmarks/` measures the ratios it reports side by side in one run (the machine is shared
and noisy), logs progress to stderr, prints its figures as one final JSON line on stdout, and writes PNGs under
`benchmarks/out/` (git-ignored). `emit_json` also writes the figures to `benchmarks/results/NAME.json` (NAME: the
benchmark's module name) with the machine, the UTC date, the commit and the command that produced them; the docs'
Benchmarks page is rendered from those files (`docs/gen_docs.py`), and git keeps their history.

    from benchmarks._common import make_parser, setup_logging, emit_json, out_dir
    args = make_parser(__doc__).parse_args()
    log = setup_logging("my_benchmark")
    ...
    emit_json({"requests_per_s": 3.1e6})
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Where benchmarks write their figures (git-ignored).
OUT_DIR = Path(__file__).resolve().parent / "out"
#: Where every benchmark's latest figures are kept, one JSON file per benchmark (committed).
RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: The repository root: paths under it are recorded relative to it, so a result file reads the same from any checkout.
REPO_ROOT = Path(__file__).resolve().parent.parent


def make_parser(description: str | None = None) -> argparse.ArgumentParser:
    """An argument parser that already knows `--quick` (a small run for CI and smoke checks)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small, fast run (for CI and smoke checks)")
    return parser


def setup_logging(name: str, level: int = logging.INFO) -> logging.Logger:
    """Progress goes to stderr through logging; stdout is kept for the final JSON line."""
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return logging.getLogger(name)


def out_dir() -> Path:
    """The folder for PNGs and other generated files, created on first use."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return OUT_DIR


def cpu_seconds_by_role(roles: dict[str, tuple[str, ...]], other: str | None = None) -> dict[str, float]:
    """CPU seconds (user + system) so far of the machine's processes, summed by role: a process belongs to the first
    role one of whose command-line fragments (Ray's process titles, such as "ServeReplica:APP:DEPLOYMENT") its
    command line contains; this process is "load_generator"; the rest go to `other` (left out when None). Read from
    /proc (Linux); empty where /proc is not there. A role's CPU over a span is the difference of two readings."""
    from parallel.profiler import PROC_ROOT, process_cpu_s

    if not PROC_ROOT.is_dir():
        return {}
    totals = {role: 0.0 for role in (*roles, "load_generator", *([other] if other else []))}
    for entry in PROC_ROOT.glob("[0-9]*"):
        seconds = process_cpu_s(int(entry.name))
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if seconds is None:
            continue
        if int(entry.name) == os.getpid():
            totals["load_generator"] += seconds
            continue
        role = next((r for r, fragments in roles.items() if any(f in command for f in fragments)), other)
        if role is not None:
            totals[role] += seconds
    return totals


def machine_description() -> str:
    """A one-line description of the machine the figures were measured on."""
    return (f"{platform.node()} {platform.machine()} {platform.processor() or ''} python "
            f"{platform.python_version()}").strip()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _jsonable(value.item())
    if isinstance(value, (str, Path)) and str(value).startswith(str(REPO_ROOT) + "/"):
        return Path(value).relative_to(REPO_ROOT).as_posix()
    if isinstance(value, Path):
        return str(value)
    return value


def benchmark_name() -> str:
    """The running benchmark's module name: `planner_speed` for `python -m benchmarks.planner_speed` and for
    `python benchmarks/planner_speed.py` alike."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and (spec.name or "").startswith("benchmarks."):
        return spec.name.rsplit(".", 1)[-1]
    return Path(sys.argv[0]).stem or "benchmark"


#: What benchmarks write (result files, plots): a change there is a run's output, not a change of the code it ran.
OUTPUT_PATHS = ("benchmarks/results", "benchmarks/out", "docs/assets")


def git_commit() -> str:
    """`git rev-parse HEAD` of the repository, with `-dirty` when the working tree has uncommitted changes outside
    `OUTPUT_PATHS` (a benchmark that writes its plot before its result file must not call its own run dirty);
    `unknown` outside a git checkout."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                    *(f":(exclude){path}" for path in OUTPUT_PATHS))
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def rerun_command(name: str, argv: list[str]) -> str:
    """The command line that reruns benchmark `name` from the repository root: `python -m benchmarks.NAME ARGS`."""
    return " ".join(["python", "-m", f"benchmarks.{name}", *argv[1:]])


def result_record(figures: dict[str, Any], *, name: str | None = None, quick: bool | None = None,
                  argv: list[str] | None = None) -> dict[str, Any]:
    """The record `emit_json` writes to `benchmarks/results/NAME.json`: where, when, from which commit and by which
    command the figures were measured, whether it was a `--quick` run, and the figures themselves. `name` names a
    result of its own (`concat_batching_long_texts`); the command names the module that ran."""
    argv = list(sys.argv if argv is None else argv)
    module = benchmark_name()
    name = name or module
    return {
        "benchmark": name,
        "machine": machine_description(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": rerun_command(module, argv),
        "quick": ("--quick" in argv) if quick is None else quick,
        "figures": _jsonable(figures),
    }


def write_result(record: dict[str, Any], results_dir: Path | None = None) -> Path:
    """Write a `result_record` to `results_dir/<benchmark>.json` (default `RESULTS_DIR`; the latest run replaces the
    previous one)."""
    results_dir = RESULTS_DIR if results_dir is None else results_dir
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{record['benchmark']}.json"
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def emit_json(figures: dict[str, Any], *, name: str | None = None, quick: bool | None = None) -> None:
    """Print the benchmark's figures as the final JSON line on stdout and keep them, with the machine, date, commit
    and command, in `benchmarks/results/NAME.json`. `name` defaults to the running benchmark's module name, `quick`
    to whether `--quick` is on the command line."""
    write_result(result_record(figures, name=name, quick=quick))
    print(json.dumps(_jsonable(figures), sort_keys=True), flush=True)
