"""Command line: plan a placement, simulate one, print schemas.

    python -m placement plan SPEC -o placement.json
    python -m placement simulate SPEC --placement placement.json [-o simulation.json]
    python -m placement schema         # JSON schema of the deployment spec
    python -m placement plan-schema    # JSON schema of the planning spec

SPEC is a planning spec (:mod:`placement.alpaserve.plan_spec`, JSON or YAML). Progress goes to stderr; a bad spec is
reported by its field and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

logger = logging.getLogger("placement.cli")


def _prepare(spec_path: str):
    from placement.alpaserve.plan_spec import load_plan_spec, prepare
    spec = load_plan_spec(spec_path)
    return (spec, *prepare(spec, Path(spec_path).resolve().parent))


def cmd_plan(args: argparse.Namespace) -> int:
    from placement.alpaserve.plan_spec import run_planner
    spec, profiles, names, workload = _prepare(args.spec)
    placement = run_planner(spec, profiles, names, workload)
    placement.save(args.output)
    print(placement.describe())
    print(f"search: {placement.stats.simulations} simulations, {placement.stats.candidates} candidates, "
          f"{placement.stats.wall_time_s:.2f} s; written to {args.output}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from placement.alpaserve.plan_spec import simulator_config
    from placement.alpaserve.simulator import simulate
    from placement.core.placement_plan import Placement
    spec, profiles, names, workload = _prepare(args.spec)
    placement = Placement.load(args.placement)
    placement.check_memory(profiles, spec.cluster.device_memory_bytes)
    if placement.num_devices > spec.cluster.num_devices:
        raise ValueError(f"placement uses {placement.num_devices} devices, "
                         f"cluster.num_devices={spec.cluster.num_devices}")
    result = simulate(placement, profiles, workload, simulator_config(spec))
    summary = result.summary()
    print(summary.describe())
    if args.output:
        Path(args.output).write_text(json.dumps(summary.to_dict(), indent=2, default=float))
        print(f"written to {args.output}")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from placement.core.deployment_spec import spec_json_schema
    print(spec_json_schema())
    return 0


def cmd_plan_schema(args: argparse.Namespace) -> int:
    from placement.alpaserve.plan_spec import PlanSpec
    print(json.dumps(PlanSpec.model_json_schema(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m placement", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="search a placement (AlpaServe §4.2)")
    plan.add_argument("spec", help="planning spec, JSON or YAML")
    plan.add_argument("-o", "--output", default="placement.json", help="where to write the placement JSON")
    plan.set_defaults(func=cmd_plan)
    simulate = sub.add_parser("simulate", help="simulate a placement on the spec's workload")
    simulate.add_argument("spec", help="planning spec, JSON or YAML")
    simulate.add_argument("--placement", required=True, help="placement JSON written by `plan`")
    simulate.add_argument("-o", "--output", default=None, help="write the summary as JSON here")
    simulate.set_defaults(func=cmd_simulate)
    schema = sub.add_parser("schema", help="print the deployment spec's JSON schema")
    schema.set_defaults(func=cmd_schema)
    plan_schema = sub.add_parser("plan-schema", help="print the planning spec's JSON schema")
    plan_schema.set_defaults(func=cmd_plan_schema)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
