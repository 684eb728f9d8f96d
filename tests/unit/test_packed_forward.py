"""The packed (ConcatBatching) forward on the real all-MiniLM-L6-v2 equals per-request outputs, on both attention
paths (per-text segments included), and no request attends to another."""

from __future__ import annotations

import pytest
import torch

from models.batching_baselines import NaiveBatchingEngine, SortedBatchingEngine, sorted_dp_batches
from models.packed_text import ConcatBatchingEngine, PackedTextEncoder
from models.text_encoder import load_text_encoder
from ops.concat_attention import block_diagonal_mask

TEXTS = [
    "hello world",
    "a much longer sentence about serving many transformer models on one ray cluster",
    "short",
    "the quick brown fox jumps over the lazy dog",
    "concatenated requests must not see each other",
    "positions restart at zero for every request in a row",
]
#: Float32 tolerance for per-token states and pooled embeddings (the issue's target is 1e-4).
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["sdpa", "eager", "sdpa_segments"])
def encoder(request):
    torch.set_num_threads(2)
    return load_text_encoder(attn_implementation=request.param)


@pytest.fixture(scope="module")
def token_ids(encoder):
    return [encoder.tokenizer(text)["input_ids"] for text in TEXTS]


def _reference_states(encoder, ids):
    with torch.inference_mode():
        return encoder.model(input_ids=torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize("slot", [None, 24])
def test_packed_equals_per_request(encoder, token_ids, slot):
    packed = PackedTextEncoder(encoder)
    batch = packed.pack(token_ids, row_length_tokens=48, slot_size_tokens=slot)
    assert batch.input_ids.shape[0] < len(token_ids)  # several requests really share a row
    out = packed.embed_packed(batch, with_token_states=True)
    reference = encoder.embed(TEXTS)
    assert (out.embeddings - reference).abs().max() <= TOLERANCE
    assert torch.nn.functional.cosine_similarity(out.embeddings, reference).min() >= 0.9999
    for ids, states in zip(token_ids, out.token_states):
        assert (states - _reference_states(encoder, ids)).abs().max() <= TOLERANCE


def test_sdpa_additive_mask_also_correct(encoder, token_ids):
    if encoder.model.config._attn_implementation != "sdpa":
        pytest.skip("sdpa only")
    packed = PackedTextEncoder(encoder, mask_kind="additive")
    batch = packed.pack(token_ids, row_length_tokens=64)
    assert (packed.embed_packed(batch).embeddings - encoder.embed(TEXTS)).abs().max() <= TOLERANCE


def test_boolean_mask_is_wrong_for_eager(encoder, token_ids):
    """Why eager gets an additive mask: a boolean one is added as 0/1 and lets requests see each other."""
    if encoder.model.config._attn_implementation != "eager":
        pytest.skip("eager only")
    with pytest.raises(ValueError, match="wrong for 'eager'"):
        PackedTextEncoder(encoder, mask_kind="bool")
    packed = PackedTextEncoder(encoder)
    batch = packed.pack(token_ids, row_length_tokens=64)
    wrong_mask = block_diagonal_mask(batch.segment_ids, "bool")
    from models.layers import ActivationState, run_layers
    state = ActivationState(hidden=batch.input_ids, attention_mask=batch.attention_mask, attention_bias=wrong_mask,
                            extras={"position_ids": batch.position_ids, "token_type_ids": batch.token_type_ids})
    with torch.inference_mode():
        hidden = run_layers(packed._body, state).hidden
    from ops.packing import pooled_embeddings
    assert (pooled_embeddings(hidden, batch) - encoder.embed(TEXTS)).abs().max() > 1e-2


def test_perturbing_one_request_leaves_the_others(encoder, token_ids):
    packed = PackedTextEncoder(encoder)
    changed = [list(ids) for ids in token_ids]
    changed[1][3] = encoder.tokenizer.convert_tokens_to_ids("banana")
    bins = [[0, 1, 2], [3, 4, 5]]
    before = packed.embed_packed(packed.pack(token_ids, 64, bins=bins)).embeddings
    after = packed.embed_packed(packed.pack(changed, 64, bins=bins)).embeddings
    assert (after[1] - before[1]).abs().max() > 1e-3
    others = [0, 2, 3, 4, 5]
    assert (after[others] - before[others]).abs().max() <= 1e-6


def test_engines_share_one_interface_and_agree(encoder, token_ids):
    reference = encoder.embed(TEXTS)
    engines = [NaiveBatchingEngine(encoder, 4), SortedBatchingEngine(encoder, 4),
               ConcatBatchingEngine(encoder, row_length_tokens=32, num_rows=2),
               ConcatBatchingEngine(encoder, row_length_tokens=32, num_rows=2, slot_size_tokens=16)]
    for engine in engines:
        result = engine.embed(token_ids)
        assert (result.embeddings - reference).abs().max() <= TOLERANCE, engine.name
        assert result.stats.num_requests == len(TEXTS)
        assert result.stats.real_tokens == sum(map(len, token_ids))
    concat, naive = engines[2].embed(token_ids).stats, engines[0].embed(token_ids).stats
    assert concat.padding_fraction < naive.padding_fraction


def test_oversize_request_is_an_error_not_a_truncation(encoder, token_ids):
    engine = ConcatBatchingEngine(encoder, row_length_tokens=12, num_rows=4)
    with pytest.raises(ValueError, match=r"request 1 has \d+ tokens.*row_length_tokens=12"):
        engine.embed(token_ids)


def test_sorted_dp_groups_similar_lengths():
    lengths = [5, 50, 6, 51, 5, 49]
    batches = sorted_dp_batches(lengths, max_batch_size=4)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert sorted(sorted(b) for b in batches) == [[0, 2, 4], [1, 3, 5]]
