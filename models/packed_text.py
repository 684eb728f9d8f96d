"""Packed (ConcatBatching) forward of a BERT-family text encoder, through transformers' own layers (TCB §4).

`PackedTextEncoder` runs a `PackedBatch` (ops/packing.py) through the encoder's layer view
(models/text_encoder.py: the model's own `BertEmbeddings` and `BertLayer`s, no forked BertModel): position and
token-type ids restart per request (TCB §4.1.1) and travel in `ActivationState.extras`; the block-diagonal mask
(TCB Eq. 5-6, ops/concat_attention.py) is the `attention_bias` every block receives. The hidden states are then
unpacked per request and pooled by the checkpoint's pooling (`TextEncoder.pooling`: mean + L2 by default).

`ConcatBatchingEngine` embeds any list of tokenized requests by packing them into forward passes of at most
`num_rows` rows of `row_length_tokens` tokens (or slots of `slot_size_tokens`, TCB §4.2). The baselines with the
same interface are in models/batching_baselines.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

from models.layers import ActivationState, run_layers
from models.text_encoder import TextEncoder
from ops.concat_attention import MaskKind, block_diagonal_mask, mask_kind_for
from ops.packing import (
    PackedBatch,
    first_fit_decreasing,
    pack_requests,
    pooled_embeddings,
    slots_per_row,
    unpack_token_states,
)


@dataclass
class BatchStats:
    """What the forward passes of one engine call computed."""

    num_requests: int = 0
    num_forward_passes: int = 0
    real_tokens: int = 0
    computed_tokens: int = 0  #: token positions computed, padding included

    @property
    def padding_fraction(self) -> float:
        return 0.0 if self.computed_tokens == 0 else 1.0 - self.real_tokens / self.computed_tokens

    def add(self, num_requests: int, real_tokens: int, computed_tokens: int) -> None:
        self.num_requests += num_requests
        self.num_forward_passes += 1
        self.real_tokens += real_tokens
        self.computed_tokens += computed_tokens


@dataclass
class EngineResult:
    """Embeddings of the requests in the order given, and what computing them cost."""

    embeddings: torch.Tensor  #: [requests, hidden], pooled as the checkpoint says
    stats: BatchStats = field(default_factory=BatchStats)


@dataclass
class PackedOutput:
    embeddings: torch.Tensor  #: [requests, hidden], pooled as the checkpoint says, request order
    token_states: list[torch.Tensor]  #: one [length, hidden] per request


class PackedTextEncoder:
    """Runs packed batches through a `TextEncoder`'s layer view with the mask its attention needs."""

    def __init__(self, encoder: TextEncoder, mask_kind: MaskKind | Literal["auto"] = "auto"):
        self.encoder = encoder
        self.attn_implementation = encoder.model.config._attn_implementation
        self.mask_kind = mask_kind_for(self.attn_implementation, mask_kind)
        #: Embeddings and blocks; the pooling head is replaced by the per-request pooling of ops/packing.py.
        self._body = [layer for layer in encoder.layers() if layer.kind != "head"]

    @property
    def pad_token_id(self) -> int:
        return int(self.encoder.tokenizer.pad_token_id or 0)

    @torch.inference_mode()
    def forward_packed(self, batch: PackedBatch) -> torch.Tensor:
        """[executed_rows, width, hidden] last hidden states of a packed batch."""
        dtype = self.encoder.model.dtype
        state = ActivationState(
            hidden=batch.input_ids,
            attention_mask=batch.attention_mask,
            attention_bias=block_diagonal_mask(batch.segment_ids, self.mask_kind, dtype),
            extras={"position_ids": batch.position_ids, "token_type_ids": batch.token_type_ids},
        )
        return run_layers(self._body, state.to(self.encoder.model.device)).hidden

    def embed_packed(self, batch: PackedBatch, with_token_states: bool = False) -> PackedOutput:
        hidden = self.forward_packed(batch)
        states = [s.clone() for s in unpack_token_states(hidden, batch)] if with_token_states else []
        return PackedOutput(embeddings=pooled_embeddings(hidden, batch, self.encoder.pooling), token_states=states)

    def pack(self, token_ids: Sequence[Sequence[int]], row_length_tokens: int, num_rows: int | None = None,
             slot_size_tokens: int | None = None, bins: Sequence[Sequence[int]] | None = None) -> PackedBatch:
        return pack_requests(token_ids, row_length_tokens, num_rows=num_rows, slot_size_tokens=slot_size_tokens,
                             bins=bins, pad_token_id=self.pad_token_id)


class ConcatBatchingEngine:
    """Embeds requests with pure (slot_size_tokens=None) or slotted ConcatBatching (TCB §4.1, §4.2).

    The requests are cut, in the order given, into groups that fit one batch of num_rows rows of
    row_length_tokens tokens (first-fit-decreasing inside a group), and each group is one forward pass.
    """

    def __init__(self, encoder: TextEncoder, row_length_tokens: int, num_rows: int,
                 slot_size_tokens: int | None = None, mask_kind: MaskKind | Literal["auto"] = "auto"):
        self.packed = PackedTextEncoder(encoder, mask_kind)
        self.row_length_tokens = row_length_tokens  # TCB §5.1: L
        self.num_rows = num_rows  # TCB §5.1: B
        self.slot_size_tokens = slot_size_tokens  # TCB Alg. 2: z
        self.name = "concat" if slot_size_tokens is None else "slotted_concat"

    def _bins(self) -> tuple[int, int]:
        if self.slot_size_tokens is None:
            return self.row_length_tokens, self.num_rows
        return self.slot_size_tokens, self.num_rows * slots_per_row(self.row_length_tokens, self.slot_size_tokens)

    def groups(self, lengths: Sequence[int]) -> list[list[int]]:
        """Consecutive groups of request indices, each the longest prefix of the rest that fits one batch."""
        capacity, max_bins = self._bins()
        groups: list[list[int]] = []
        current: list[int] = []
        for index, length in enumerate(lengths):
            candidate = current + [index]
            if len(first_fit_decreasing([lengths[i] for i in candidate], capacity)) <= max_bins:
                current = candidate
            else:
                groups.append(current)
                current = [index]
        if current:
            groups.append(current)
        return groups

    def embed(self, token_ids: Sequence[Sequence[int]]) -> EngineResult:
        lengths = [len(ids) for ids in token_ids]
        capacity, _ = self._bins()
        first_fit_decreasing(lengths, capacity, limit_name="row_length_tokens" if self.slot_size_tokens is None
                             else "slot_size_tokens")  # raises for an oversize request before any work
        stats = BatchStats()
        out = torch.empty(len(token_ids), self.packed.encoder.hidden_size)
        for group in self.groups(lengths):
            batch = self.packed.pack([token_ids[i] for i in group], self.row_length_tokens, self.num_rows,
                                     self.slot_size_tokens)
            out[group] = self.packed.embed_packed(batch).embeddings
            stats.add(batch.num_requests, batch.real_tokens, batch.computed_tokens)
        return EngineResult(embeddings=out, stats=stats)
