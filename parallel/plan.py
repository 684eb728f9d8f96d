"""A model-parallel plan: which layers each pipeline stage runs and how each block is sharded.

The passes (`parallel.configurations`) produce it; the runtime (`parallel.group_runtime`) executes it. It is plain
data, serialisable to JSON, so a plan can be printed, stored and shipped to Ray actors.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from parallel.tensor_parallel import BLOCK_LINEARS, BlockShardingPlan, LinearSharding

logger = logging.getLogger(__name__)

#: Where a running model's stage cuts come from: the plan stored with its profile, or `ParallelPlan.even`.
PlanOrigin = Literal["planned", "even"]


class StagePlan(BaseModel):
    """Layers [start_layer, end_layer) of the layer view, and the sharding of each block among them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start_layer: int = Field(ge=0, description="First layer of the stage (index in the model's layer view).")
    end_layer: int = Field(ge=1, description="One past the stage's last layer.")
    block_shardings: dict[int, dict[str, LinearSharding]] = Field(
        default_factory=dict,
        description="Layer index -> sharding of qkv/attn_out/fc1/fc2; missing blocks are replicated.")

    @model_validator(mode="after")
    def _check(self) -> "StagePlan":
        if self.end_layer <= self.start_layer:
            raise ValueError(f"end_layer ({self.end_layer}) must exceed start_layer ({self.start_layer})")
        for index, sharding in self.block_shardings.items():
            if not self.start_layer <= index < self.end_layer:
                raise ValueError(f"block_shardings[{index}] is outside the stage [{self.start_layer}, "
                                 f"{self.end_layer})")
            unknown = set(sharding) - set(BLOCK_LINEARS)
            if unknown:
                raise ValueError(f"block_shardings[{index}] names unknown linears {sorted(unknown)}; known: "
                                 f"{BLOCK_LINEARS}")
        return self

    def block_plans(self) -> dict[int, BlockShardingPlan]:
        return {index: BlockShardingPlan(**sharding) for index, sharding in self.block_shardings.items()}


class ParallelPlan(BaseModel):
    """A model split into `len(stages)` pipeline stages of `intra_op_degree` tensor-parallel shards each."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    intra_op_degree: int = Field(default=1, ge=1, description="Shards per stage (tensor parallelism).")
    stages: list[StagePlan] = Field(min_length=1, description="Contiguous stages covering the layer view in order.")

    @model_validator(mode="after")
    def _check(self) -> "ParallelPlan":
        if self.stages[0].start_layer != 0:
            raise ValueError("the first stage must start at layer 0")
        for before, after in zip(self.stages, self.stages[1:]):
            if before.end_layer != after.start_layer:
                raise ValueError(f"stages must be contiguous: one ends at {before.end_layer}, the next starts at "
                                 f"{after.start_layer}")
        return self

    @property
    def num_layers(self) -> int:
        return self.stages[-1].end_layer

    @property
    def num_actors(self) -> int:
        return len(self.stages) * self.intra_op_degree

    @staticmethod
    def even(num_layers: int, pipeline_stages: int = 1, intra_op_degree: int = 1,
             megatron: bool = True) -> "ParallelPlan":
        """Layers dealt out evenly (a baseline, not the DP's optimum); blocks Megatron-sharded when degree > 1."""
        if not 1 <= pipeline_stages <= num_layers:
            raise ValueError(f"pipeline_stages must be in [1, {num_layers}], got {pipeline_stages}")
        cuts = [round(i * num_layers / pipeline_stages) for i in range(pipeline_stages + 1)]
        sharding = BlockShardingPlan.megatron().as_dict() if megatron and intra_op_degree > 1 else None
        stages = []
        for start, end in zip(cuts, cuts[1:]):
            shardings = {i: dict(sharding) for i in range(start, end)} if sharding else {}
            stages.append(StagePlan(start_layer=start, end_layer=end, block_shardings=shardings))
        return ParallelPlan(intra_op_degree=intra_op_degree, stages=stages)


def stored_or_even(stored: dict[str, Any] | None, num_layers: int, pipeline_stages: int,
                   intra_op_degree: int) -> tuple[ParallelPlan, PlanOrigin]:
    """The plan `python -m parallel configs` stored with a model's profile (ParallelPlan JSON) when there is one that
    fits the model (`num_layers`) and the configuration, with origin "planned"; else `ParallelPlan.even`, origin
    "even" (a stored plan that does not fit, e.g. a stale profile file, is logged and ignored)."""
    if stored is not None:
        plan = ParallelPlan.model_validate(stored)
        if (plan.num_layers, len(plan.stages), plan.intra_op_degree) == (num_layers, pipeline_stages, intra_op_degree):
            return plan, "planned"
        logger.warning("stored plan (%d layers, %d stages x %d shards) does not fit the model (%d layers, "
                       "%d stages x %d shards); cutting it evenly", plan.num_layers, len(plan.stages),
                       plan.intra_op_degree, num_layers, pipeline_stages, intra_op_degree)
    return ParallelPlan.even(num_layers, pipeline_stages=pipeline_stages, intra_op_degree=intra_op_degree), "even"
