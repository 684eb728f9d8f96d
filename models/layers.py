"""A model seen as an ordered list of layers, the unit that pipeline stages are cut from.

Every served model exposes `layers()`: embeddings first, then its transformer blocks, then its head. A layer maps
an `ActivationState` to the next one, so running the list in order is the model's forward pass, and running a
contiguous slice of it is one pipeline stage (`parallel/`). The state carries only tensors, so it can cross
process boundaries between Ray actors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
from torch import nn

LayerKind = Literal["embeddings", "block", "head"]


@dataclass
class ActivationState:
    """What flows between layers: the hidden states and the tensors later layers need beside them."""

    hidden: torch.Tensor
    #: Text models: [batch, tokens] with 1 for real tokens and 0 for padding (pooling uses it).
    attention_mask: torch.Tensor | None = None
    #: Additive float mask broadcastable to [batch, heads, query, key] for the attention of every block.
    attention_bias: torch.Tensor | None = None
    #: Anything else a model needs to carry (all tensors), e.g. token sizes for token merging.
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device) -> "ActivationState":
        """The same state with every tensor on `device` (no copies for tensors already there)."""
        def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return tensor.to(device) if tensor is not None else None

        return ActivationState(hidden=move(self.hidden), attention_mask=move(self.attention_mask),
                               attention_bias=move(self.attention_bias),
                               extras={key: move(value) for key, value in self.extras.items()})


class Layer(nn.Module):
    """One entry of a model's layer view."""

    kind: LayerKind = "block"

    def forward(self, state: ActivationState) -> ActivationState:  # pragma: no cover - interface
        raise NotImplementedError


def run_layers(layers: Sequence[Layer], state: ActivationState) -> ActivationState:
    """Run a contiguous slice of a layer view: the forward pass of one pipeline stage."""
    for layer in layers:
        state = layer(state)
    return state


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers: its weight memory."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
