"""Sentence pooling of a text encoder's token states, as sentence-transformers' `Pooling` and `Normalize` modules.

A `Pooling` names one mode and whether the pooled vector is L2-normalised:

* ``mean``: the mean of the real tokens' states (`pooling_mode_mean_tokens`);
* ``cls``: the first token's state, the [CLS] token of BERT-family encoders (`pooling_mode_cls_token`);
* ``max``: the element-wise maximum over the real tokens (`pooling_mode_max_tokens`);
* ``mean_sqrt_len``: the sum of the real tokens' states divided by the square root of their count
  (`pooling_mode_mean_sqrt_len_tokens`);
* ``last_token``: the last real token's state (`pooling_mode_lasttoken`).

`pool_padded` pools right-padded [batch, tokens, hidden] states under their attention mask;
`ops.packing.pooled_embeddings` pools the requests of a packed (ConcatBatching) batch with the same rules, each
request's own first and last token standing for its [CLS] and last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: The pooling modes plexserve computes (sentence-transformers' names in the module docstring).
POOLING_MODES: tuple[str, ...] = ("mean", "cls", "max", "mean_sqrt_len", "last_token")


@dataclass(frozen=True)
class Pooling:
    """How a sentence embedding is made of token states: one mode, then L2 normalisation or not."""

    mode: str = "mean"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode {self.mode!r} is not supported; supported modes: "
                             f"{', '.join(POOLING_MODES)}")


#: sentence-transformers' usual recipe (mean, then Normalize), the pooling of a checkpoint that names none.
DEFAULT_POOLING = Pooling()


def finish(pooled: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """The pooled vectors, L2-normalised when the pooling asks for it."""
    return F.normalize(pooled, p=2, dim=1) if pooling.normalize else pooled


def pool_padded(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling = DEFAULT_POOLING) -> torch.Tensor:
    """[batch, tokens, hidden] right-padded states and their [batch, tokens] 0/1 mask -> [batch, hidden]."""
    mode = pooling.mode
    if mode == "cls":
        pooled = hidden[:, 0]
    elif mode == "last_token":
        last = (attention_mask.sum(dim=1) - 1).clamp(min=0).to(hidden.device)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    else:
        weights = attention_mask.unsqueeze(-1).to(device=hidden.device, dtype=hidden.dtype)
        if mode == "max":
            pooled = hidden.masked_fill(weights == 0, torch.finfo(hidden.dtype).min).amax(dim=1)
        else:
            sums = (hidden * weights).sum(dim=1)
            counts = weights.sum(dim=1).clamp(min=1e-9)
            pooled = sums / (counts if mode == "mean" else counts.sqrt())
    return finish(pooled, pooling)
