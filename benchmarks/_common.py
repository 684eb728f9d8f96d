"""Shared helpers for benchmarks: `--quick`, progress logging, the final JSON line, and the PNG output folder.

Every benchmark in `benchmarks/` measures the ratios it reports side by side in one run (the machine is shared
and noisy), logs progress to stderr, prints its figures as one final JSON line on stdout, and writes PNGs under
`benchmarks/out/` (git-ignored).

    from benchmarks._common import make_parser, setup_logging, emit_json, out_dir
    args = make_parser(__doc__).parse_args()
    log = setup_logging("my_benchmark")
    ...
    emit_json({"requests_per_s": 3.1e6})
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
from pathlib import Path
from typing import Any

#: Where benchmarks write their figures (git-ignored).
OUT_DIR = Path(__file__).resolve().parent / "out"


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
    return value


def emit_json(figures: dict[str, Any]) -> None:
    """Print the benchmark's figures as the final JSON line on stdout."""
    print(json.dumps(_jsonable(figures), sort_keys=True), flush=True)
