"""Deep visual prompt tokens (VPT-deep): insert a layer's prompts, drop them again before the MLP.

VPT (Jia et al., ECCV'22, §3.2 "VPT-Deep") prepends learned prompt tokens to the input of every block; the prompts
of layer i+1 replace the outputs at the prompt positions of layer i. OTAS (otas-v2 §II-B, §III-B, Fig. 3a) uses
them for gamma > 0 with gamma prompts per layer. Because a layer's prompt outputs are thrown away by the next
layer, the prompts only serve as keys and values of the attention: their rows can be dropped right after the
attention, before the MLP, which is exactly VPT-deep and cheaper.

Prompts are per sample ([B, P, C]) so that one batch can mix tasks, each sample carrying its own task's prompts.
"""

from __future__ import annotations

import torch


def insert_prompts(x: torch.Tensor, prompts: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """[B, N, C] + prompts [B, P, C] (or [P, C] shared) -> [B, N + P, C] with the prompts after the prefix tokens."""
    if prompts.dim() == 2:
        prompts = prompts.unsqueeze(0).expand(x.shape[0], -1, -1)
    if prompts.dim() != 3 or prompts.shape[0] != x.shape[0] or prompts.shape[2] != x.shape[2]:
        raise ValueError(f"prompts must be [batch={x.shape[0]}, count, channels={x.shape[2]}], got "
                         f"{list(prompts.shape)}")
    return torch.cat([x[:, :num_prefix_tokens], prompts.to(x.dtype), x[:, num_prefix_tokens:]], dim=1)


def drop_prompts(x: torch.Tensor, num_prompts: int, num_prefix_tokens: int) -> torch.Tensor:
    """Inverse of `insert_prompts`: remove the `num_prompts` rows that follow the prefix tokens."""
    return torch.cat([x[:, :num_prefix_tokens], x[:, num_prefix_tokens + num_prompts:]], dim=1)
