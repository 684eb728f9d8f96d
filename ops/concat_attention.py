"""The block-diagonal attention mask of ConcatBatching (TCB §4.1.2, Eq. 5-6), in the form the attention needs.

TCB Eq. 6: M is 0 on the blocks Q_i K_i^T of a request with itself and -inf elsewhere, so no token attends to
another request. Padding tokens form a block of their own (they attend only to padding), which keeps every
softmax row finite and never touches a real token.

transformers' attention implementations read a mask differently:
- eager adds the mask to the scores (`attn_weights + attention_mask`): only an additive float mask is correct;
  a boolean mask would be added as 0/1 and silently let requests attend to each other.
- sdpa hands the mask to `torch.nn.functional.scaled_dot_product_attention`: a boolean mask (True = attend) and an
  additive float mask are both correct.
- sdpa_segments (registered here as a transformers `AttentionInterface` entry) takes the [rows, tokens] segment ids
  themselves (mask kind 'segments') and runs scaled_dot_product_attention once per request segment, so a packed row
  costs the sum of its requests' len^2 instead of row_len^2; padding positions get zero outputs. Any other mask (the
  padded path's additive bias) goes to transformers' sdpa unchanged.
"""

from __future__ import annotations

from typing import Literal

import torch

MaskKind = Literal["additive", "bool", "segments"]
#: The attention implementation that computes packed rows segment by segment.
SEGMENT_ATTENTION = "sdpa_segments"
#: Segment id of padding positions (ops/packing.py's PADDING_SEGMENT).
_PADDING_SEGMENT = 0
#: Attention implementations and the mask kinds that are correct for them.
CORRECT_MASK_KINDS: dict[str, tuple[MaskKind, ...]] = {"eager": ("additive",), "sdpa": ("bool", "additive"),
                                                       SEGMENT_ATTENTION: ("segments", "bool", "additive")}


def block_diagonal_mask(segment_ids: torch.Tensor, kind: MaskKind = "additive",
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[rows, tokens] segment ids -> [rows, 1, tokens, tokens] mask: a token attends only to its own segment.

    kind 'bool': True where attention is allowed (sdpa). kind 'additive': 0 where allowed, the dtype's most
    negative value elsewhere (eager and sdpa), as TCB Eq. 6's -inf. kind 'segments': the [rows, tokens] segment ids
    unchanged, which `segment_attention_forward` reads as the mask.
    """
    if kind == "segments":
        return segment_ids
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


def segment_spans(segment_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every non-padding segment of [rows, tokens] segment ids; a segment is contiguous."""
    rows, width = segment_ids.shape
    flat = segment_ids.reshape(-1).cpu()
    row_of = torch.arange(rows).repeat_interleave(width)
    change = torch.ones(flat.numel(), dtype=torch.bool)
    change[1:] = (flat[1:] != flat[:-1]) | (row_of[1:] != row_of[:-1])
    starts = torch.nonzero(change).flatten().tolist()
    ends = starts[1:] + [flat.numel()]
    ids = flat[starts].tolist()
    return [(start // width, start % width, start % width + (end - start))
            for start, end, sid in zip(starts, ends, ids) if sid != _PADDING_SEGMENT]


def segment_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention entry: [rows, heads, tokens, dim] q/k/v -> [rows, tokens, heads, dim] output.

    With segment ids as the mask (a 2-D integer tensor), each request segment attends to itself only, through one
    scaled_dot_product_attention call over its own tokens (TCB Eq. 6 without computing the masked blocks). Any other
    mask goes to transformers' sdpa.
    """
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.is_floating_point() \
            or attention_mask.dtype == torch.bool:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, tokens, dim = query.shape
    out = query.new_zeros(rows, tokens, heads, dim)
    for row, start, end in segment_spans(attention_mask):
        q = query[row:row + 1, :, start:end]
        k = key[row:row + 1, :, start:end]
        v = value[row:row + 1, :, start:end]
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling)
        out[row, start:end] = attended[0].transpose(0, 1)
    return out, None


def register_segment_attention() -> str:
    """Register `segment_attention_forward` as transformers' attention implementation 'sdpa_segments'."""
    from transformers import AttentionInterface
    AttentionInterface.register(SEGMENT_ATTENTION, segment_attention_forward)
    return SEGMENT_ATTENTION
