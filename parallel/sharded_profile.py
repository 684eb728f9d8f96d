"""Sharded-block profile: each transformer block's latency Megatron-sharded over `degree` Ray actors, by running it.

AlpaServe §4.1 keeps Alpa's two passes, in which "the inter-op pass ... calls the intra-op pass for each potential
pipeline stage ... to profile its latency with the optimal intra-op parallel plan", and profiles only the K layers
(latency(i, k) is the sum over layers i..k). `parallel.profiler.profile_layers` times each layer whole on one
device; this module times each block the way an intra-op stage runs it: `degree` actors, one thread each, every
block split by `BlockShardingPlan.megatron()` with gloo (CPU) collectives between the shards, the blocks run in
whole passes as a stage runs them. The intra-op pass learns from it what a collective costs between computations
(`parallel.intra_op.calibrate_collectives`), which two all-reduces timed back to back do not show.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from parallel.profiler import CommProbe, ModelLayerProfile, interleaved_layer_times, shape_key
from parallel.stage_layers import ModelSource, example_input, load_model, shard_block_layer, standalone_layers
from parallel.tensor_parallel import BlockShardingPlan, ProcessGroupCollectives

logger = logging.getLogger(__name__)

#: Logical CPUs each probe actor asks Ray for (one thread each).
SHARDED_PROBE_NUM_CPUS = 0.5


class ShardedBlockProbe(CommProbe):
    """A Ray actor body: one shard of every block of a model, timed in passes over the blocks."""

    def time_sharded_blocks(self, source_json: str, shapes: Sequence[tuple[int, int | None]], warmup: int,
                            repeats: int) -> dict[str, dict[int, float]]:
        """'<batch>x<tokens>' -> block index -> median seconds of this shard's forward of the block (each ends in an
        all-reduce, so every shard of the group measures about the same)."""
        source = ModelSource.model_validate_json(source_json)
        model = load_model(source)
        layers = standalone_layers(model)
        collectives = ProcessGroupCollectives()
        blocks = [index for index, layer in enumerate(layers) if layer.kind == "block"]
        sharded = [shard_block_layer(layers[index], source.kind, BlockShardingPlan.megatron(), collectives).eval()
                   for index in blocks]
        result: dict[str, dict[int, float]] = {}
        for batch, seq in shapes:
            with torch.inference_mode():
                inputs = [example_input(model, batch, seq)]  # the same seed on every shard: the same input
                for layer in layers[:blocks[-1]]:
                    inputs.append(layer(inputs[-1]))
                tokens = inputs[1].hidden.shape[1]
                seconds = interleaved_layer_times(sharded, [inputs[index] for index in blocks], warmup, repeats)
            result[shape_key(batch, tokens if seq is None else seq)] = dict(zip(blocks, seconds))
        return result


def profile_sharded_blocks(profile: ModelLayerProfile, degrees: Sequence[int] = (2,), warmup: int = 2,
                           repeats: int = 5, num_cpus_per_actor: float = SHARDED_PROBE_NUM_CPUS) -> ModelLayerProfile:
    """Time every block of `profile`'s model Megatron-sharded over each degree >= 2 at every profiled shape, and
    return the profile with `sharded_latency_s` filled in (Ray must be up). A degree the model's blocks do not
    divide by (heads, widths) is skipped with a warning."""
    import ray

    probe = ray.remote(ShardedBlockProbe)
    vision = profile.tokens_per_sequence is not None
    shapes = [(batch, None if vision else tokens) for batch, tokens in profile.shapes()]
    layers = [layer.model_copy(deep=True) for layer in profile.layers]
    for degree in sorted({d for d in degrees if d >= 2}):
        actors = [probe.options(num_cpus=num_cpus_per_actor).remote(rank, degree) for rank in range(degree)]
        try:
            address, port = ray.get(actors[0].rendezvous_address.remote())
            ray.get([actor.init_group.remote(address, port) for actor in actors])
            per_rank = ray.get([actor.time_sharded_blocks.remote(profile.source.model_dump_json(), shapes, warmup,
                                                                 repeats) for actor in actors])
        except ray.exceptions.RayTaskError as error:
            if not isinstance(error.cause, ValueError):
                raise
            logger.warning("%s: blocks not profiled sharded over %d actors: %s", profile.name, degree, error.cause)
            continue
        finally:
            for actor in actors:
                ray.kill(actor)
        for key, blocks in per_rank[0].items():
            for index in blocks:
                layers[index].sharded_latency_s.setdefault(degree, {})[key] = max(rank[key][index] for rank in per_rank)
                layers[index].sharded_samples.setdefault(degree, {})[key] = repeats
            total = sum(layers[i].sharded_latency_s[degree][key] for i in blocks)
            whole = sum(layers[i].latency_s.get(key, 0.0) for i in blocks)
            logger.info("%s: blocks at %s sharded over %d actors %.2f ms (whole, one actor %.2f ms)", profile.name,
                        key, degree, 1e3 * total, 1e3 * whole)
    return profile.model_copy(update={"layers": layers})

