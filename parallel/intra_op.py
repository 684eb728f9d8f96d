"""Intra-op pass: choose a sharding for every linear layer of a pipeline stage by integer programming.

Alpa's intra-op pass (Zheng et al., OSDI'22, §4.2, Eq. 1) picks one parallel algorithm per operator with an ILP
that minimises compute + communication cost of the chosen algorithms plus the resharding cost on every edge
between them, with a one-hot vector s_v per operator and edge variables e_vu = s_v s_u^T linearised. AlpaServe
(§4.1) drops every data-parallel algorithm (replication across requests is the placement's job), which leaves,
for a linear layer on `degree` devices: ``replicated``, ``column`` (split output features) and ``row`` (split
input features, all-reduce after). A per-device memory budget bounds the weight bytes the chosen shardings keep.

The model of one stage is a list of segments; a segment is a chain of linears between two points that need the
whole hidden state (residual add + layer norm), e.g. ``qkv -> attn_out`` and ``fc1 -> fc2`` of a transformer
block. Costs come from the profile: a block's measured latency is attributed to its linears in proportion to
their FLOPs (the attention core to the QKV projection, the activation to the first MLP linear), and collectives
are priced by the fitted alpha-beta model (`parallel.comm_model`). Where a block was also run sharded on the stage's
devices (`parallel.sharded_profile`), its collectives are repriced from that run (`calibrate_collectives`).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, replace
from typing import Sequence

import cvxpy as cp
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from parallel.comm_model import CommModel
from parallel.tensor_parallel import SHARDINGS, BlockShardingPlan, LinearSharding

logger = logging.getLogger(__name__)

#: Solver statuses accepted as solved.
_SOLVED = (cp.OPTIMAL, cp.OPTIMAL_INACCURATE)


@dataclass(frozen=True)
class LinearNode:
    """One linear layer as the ILP sees it."""

    name: str
    compute_s: float  # latency of the whole (unsharded) linear
    follow_compute_s: float  # the op after it that works in its output layout (attention core, activation)
    weight_bytes: int  # the weight matrix
    bias_bytes: int
    output_bytes: int  # the whole tensor the next linear consumes (after the following op)
    allowed: tuple[LinearSharding, ...] = SHARDINGS
    #: What each collective on this linear's output costs beyond the alpha-beta fit, learnt from running its
    #: block sharded (`calibrate_collectives`; may be negative); 0 when the block was not run sharded.
    collective_extra_s: float = 0.0


@dataclass(frozen=True)
class Segment:
    """A chain of linears whose input and output must be whole (replicated) on every shard."""

    nodes: tuple[LinearNode, ...]


@dataclass
class IntraOpProblem:
    """One stage on `degree` devices."""

    segments: list[Segment]
    degree: int
    comm: CommModel
    memory_budget_bytes: float
    fixed_compute_s: float = 0.0  # work every shard repeats (embeddings, norms, head)
    fixed_memory_bytes: int = 0  # weights every shard holds whole (embeddings, norms)


@dataclass
class IntraOpSolution:
    choices: dict[str, LinearSharding]
    latency_s: float
    memory_bytes: float

    def block_plan(self, prefix: str) -> BlockShardingPlan:
        """The plan of the block whose node names start with `prefix` (e.g. 'layer3.')."""
        return BlockShardingPlan(**{name: self.choices[f"{prefix}{name}"]
                                    for name in ("qkv", "attn_out", "fc1", "fc2")})


# ---- costs of one choice (shared by the ILP and by direct evaluation) ----

def _collective_s(base_s: float, node: LinearNode) -> float:
    return max(0.0, base_s + node.collective_extra_s)


def node_cost_s(node: LinearNode, sharding: LinearSharding, problem: IntraOpProblem) -> float:
    d = problem.degree
    if sharding == "replicated" or d == 1:
        return node.compute_s + node.follow_compute_s
    if sharding == "column":
        return (node.compute_s + node.follow_compute_s) / d
    return node.compute_s / d + _collective_s(problem.comm.all_reduce_s(node.output_bytes, d), node) + \
        node.follow_compute_s


def node_memory_bytes(node: LinearNode, sharding: LinearSharding, degree: int) -> float:
    if sharding == "replicated" or degree == 1:
        return node.weight_bytes + node.bias_bytes
    if sharding == "column":
        return (node.weight_bytes + node.bias_bytes) / degree
    return node.weight_bytes / degree + node.bias_bytes


def _output_sharded(sharding: LinearSharding, degree: int) -> bool:
    return sharding == "column" and degree > 1


def edge_cost_s(producer: LinearNode, produced: LinearSharding, consumed: LinearSharding,
                problem: IntraOpProblem) -> float:
    """Resharding between consecutive linears: a sharded activation is all-gathered unless the consumer is row-split."""
    if _output_sharded(produced, problem.degree) and consumed != "row":
        return _collective_s(problem.comm.all_gather_s(producer.output_bytes, problem.degree), producer)
    return 0.0


def end_cost_s(node: LinearNode, sharding: LinearSharding, problem: IntraOpProblem) -> float:
    """A segment's output must be whole."""
    return (_collective_s(problem.comm.all_gather_s(node.output_bytes, problem.degree), node)
            if _output_sharded(sharding, problem.degree) else 0.0)


def evaluate(problem: IntraOpProblem, choices: dict[str, LinearSharding]) -> IntraOpSolution:
    """Latency and memory of one assignment, by walking every segment (what the ILP optimises)."""
    latency = problem.fixed_compute_s
    memory = float(problem.fixed_memory_bytes)
    for segment in problem.segments:
        previous: LinearNode | None = None
        for node in segment.nodes:
            sharding = choices[node.name]
            latency += node_cost_s(node, sharding, problem)
            memory += node_memory_bytes(node, sharding, problem.degree)
            if previous is not None:
                latency += edge_cost_s(previous, choices[previous.name], sharding, problem)
            previous = node
        if previous is not None:
            latency += end_cost_s(previous, choices[previous.name], problem)
    return IntraOpSolution(choices=dict(choices), latency_s=latency, memory_bytes=memory)


def enumerate_optimum(problem: IntraOpProblem) -> IntraOpSolution | None:
    """Brute force over every assignment (small problems; the reference the ILP is tested against)."""
    nodes = [node for segment in problem.segments for node in segment.nodes]
    best: IntraOpSolution | None = None
    for combo in itertools.product(*(node.allowed for node in nodes)):
        solution = evaluate(problem, {node.name: choice for node, choice in zip(nodes, combo)})
        if solution.memory_bytes > problem.memory_budget_bytes:
            continue
        if best is None or solution.latency_s < best.latency_s - 1e-15:
            best = solution
    return best


def solve_intra_op(problem: IntraOpProblem) -> IntraOpSolution | None:
    """Alpa §4.2 Eq. 1 without data parallelism: the min-cost sharding under the memory budget, by MILP (HiGHS).

    Returns None when no assignment fits the memory budget.
    """
    nodes = [node for segment in problem.segments for node in segment.nodes]
    if problem.degree == 1 or not nodes:
        solution = evaluate(problem, {node.name: "replicated" for node in nodes})
        return solution if solution.memory_bytes <= problem.memory_budget_bytes else None
    s = {node.name: cp.Variable(len(node.allowed), boolean=True, name=f"s_{i}") for i, node in enumerate(nodes)}
    constraints = [cp.sum(var) == 1 for var in s.values()]
    cost = problem.fixed_compute_s
    memory = float(problem.fixed_memory_bytes)
    for node in nodes:
        c = np.array([node_cost_s(node, choice, problem) for choice in node.allowed])
        m = np.array([node_memory_bytes(node, choice, problem.degree) for choice in node.allowed])
        cost = cost + c @ s[node.name]
        memory = memory + m @ s[node.name]
    for segment in problem.segments:
        for producer, consumer in zip(segment.nodes, segment.nodes[1:]):
            r = np.array([[edge_cost_s(producer, a, b, problem) for b in consumer.allowed] for a in producer.allowed])
            # e_vu = s_v s_u^T: with one-hot s, the row/column sums pin e to the product (Alpa's linearisation).
            e = cp.Variable(r.shape, nonneg=True)
            constraints += [cp.sum(e, axis=1) == s[producer.name], cp.sum(e, axis=0) == s[consumer.name]]
            cost = cost + cp.sum(cp.multiply(r, e))
        last = segment.nodes[-1]
        cost = cost + np.array([end_cost_s(last, choice, problem) for choice in last.allowed]) @ s[last.name]
    constraints.append(memory <= problem.memory_budget_bytes)
    ilp = cp.Problem(cp.Minimize(cost), constraints)
    ilp.solve(solver=cp.HIGHS)
    if ilp.status not in _SOLVED:
        logger.debug("intra-op ILP status %s (degree %d, budget %.0f bytes)", ilp.status, problem.degree,
                     problem.memory_budget_bytes)
        return None
    choices = {node.name: node.allowed[int(np.argmax(s[node.name].value))] for node in nodes}
    return evaluate(problem, choices)


# ---- building the problem of transformer blocks from a profile ----

class BlockShape(BaseModel):
    """Shapes of a transformer block, enough to price its linears."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(ge=1, description="Hidden width.")
    num_heads: int = Field(ge=1, description="Attention heads.")
    head_dim: int = Field(ge=1, description="Width of one head.")
    intermediate_size: int = Field(ge=1, description="Width of the MLP's hidden layer.")
    has_bias: bool = Field(default=True, description="Whether the linears have biases.")
    dtype_bytes: int = Field(default=4, ge=1, description="Bytes per element (4 for fp32).")


@dataclass(frozen=True)
class BlockCost:
    """What the intra-op pass needs of one block: its shape, its measured latency and its non-linear weights."""

    prefix: str
    shape: BlockShape
    latency_s: float
    other_weight_bytes: int  # layer norms etc., kept whole
    batch_size: int
    tokens_per_sequence: int
    #: The block's latency Megatron-sharded on the stage's `degree` devices, timed by running it there
    #: (`parallel.sharded_profile`); None: not measured (its collectives cost the alpha-beta fit alone).
    sharded_latency_s: float | None = None


def _divisible_shardings(out_features: int, in_features: int, degree: int) -> tuple[LinearSharding, ...]:
    allowed: list[LinearSharding] = ["replicated"]
    if out_features % degree == 0:
        allowed.append("column")
    if in_features % degree == 0:
        allowed.append("row")
    return tuple(allowed)


def block_segments(block: BlockCost, degree: int, comm: CommModel | None = None) -> list[Segment]:
    """The two segments of a transformer block, with its measured latency split in proportion to FLOPs; with its
    sharded latency measured (and `comm`), its collectives priced as `calibrate_collectives` learns them."""
    sh = block.shape
    tokens = block.batch_size * block.tokens_per_sequence
    inner = sh.num_heads * sh.head_dim
    flops = {
        "qkv": 2.0 * tokens * sh.hidden_size * 3 * inner,
        "core": 4.0 * block.batch_size * sh.num_heads * sh.head_dim * block.tokens_per_sequence ** 2,
        "attn_out": 2.0 * tokens * inner * sh.hidden_size,
        "fc1": 2.0 * tokens * sh.hidden_size * sh.intermediate_size,
        "act": 1.0 * tokens * sh.intermediate_size,
        "fc2": 2.0 * tokens * sh.intermediate_size * sh.hidden_size,
    }
    per_flop = block.latency_s / sum(flops.values())
    b = sh.dtype_bytes

    def node(name: str, follow: str | None, out_f: int, in_f: int, consumed_width: int, allowed) -> LinearNode:
        return LinearNode(name=f"{block.prefix}{name}", compute_s=flops[name] * per_flop,
                          follow_compute_s=flops[follow] * per_flop if follow else 0.0,
                          weight_bytes=out_f * in_f * b, bias_bytes=out_f * b if sh.has_bias else 0,
                          output_bytes=tokens * consumed_width * b, allowed=allowed)

    heads_split = sh.num_heads % degree == 0
    qkv_allowed: tuple[LinearSharding, ...] = ("replicated", "column") if heads_split else ("replicated",)
    attn = Segment(nodes=(
        node("qkv", "core", 3 * inner, sh.hidden_size, inner, qkv_allowed),
        node("attn_out", None, sh.hidden_size, inner, sh.hidden_size,
             _divisible_shardings(sh.hidden_size, inner, degree)),
    ))
    mlp = Segment(nodes=(
        node("fc1", "act", sh.intermediate_size, sh.hidden_size, sh.intermediate_size,
             _divisible_shardings(sh.intermediate_size, sh.hidden_size, degree)),
        node("fc2", None, sh.hidden_size, sh.intermediate_size, sh.hidden_size,
             _divisible_shardings(sh.hidden_size, sh.intermediate_size, degree)),
    ))
    segments = [attn, mlp]
    if block.sharded_latency_s is not None and comm is not None and degree > 1:
        segments = calibrate_collectives(segments, block.prefix, block.sharded_latency_s, degree, comm)
    return segments


def calibrate_collectives(segments: list[Segment], prefix: str, sharded_latency_s: float, degree: int,
                          comm: CommModel) -> list[Segment]:
    """The block's `segments` with every collective repriced so that its Megatron plan costs what running the block
    sharded measured. AlpaServe §4.1 profiles each of the K layers with the plan of the intra-op pass and sums them
    into latency(i, k), where Alpa's profiler runs the compiled stage; the composition of per-operator estimates --
    1/degree of each linear's compute plus alpha-beta all-reduces timed back to back -- misses what a collective
    costs between computations: it waits for the slower shard, its peer wakes from a blocking read, and both shards
    compute at once on shared cores. The difference between the measured and the composed Megatron latency is spread
    over its collectives (`collective_extra_s` of every linear of the block), so every plan the ILP weighs pays it
    per collective it has."""
    megatron = {f"{prefix}{name}": choice for name, choice in BlockShardingPlan.megatron().as_dict().items()}
    nodes = {node.name: node for segment in segments for node in segment.nodes}
    if set(megatron) != set(nodes) or any(megatron[name] not in node.allowed for name, node in nodes.items()):
        return segments  # the Megatron plan does not divide this block; nothing was measured to learn from
    problem = IntraOpProblem(segments=segments, degree=degree, comm=comm, memory_budget_bytes=float("inf"))
    composed = evaluate(problem, megatron).latency_s
    collectives = sum(1 for choice in megatron.values() if choice == "row")
    extra = (sharded_latency_s - composed) / collectives
    return [Segment(nodes=tuple(replace(node, collective_extra_s=extra) for node in segment.nodes))
            for segment in segments]


@dataclass
class StageCost:
    """Everything of one stage for the intra-op pass: its blocks and the replicated rest."""

    blocks: list[BlockCost] = field(default_factory=list)
    other_latency_s: float = 0.0
    other_weight_bytes: int = 0


def stage_problem(stage: StageCost, degree: int, comm: CommModel, memory_budget_bytes: float) -> IntraOpProblem:
    segments = [segment for block in stage.blocks for segment in block_segments(block, degree, comm)]
    return IntraOpProblem(segments=segments, degree=degree, comm=comm, memory_budget_bytes=memory_budget_bytes,
                          fixed_compute_s=stage.other_latency_s,
                          fixed_memory_bytes=stage.other_weight_bytes + sum(b.other_weight_bytes for b in stage.blocks))


def plans_of(solution: IntraOpSolution, prefixes: Sequence[str]) -> list[BlockShardingPlan]:
    return [solution.block_plan(prefix) for prefix in prefixes]
