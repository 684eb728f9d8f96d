"""Packed rows attended per text (`sdpa_segments`) equal each text's own forward, on random tensors and on the real
all-MiniLM-L6-v2, for texts of many lengths."""

from __future__ import annotations

import random

import pytest
import torch

from models.packed_text import PackedTextEncoder
from models.text_encoder import load_text_encoder
from ops.concat_attention import SEGMENT_ATTENTION, block_diagonal_mask, segment_attention_forward, segment_spans

#: The issue's bound on packed vs per-text outputs.
MAX_ABS_DIFF = 1e-5


def test_segment_spans_skip_padding_and_split_rows():
    ids = torch.tensor([[1, 1, 2, 2, 2, 0], [3, 4, 4, 0, 0, 0]])
    assert segment_spans(ids) == [(0, 0, 2), (0, 2, 5), (1, 0, 1), (1, 1, 3)]


def test_segment_attention_equals_block_diagonal_sdpa():
    torch.manual_seed(0)
    segments = torch.tensor([[1] * 5 + [2] * 9 + [3] * 2 + [0] * 4, [4] * 17 + [0] * 3])
    q, k, v = (torch.randn(2, 4, 20, 8) for _ in range(3))
    out, weights = segment_attention_forward(None, q, k, v, segments, scaling=8 ** -0.5)
    assert weights is None
    mask = block_diagonal_mask(segments, "bool")
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=8 ** -0.5)
    real = segments != 0
    assert (out - reference.transpose(1, 2))[real].abs().max() <= MAX_ABS_DIFF
    assert out[~real].abs().max() == 0  # padding positions are left zero


def test_other_masks_go_to_plain_sdpa():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    bias = torch.zeros(1, 1, 1, 6)
    out, _ = segment_attention_forward(torch.nn.Module(), q, k, v, bias, scaling=0.5)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.5)
    assert (out - reference.transpose(1, 2)).abs().max() <= MAX_ABS_DIFF


@pytest.fixture(scope="module")
def encoder():
    torch.set_num_threads(2)
    return load_text_encoder(attn_implementation=SEGMENT_ATTENTION)


@pytest.mark.parametrize("lengths", [[3, 7, 12], [2, 40, 130, 17, 250, 9], [254, 254], [60] * 8])
def test_packed_texts_equal_per_text_forward(encoder, lengths):
    rng = random.Random(sum(lengths))
    token_ids = [[101] + [rng.randrange(1000, 20000) for _ in range(n - 2)] + [102] for n in lengths]
    packed = PackedTextEncoder(encoder)
    assert packed.mask_kind == "segments"
    batch = packed.pack(token_ids, row_length_tokens=256)
    out = packed.embed_packed(batch, with_token_states=True)
    for ids, states, embedding in zip(token_ids, out.token_states, out.embeddings):
        with torch.inference_mode():
            alone = encoder.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        assert (states - alone).abs().max() <= MAX_ABS_DIFF
        assert (embedding - encoder.embed_token_ids([ids])[0]).abs().max() <= MAX_ABS_DIFF
