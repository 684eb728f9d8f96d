"""Packaged model sources (models/packaged.py) and MPNet's layer view (models/mpnet_layers.py).

The split-archive reader and the MPNet layer view are checked on data made here (a small zip split into volumes, a
small randomly initialised MPNet); the real all-mpnet-base-v2 checks run where its packages are installed
(`make install-bench`) and skip cleanly elsewhere.
"""

from __future__ import annotations

import io
import zipfile

import pytest
import torch
from transformers import MPNetConfig, MPNetModel

from models import packaged
from models.layers import ActivationState, run_layers
from models.mpnet_layers import MPNetBlockLayer
from models.packed_text import PackedTextEncoder
from models.text_encoder import TextEncoder, resolve_text_source
from ops.packing import pack_requests, pooled_embeddings
from ops.pooling import Pooling
from parallel.stage_layers import shard_block_layer
from parallel.tensor_parallel import BlockShardingPlan, ThreadCollectives


def _split_zip(tmp_path, members: dict[str, bytes], volumes: int = 3):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    data = buffer.getvalue()
    step = -(-len(data) // volumes)
    paths = []
    for index in range(volumes):
        path = tmp_path / f"model.zip.{index + 1:03d}"
        path.write_bytes(data[index * step:(index + 1) * step])
        paths.append(path)
    return data, paths


def test_concatenated_files_read_and_seek_across_volumes(tmp_path):
    data, paths = _split_zip(tmp_path, {"m/a.bin": bytes(range(256)) * 50, "m/b.txt": b"hello"})
    with packaged.ConcatenatedFiles(paths) as stream:
        assert stream.read() == data
        for offset in (0, 7, len(data) // 3 - 2, len(data) // 2, len(data) - 1):
            stream.seek(offset)
            assert stream.read(5) == data[offset:offset + 5]
        stream.seek(-4, io.SEEK_END)
        assert stream.read() == data[-4:]


def test_unpack_writes_the_model_directory_and_skips_shell_files(tmp_path):
    members = {"m/config.json": b"{}", "m/1_Pooling/config.json": b"{\"x\": 1}", "m/desktop.ini": b"[x]",
               "m/weights.bin": bytes(range(256)) * 400}
    _, paths = _split_zip(tmp_path, members)
    root = tmp_path / "out"
    packaged._unpack(paths, "m", root)
    assert (root / "m" / "weights.bin").read_bytes() == members["m/weights.bin"]
    assert (root / "m" / "1_Pooling" / "config.json").read_bytes() == members["m/1_Pooling/config.json"]
    assert not (root / "m" / "desktop.ini").exists()
    assert (root / ".complete").exists() and not (tmp_path / "out.partial").exists()


def test_unpack_refuses_a_member_outside_the_model_directory(tmp_path):
    _, paths = _split_zip(tmp_path, {"m/config.json": b"{}", "other/evil.txt": b"x"})
    with pytest.raises(ValueError, match="other/evil.txt"):
        packaged._unpack(paths, "m", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_and_uninstalled_packaged_models_are_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="unknown packaged model 'nope'.*all-mpnet-base-v2"):
        resolve_text_source("package:nope")
    missing = packaged.SplitArchiveModel(distributions=("plexserve-no-such-dist-001",), archive_dir="m",
                                         install_hint="pip install it")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "fake-model", missing)
    with pytest.raises(ValueError, match="plexserve-no-such-dist-001 package: pip install it"):
        packaged.packaged_model_directory("fake-model")
    assert not packaged.packaged_model_available("fake-model")
    assert packaged.packaged_model_available("all-minilm-l6-v2")


def _tiny_mpnet() -> TextEncoder:
    torch.manual_seed(0)
    config = MPNetConfig(vocab_size=120, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=80, attn_implementation="eager")
    return TextEncoder("tiny-mpnet", MPNetModel(config, add_pooling_layer=False), None, max_length=64,
                       pooling=Pooling(mode="mean", normalize=True))


def _requests() -> list[list[int]]:
    return [[0, 17, 45, 99, 2], [0, 8, 2], [0] + list(range(10, 40)) + [2]]


def _mean_pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1)


def _padded(requests, pad_token_id: int = 1) -> dict[str, torch.Tensor]:
    longest = max(len(ids) for ids in requests)
    input_ids = torch.full((len(requests), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(requests):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        mask[row, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def test_mpnet_layer_view_matches_transformers_forward():
    encoder = _tiny_mpnet()
    batch = _padded(_requests())
    with torch.inference_mode():
        reference = _mean_pooled(encoder.model(**batch).last_hidden_state, batch["attention_mask"])
        ours = encoder.embed_tokens(batch)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    assert [layer.kind for layer in encoder.layers()] == ["embeddings", "block", "block", "block", "head"]


def test_mpnet_packed_rows_match_the_padded_batch():
    encoder = _tiny_mpnet()
    requests = _requests()
    with torch.inference_mode():
        padded = encoder.embed_tokens(_padded(requests))
    packed = PackedTextEncoder(encoder)
    batch = pack_requests(requests, row_length_tokens=48, num_rows=2, pad_token_id=1)
    assert batch.input_ids.shape[0] < len(requests)  # at least two requests share a row
    embeddings = pooled_embeddings(packed.forward_packed(batch), batch, encoder.pooling)
    torch.testing.assert_close(embeddings, padded, rtol=1e-4, atol=1e-5)


def test_mpnet_stages_cut_anywhere_compose_to_the_whole_model():
    encoder = _tiny_mpnet()
    batch = _padded(_requests())
    state = ActivationState(hidden=batch["input_ids"], attention_mask=batch["attention_mask"])
    layers = encoder.layers()
    with torch.inference_mode():
        whole = run_layers(layers, state).hidden
        for cut in range(1, len(layers)):
            staged = run_layers(layers[cut:], run_layers(layers[:cut], state)).hidden
            torch.testing.assert_close(staged, whole)


def test_mpnet_blocks_refuse_tensor_parallelism_by_name():
    block = next(layer for layer in _tiny_mpnet().layers() if isinstance(layer, MPNetBlockLayer))
    with pytest.raises(ValueError, match="MPNet.*intra_op_degree 1"):
        shard_block_layer(block, "text", BlockShardingPlan.megatron(), ThreadCollectives.group(2)[0])


needs_mpnet = pytest.mark.skipif(not packaged.packaged_model_available("all-mpnet-base-v2"),
                                 reason="all-mpnet-base-v2's packages are not installed (make install-bench)")


@needs_mpnet
def test_packaged_mpnet_embeds_as_transformers_does():
    from models.text_encoder import load_text_encoder

    encoder = load_text_encoder("package:all-mpnet-base-v2", name="mpnet")
    assert encoder.hidden_size == 768 and encoder.max_length == 384
    assert encoder.pooling == Pooling(mode="mean", normalize=True)
    assert encoder.model.config._attn_implementation == "eager"  # MPNet has no sdpa attention in transformers
    texts = ["serving many models on shared devices", "hello"]
    batch = encoder.tokenize(texts)
    with torch.inference_mode():
        reference = _mean_pooled(encoder.model(input_ids=batch["input_ids"],
                                               attention_mask=batch["attention_mask"]).last_hidden_state,
                                 batch["attention_mask"])
    ours = encoder.embed(texts)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    similar, unrelated = ours[0] @ encoder.embed(["many models served on shared GPUs"])[0], ours[0] @ ours[1]
    assert similar > unrelated + 0.2  # real weights: a paraphrase is closer than an unrelated text


@needs_mpnet
def test_packaged_mpnet_stages_read_only_their_tensors_and_compose_to_the_whole_model():
    from parallel.stage_layers import ModelSource, example_input, load_model, load_stage_layers

    source = ModelSource(name="mpnet", kind="text", source="package:all-mpnet-base-v2")
    whole = load_model(source)
    state = example_input(whole, batch_size=2, seq_len_tokens=12)
    single = ThreadCollectives.group(1)[0]
    first, second = load_stage_layers(source, 0, 7, single), load_stage_layers(source, 7, 13, single)
    # Each stage holds its blocks and the shared relative-position table, not the other stage's blocks.
    assert first.weight_bytes + second.weight_bytes < whole.weight_bytes() + 2 * 2**20
    with torch.inference_mode():
        expected = run_layers(whole.layers()[:13], state).hidden
        staged = run_layers(second.layers, run_layers(first.layers, state)).hidden
    torch.testing.assert_close(staged, expected)
