"""The block-diagonal attention mask of ConcatBatching (TCB §4.1.2, Eq. 5-6), in the form the attention needs.

TCB Eq. 6: M is 0 on the blocks Q_i K_i^T of a request with itself and -inf elsewhere, so no token attends to
another request. Padding tokens form a block of their own (they attend only to padding), which keeps every
softmax row finite and never touches a real token.

transformers' attention implementations read a mask differently:
- eager adds the mask to the scores (`attn_weights + attention_mask`): only an additive float mask is correct;
  a boolean mask would be added as 0/1 and silently let requests attend to each other.
- sdpa hands the mask to `torch.nn.functional.scaled_dot_product_attention`: a boolean mask (True = attend) and an
  additive float mask are both correct.
"""

from __future__ import annotations

from typing import Literal

import torch

MaskKind = Literal["additive", "bool"]
#: Attention implementations and the mask kinds that are correct for them.
CORRECT_MASK_KINDS: dict[str, tuple[MaskKind, ...]] = {"eager": ("additive",), "sdpa": ("bool", "additive")}


def block_diagonal_mask(segment_ids: torch.Tensor, kind: MaskKind = "additive",
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[rows, tokens] segment ids -> [rows, 1, tokens, tokens] mask: a token attends only to its own segment.

    kind 'bool': True where attention is allowed (sdpa). kind 'additive': 0 where allowed, the dtype's most
    negative value elsewhere (eager and sdpa), as TCB Eq. 6's -inf.
    """
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    if kind == "bool":
        return same[:, None]
    if kind == "additive":
        bias = torch.zeros(same.shape, dtype=dtype, device=segment_ids.device)
        bias.masked_fill_(~same, torch.finfo(dtype).min)
        return bias[:, None]
    raise ValueError(f"mask kind must be 'additive' or 'bool', got {kind!r}")


def mask_kind_for(attn_implementation: str, requested: MaskKind | Literal["auto"] = "auto") -> MaskKind:
    """The mask kind to build for an attention implementation; refuses a kind that would be silently wrong."""
    allowed = CORRECT_MASK_KINDS.get(attn_implementation)
    if allowed is None:
        raise ValueError(f"attention implementation {attn_implementation!r} is not supported by ConcatBatching; "
                         f"supported: {', '.join(CORRECT_MASK_KINDS)}")
    if requested == "auto":
        return allowed[0]
    if requested not in allowed:
        raise ValueError(f"mask kind {requested!r} is wrong for {attn_implementation!r} attention "
                         f"(it adds the mask to the scores); use one of {', '.join(allowed)}")
    return requested
