"""The layer view of an MPNet encoder (all-mpnet-base-v2), through transformers' own `MPNetEmbeddings`/`MPNetLayer`.

MPNet differs from BERT in two places that the layer view has to carry:

- Absolute positions start after the padding index (`padding_idx + 1`, as transformers'
  `create_position_ids_from_input_ids` numbers them) and there are no token types. Without `position_ids` in the
  state the embeddings number the real tokens themselves; with them (the packed path, where positions restart per
  request, TCB §4.1.1) the 0-based positions are shifted by `padding_idx + 1`.
- Every block adds a relative position bias (T5-style buckets, one learned scalar per bucket and head) that
  transformers computes once in `MPNetEncoder`. Here each block layer computes it from the token count and the
  encoder's `relative_attention_bias` table it shares with the other blocks, so that any contiguous slice of blocks
  (a pipeline stage) runs alone. Relative positions inside one packed request equal those of the row, since a
  request's tokens are contiguous, and the block-diagonal mask hides the pairs that straddle two requests.
"""

from __future__ import annotations

import torch
from torch import nn

from models.layers import ActivationState, Layer


def is_mpnet(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == "mpnet"


class MPNetEmbeddingsLayer(Layer):
    kind = "embeddings"

    def __init__(self, embeddings: nn.Module):
        super().__init__()
        self.embeddings = embeddings

    def forward(self, state: ActivationState) -> ActivationState:
        position_ids = state.extras.get("position_ids")
        if position_ids is not None:
            position_ids = position_ids + self.embeddings.padding_idx + 1
        hidden = self.embeddings(input_ids=state.hidden, position_ids=position_ids)
        bias = state.attention_bias
        if bias is None:
            # The same additive mask as the BERT path's (models/text_encoder.py `extended_attention_bias`).
            mask = state.attention_mask[:, None, None, :].to(hidden.dtype)
            bias = (1.0 - mask) * torch.finfo(hidden.dtype).min
        return ActivationState(hidden=hidden, attention_mask=state.attention_mask, attention_bias=bias,
                               extras=state.extras)


class MPNetBlockLayer(Layer):
    kind = "block"

    def __init__(self, block: nn.Module, relative_attention_bias: nn.Embedding, num_buckets: int = 32):
        super().__init__()
        self.block = block
        #: Shared by every block of the model (one parameter, loaded once per stage).
        self.relative_attention_bias = relative_attention_bias
        #: transformers' `MPNetEncoder.compute_position_bias` uses its default of 32 buckets.
        self.num_buckets = num_buckets

    def position_bias(self, tokens: int, device: torch.device) -> torch.Tensor:
        """[1, heads, tokens, tokens] relative position bias."""
        from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

        positions = torch.arange(tokens, dtype=torch.long, device=device)
        relative = positions[None, :] - positions[:, None]
        buckets = MPNetEncoder.relative_position_bucket(relative, num_buckets=self.num_buckets)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)

    def forward(self, state: ActivationState) -> ActivationState:
        hidden = state.hidden
        bias = self.position_bias(hidden.shape[1], hidden.device).to(hidden.dtype)
        if state.attention_bias is not None:
            bias = bias + state.attention_bias
        output = self.block(hidden, attention_mask=bias)
        hidden = output[0] if isinstance(output, tuple) else output
        return ActivationState(hidden=hidden, attention_mask=state.attention_mask,
                               attention_bias=state.attention_bias, extras=state.extras)


def mpnet_body_layers(model: nn.Module) -> list[Layer]:
    """Embeddings, then each transformer block of an `MPNetModel`."""
    table = model.encoder.relative_attention_bias
    return [MPNetEmbeddingsLayer(model.embeddings)] + [MPNetBlockLayer(block, table) for block in model.encoder.layer]
