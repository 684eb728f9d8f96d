"""Tensor-parallel (intra-op) shards of a transformer block, built from the real weights.

One shard holds `1/degree` of each split linear layer. For every linear of a block the intra-op pass
(`parallel.intra_op`, AlpaServe §4.1 / Alpa §4) picks one of three shardings:

* ``replicated``: every shard holds the whole weight and computes the whole output;
* ``column``: every shard holds a slice of the output features (for the QKV projection: a slice of the heads);
  the output is *sharded* along its last dimension;
* ``row``: every shard holds a slice of the input features; the partial outputs are summed by an all-reduce
  and the bias is added once after it; the output is *replicated*.

Between two linears the activation's layout is converted where needed: a sharded activation is all-gathered
before a linear that wants the whole input, a replicated one is sliced (free) before a row-split linear.
Residual adds and layer norms want the whole hidden state. Megatron-LM's block is the plan
`BlockShardingPlan.megatron()`: column-split Q/K/V and first MLP linear, row-split attention output and second
MLP linear, one all-reduce after each row split.

The shard modules are plain torch: collectives come from a `Collectives` object, which is a
`torch.distributed` process group inside a Ray actor (`parallel.stage_actor`) or a thread barrier in tests.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import ActivationState, Layer

LinearSharding = Literal["replicated", "column", "row"]
SHARDINGS: tuple[LinearSharding, ...] = ("replicated", "column", "row")
#: The linear layers of one transformer block, in execution order.
BLOCK_LINEARS: tuple[str, ...] = ("qkv", "attn_out", "fc1", "fc2")


class Collectives(Protocol):
    """The collectives a shard needs; `rank` is this shard's index among `degree` shards."""

    rank: int
    degree: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every shard's tensor along the last dimension, in rank order."""
        ...


class NoCollectives:
    """Degree 1: nothing to communicate."""

    rank = 0
    degree = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class ProcessGroupCollectives:
    """Collectives over the default `torch.distributed` process group (gloo on CPU, nccl on GPU)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()
        self.degree = dist.get_world_size()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        self._dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.degree)]
        self._dist.all_gather(parts, tensor)
        return torch.cat(parts, dim=-1)


class ThreadCollectives:
    """Collectives between threads of one process (tests of the sharding math without Ray).

    Create one `ThreadCollectives.group(degree)` and give member `r` to the thread running shard `r`.
    """

    def __init__(self, rank: int, degree: int, shared: "_ThreadShared"):
        self.rank = rank
        self.degree = degree
        self._shared = shared

    @staticmethod
    def group(degree: int) -> list["ThreadCollectives"]:
        shared = _ThreadShared(degree)
        return [ThreadCollectives(rank, degree, shared) for rank in range(degree)]

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        shared = self._shared
        shared.slots[self.rank] = tensor
        shared.barrier.wait()
        parts = list(shared.slots)
        shared.barrier.wait()
        return parts

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(tensor), dim=-1)


class _ThreadShared:
    def __init__(self, degree: int):
        self.slots: list[torch.Tensor | None] = [None] * degree
        self.barrier = threading.Barrier(degree)


@dataclass(frozen=True)
class BlockShardingPlan:
    """Sharding of each linear of one transformer block (the intra-op pass's decision for that block)."""

    qkv: LinearSharding = "replicated"
    attn_out: LinearSharding = "replicated"
    fc1: LinearSharding = "replicated"
    fc2: LinearSharding = "replicated"

    @staticmethod
    def megatron() -> "BlockShardingPlan":
        return BlockShardingPlan(qkv="column", attn_out="row", fc1="column", fc2="row")

    @staticmethod
    def replicated() -> "BlockShardingPlan":
        return BlockShardingPlan()

    def as_dict(self) -> dict[str, LinearSharding]:
        return {name: getattr(self, name) for name in BLOCK_LINEARS}

    def is_replicated(self) -> bool:
        return all(value == "replicated" for value in self.as_dict().values())


def _chunk(size: int, rank: int, degree: int, what: str) -> slice:
    if size % degree:
        raise ValueError(f"{what} ({size}) is not divisible by the intra-op degree {degree}")
    step = size // degree
    return slice(rank * step, (rank + 1) * step)


class ShardLinear(nn.Module):
    """One shard of a linear layer: whole, a set of output rows (column split) or a slice of inputs (row split)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sharding: LinearSharding,
                 collectives: Collectives, out_index: torch.Tensor | None = None):
        super().__init__()
        self.sharding = sharding
        self.collectives = collectives
        rank, degree = collectives.rank, collectives.degree
        if sharding == "replicated" or degree == 1:
            w, b = weight, bias
        elif sharding == "column":
            index = (out_index if out_index is not None
                     else torch.arange(weight.shape[0])[_chunk(weight.shape[0], rank, degree, "output features")])
            w = weight[index].clone()
            b = bias[index].clone() if bias is not None else None
        elif sharding == "row":
            w = weight[:, _chunk(weight.shape[1], rank, degree, "input features")].clone()
            b = bias
        else:
            raise ValueError(f"unknown sharding {sharding!r}; one of {SHARDINGS}")
        self.weight = nn.Parameter(w.detach(), requires_grad=False)
        self.bias = nn.Parameter(b.detach(), requires_grad=False) if b is not None else None
        self.in_features = weight.shape[1]

    def wants_sharded_input(self) -> bool:
        return self.sharding == "row" and self.collectives.degree > 1

    def output_sharded(self) -> bool:
        return self.sharding == "column" and self.collectives.degree > 1

    def forward(self, x: torch.Tensor, sharded: bool) -> torch.Tensor:
        """`x` is sharded along its last dimension when `sharded`; returns this shard's output."""
        c = self.collectives
        if self.wants_sharded_input():
            if not sharded:
                x = x[..., _chunk(x.shape[-1], c.rank, c.degree, "input features")]
            partial = F.linear(x, self.weight)
            out = c.all_reduce(partial)
            return out + self.bias if self.bias is not None else out
        if sharded:
            x = c.all_gather(x)
        return F.linear(x, self.weight, self.bias)


@dataclass
class BlockParts:
    """The pieces of a pre-norm (ViT) or post-norm (BERT) transformer block that sharding needs."""

    qkv_weight: torch.Tensor  # [3 * heads * head_dim, hidden], rows ordered (q|k|v, head, dim)
    qkv_bias: torch.Tensor | None
    attn_out: nn.Linear
    fc1: nn.Linear
    act: nn.Module
    fc2: nn.Linear
    num_heads: int
    head_dim: int
    scale: float
    norm_first: bool  # True: x + f(norm(x)) (ViT); False: norm(x + f(x)) (BERT)
    norm1: nn.Module
    norm2: nn.Module
    ls1: nn.Module
    ls2: nn.Module


def bert_block_parts(block: nn.Module) -> BlockParts:
    """Parts of a Hugging Face BERT layer (BertLayer)."""
    attention = block.attention.self
    q, k, v = attention.query, attention.key, attention.value
    qkv_bias = torch.cat([q.bias, k.bias, v.bias]) if q.bias is not None else None
    return BlockParts(
        qkv_weight=torch.cat([q.weight, k.weight, v.weight]).detach(),
        qkv_bias=None if qkv_bias is None else qkv_bias.detach(),
        attn_out=block.attention.output.dense, fc1=block.intermediate.dense, act=block.intermediate.intermediate_act_fn,
        fc2=block.output.dense, num_heads=attention.num_attention_heads, head_dim=attention.attention_head_size,
        scale=float(getattr(attention, "scaling", attention.attention_head_size ** -0.5)), norm_first=False,
        norm1=block.attention.output.LayerNorm, norm2=block.output.LayerNorm, ls1=nn.Identity(), ls2=nn.Identity(),
    )


def mpnet_block_parts(block: nn.Module) -> BlockParts:
    """Parts of a Hugging Face MPNet layer (MPNetLayer): its shapes for the profiler and the intra-op pass. MPNet's
    per-head relative position bias is not among them, so its blocks are never sharded (`shard_block_layer`)."""
    attention = block.attention.attn
    q, k, v = attention.q, attention.k, attention.v
    return BlockParts(
        qkv_weight=torch.cat([q.weight, k.weight, v.weight]).detach(),
        qkv_bias=torch.cat([q.bias, k.bias, v.bias]).detach(),
        attn_out=attention.o, fc1=block.intermediate.dense, act=block.intermediate.intermediate_act_fn,
        fc2=block.output.dense, num_heads=attention.num_attention_heads, head_dim=attention.attention_head_size,
        scale=attention.attention_head_size ** -0.5, norm_first=False, norm1=block.attention.LayerNorm,
        norm2=block.output.LayerNorm, ls1=nn.Identity(), ls2=nn.Identity(),
    )


def text_block_parts(block: nn.Module) -> BlockParts:
    """Parts of a text encoder's block: an MPNet layer or a BERT-family layer."""
    return mpnet_block_parts(block) if hasattr(block.attention, "attn") else bert_block_parts(block)


def vit_block_parts(block: nn.Module) -> BlockParts:
    """Parts of a timm ViT block (timm.models.vision_transformer.Block)."""
    attn, mlp = block.attn, block.mlp
    for name, module in (("attn.q_norm", attn.q_norm), ("attn.k_norm", attn.k_norm),
                         ("attn.norm", getattr(attn, "norm", nn.Identity())), ("mlp.norm", mlp.norm)):
        if not isinstance(module, nn.Identity):
            raise ValueError(f"tensor parallelism does not support a ViT block with {name} = {type(module).__name__}")
    if getattr(attn, "gate", None) is not None:
        raise ValueError("tensor parallelism does not support gated ViT attention")
    return BlockParts(
        qkv_weight=attn.qkv.weight.detach(), qkv_bias=None if attn.qkv.bias is None else attn.qkv.bias.detach(),
        attn_out=attn.proj, fc1=mlp.fc1, act=mlp.act, fc2=mlp.fc2, num_heads=attn.num_heads, head_dim=attn.head_dim,
        scale=float(attn.scale), norm_first=True, norm1=block.norm1, norm2=block.norm2, ls1=block.ls1, ls2=block.ls2,
    )


class TensorParallelBlock(nn.Module):
    """One shard of a transformer block under a `BlockShardingPlan`; every shard returns the whole output."""

    def __init__(self, parts: BlockParts, plan: BlockShardingPlan, collectives: Collectives):
        super().__init__()
        rank, degree = collectives.rank, collectives.degree
        self.plan = plan
        self.norm_first = parts.norm_first
        self.scale = parts.scale
        self.head_dim = parts.head_dim
        qkv_index = None
        self.local_heads = parts.num_heads
        if plan.qkv == "column" and degree > 1:
            heads = torch.arange(parts.num_heads)[_chunk(parts.num_heads, rank, degree, "attention heads")]
            self.local_heads = len(heads)
            rows = torch.arange(3 * parts.num_heads * parts.head_dim).view(3, parts.num_heads, parts.head_dim)
            qkv_index = rows[:, heads, :].reshape(-1)
        elif plan.qkv == "row":
            raise ValueError("the QKV projection cannot be row-split: attention needs whole query/key/value vectors")
        self.qkv = ShardLinear(parts.qkv_weight, parts.qkv_bias, plan.qkv, collectives, out_index=qkv_index)
        self.attn_out = ShardLinear(parts.attn_out.weight, parts.attn_out.bias, plan.attn_out, collectives)
        self.fc1 = ShardLinear(parts.fc1.weight, parts.fc1.bias, plan.fc1, collectives)
        self.act = parts.act
        self.fc2 = ShardLinear(parts.fc2.weight, parts.fc2.bias, plan.fc2, collectives)
        self.norm1, self.norm2, self.ls1, self.ls2 = parts.norm1, parts.norm2, parts.ls1, parts.ls2
        self.collectives = collectives

    def _whole(self, x: torch.Tensor, sharded: bool) -> torch.Tensor:
        return self.collectives.all_gather(x) if sharded else x

    def _attention(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        qkv = self.qkv(x, sharded=False)
        q, k, v = qkv.view(batch, tokens, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale)
        context = context.transpose(1, 2).reshape(batch, tokens, self.local_heads * self.head_dim)
        out = self.attn_out(context, sharded=self.qkv.output_sharded())
        return self._whole(out, self.attn_out.output_sharded())

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.fc1(x, sharded=False))
        out = self.fc2(hidden, sharded=self.fc1.output_sharded())
        return self._whole(out, self.fc2.output_sharded())

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.norm_first:
            x = x + self.ls1(self._attention(self.norm1(x), bias))
            return x + self.ls2(self._mlp(self.norm2(x)))
        x = self.norm1(x + self._attention(x, bias))
        return self.norm2(x + self._mlp(x))


class TensorParallelBlockLayer(Layer):
    """A `TensorParallelBlock` behind the layer-view interface (`models.layers.Layer`)."""

    kind = "block"

    def __init__(self, block: TensorParallelBlock, uses_attention_bias: bool):
        super().__init__()
        self.block = block
        self.uses_attention_bias = uses_attention_bias

    def forward(self, state: ActivationState) -> ActivationState:
        bias = state.attention_bias if self.uses_attention_bias else None
        hidden = self.block(state.hidden, bias)
        return ActivationState(hidden=hidden, attention_mask=state.attention_mask,
                               attention_bias=state.attention_bias, extras=state.extras)

