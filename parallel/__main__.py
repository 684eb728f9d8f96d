"""Profiling and configuration CLI of the auto-parallelizer.

    # measure layers (whole, and each block sharded over each --comm-degrees; sends and collectives between Ray
    # actors); repeated runs merge into the same file
    python -m parallel profile --text package:all-minilm-l6-v2 --name all-minilm-l6-v2 \\
        --batch-sizes 1 2 4 --seq-lens 32 64 --comm-degrees 2 --out profiles/layers.json
    python -m parallel profile --vision timm:vit_tiny_patch16_224 --checkpoint vit.pt --image-size-px 32 \\
        --num-classes 10 --name vit-tiny --batch-sizes 1 2 4 --no-comm --out profiles/layers.json

    # run both passes for every (intra-op degree, pipeline stages) of the given group sizes
    python -m parallel configs --layers profiles/layers.json --group-sizes 1 2 4 \\
        --seq-len all-minilm-l6-v2=32 --memory-budget-bytes 16e9 --out profiles/measured.json

    # every model of a deployment spec, both steps in one (parallel/spec_profiles.py)
    python -m parallel profile-spec configs/many_models.yaml --out configs/profiles/many-models-measured.json

`configs` and `profile-spec` write a `placement.core.profiles.ProfileSet` (source 'measured'), each configuration with
the plan the passes chose (stage layer boundaries, shard layout) that group replicas run, and prints one line per
configuration.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

from parallel.stage_layers import ModelSource

logger = logging.getLogger("parallel")

#: Logical CPUs the profiler declares to a Ray it starts itself.
PROFILER_RAY_NUM_CPUS = 4


def _profile(args: argparse.Namespace) -> int:
    from parallel.profiler import LayerProfileSet, device_description, now_utc, profile_comm, profile_layers
    from parallel.sharded_profile import profile_sharded_blocks

    models = {}
    if args.text or args.vision:
        if args.text:
            source = ModelSource(name=args.name or args.text, kind="text", source=args.text)
        else:
            source = ModelSource(name=args.name or args.vision, kind="vision", source=args.vision,
                                 checkpoint_path=args.checkpoint, num_classes=args.num_classes,
                                 image_size_px=args.image_size_px)
        profile = profile_layers(source, args.batch_sizes, args.seq_lens, repeats=args.repeats)
        models[source.name] = profile
    comm = None
    if not args.no_comm:
        import ray

        started = not ray.is_initialized()
        if started:
            ray.init(num_cpus=PROFILER_RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False)
        try:
            comm = profile_comm(args.comm_degrees, repeats=args.repeats)
            for name, profile in models.items():  # each block as an intra-op stage runs it, per degree
                models[name] = profile_sharded_blocks(profile, args.comm_degrees, repeats=args.repeats)
        finally:
            if started:
                ray.shutdown()
    run = LayerProfileSet(device=device_description(), models=models, comm=comm, updated=now_utc())
    merged = run.save_merged(args.out)
    print(f"{args.out}: models {sorted(merged.models)}, comm {'yes' if merged.comm else 'no'}")
    return 0


def _configs(args: argparse.Namespace) -> int:
    from parallel.configurations import emit_profile_set
    from parallel.profiler import LayerProfileSet

    layers = LayerProfileSet.load(args.layers)
    seq_lens = {}
    for item in args.seq_len or []:
        name, _, value = item.partition("=")
        if not value.isdigit():
            raise SystemExit(f"--seq-len wants NAME=TOKENS, got {item!r}")
        seq_lens[name] = int(value)
    profiles = emit_profile_set(layers, args.group_sizes, seq_lens, args.memory_budget_bytes)
    profiles.save(args.out)
    for name, model in profiles.models.items():
        for config in model.configs:
            batch = min(config.stages[0].latency_s)
            print(f"{name:24s} {config.config.key():10s} latency {1e3 * config.latency(batch):8.3f} ms  "
                  f"period {1e3 * config.max_stage_latency(batch):8.3f} ms  "
                  f"weights/device {config.weight_bytes_per_device() / 2**20:8.2f} MiB  (batch {batch})")
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="measure layers and communication; merges into --out")
    p.add_argument("--text", help="text model source (package:all-minilm-l6-v2 or a local HF directory)")
    p.add_argument("--vision", help="vision model source, timm:<arch>")
    p.add_argument("--checkpoint", help="vision checkpoint file")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--image-size-px", type=int, default=224)
    p.add_argument("--name", help="model name in the profile (default: the source)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[32], help="text: sequence lengths in tokens")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--comm-degrees", type=int, nargs="+", default=[2])
    p.add_argument("--no-comm", action="store_true", help="skip sends, collectives and sharded blocks (no Ray)")
    p.add_argument("--out", required=True)
    c = sub.add_parser("configs", help="both passes for every configuration; writes a ProfileSet")
    c.add_argument("--layers", required=True, help="layer profile file written by `profile`")
    c.add_argument("--group-sizes", type=int, nargs="+", default=[1, 2, 4])
    c.add_argument("--seq-len", nargs="*", help="NAME=TOKENS: sequence length to plan text models at")
    c.add_argument("--memory-budget-bytes", type=float, default=math.inf)
    c.add_argument("--out", required=True)
    from parallel import spec_profiles

    ps = sub.add_parser("profile-spec", help="profiles of every model of a deployment spec, for its planner")
    spec_profiles.add_arguments(ps)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if args.command == "profile":
        if args.text and args.vision:
            parser.error("give --text or --vision, not both")
        if not (args.text or args.vision) and args.no_comm:
            parser.error("nothing to profile: give --text/--vision, or drop --no-comm")
        return _profile(args)
    if args.command == "profile-spec":
        return spec_profiles.run(args)
    return _configs(args)


if __name__ == "__main__":
    sys.exit(main())
