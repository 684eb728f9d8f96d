"""Loaders: real MiniLM weights from the package, local directories, timm ViTs from local checkpoints."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from models import load_text_encoder, load_vit, run_layers
from models.layers import ActivationState
from models.text_encoder import load_text_tokenizer, resolve_text_source

torch.set_num_threads(1)

TEXTS = ["The quick brown fox jumps over the lazy dog.", "plexserve",
         "Ray Serve hosts many transformer models on one cluster."]


@pytest.fixture(scope="module")
def minilm():
    return load_text_encoder()


def reference_embedding(text: str) -> torch.Tensor:
    """sentence-transformers' recipe done by hand with transformers, one text at a time (no padding)."""
    directory = resolve_text_source("package:all-minilm-l6-v2")
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModel.from_pretrained(directory, local_files_only=True).eval()
    batch = tokenizer([text], return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    return F.normalize(hidden.mean(dim=1), dim=1)[0]


def test_minilm_matches_per_request_transformers(minilm):
    embeddings = minilm.embed(TEXTS)
    assert embeddings.shape == (3, 384)
    for text, embedding in zip(TEXTS, embeddings):
        assert F.cosine_similarity(embedding, reference_embedding(text), dim=0) >= 0.9999
    assert torch.allclose(embeddings.norm(dim=1), torch.ones(3), atol=1e-5)


def test_layer_view_is_the_forward_pass(minilm):
    layers = minilm.layers()
    assert [layer.kind for layer in layers] == ["embeddings"] + ["block"] * 6 + ["head"]
    batch = minilm.tokenize(TEXTS)
    state = ActivationState(hidden=batch["input_ids"], attention_mask=batch["attention_mask"])
    with torch.inference_mode():
        split = run_layers(layers[4:], run_layers(layers[:4], state)).hidden
    assert torch.allclose(split, minilm.embed(TEXTS), atol=1e-6)


def test_token_ids_path_equals_text_path(minilm):
    tokenizer = load_text_tokenizer()
    assert tokenizer.max_length == minilm.max_length == 256
    ids = tokenizer.encode(TEXTS)
    assert torch.allclose(minilm.embed_token_ids(ids), minilm.embed(TEXTS), atol=1e-6)
    assert len(tokenizer.encode(["word " * 400], truncate_to=16)[0]) == 16
    with pytest.raises(ValueError, match=r"token_ids\[1\].*limit is 4"):
        tokenizer.check_token_ids([[101, 102], [101, 5, 6, 7, 102]], limit=4)
    with pytest.raises(ValueError, match="outside"):
        tokenizer.check_token_ids([[10**7]])


def test_local_directory_source_and_missing_weights(tmp_path, minilm):
    source = resolve_text_source("package:all-minilm-l6-v2")
    copy = tmp_path / "minilm"
    shutil.copytree(source, copy)
    local = load_text_encoder(str(copy))
    assert torch.allclose(local.embed(TEXTS[:1]), minilm.embed(TEXTS[:1]), atol=1e-6)
    (copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weight file"):
        load_text_encoder(str(copy))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text_encoder(str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="unknown packaged model"):
        load_text_encoder("package:bert-large")


def test_vit_loads_local_checkpoint_and_refuses_without_one(tmp_path):
    kwargs = dict(num_classes=5, image_size_px=16, in_chans=3, patch_size=4, depth=2, embed_dim=32, num_heads=2)
    original = load_vit("timm:vit_tiny_patch16_224", allow_random_init=True, **kwargs)
    path = tmp_path / "vit.pt"
    torch.save(original.model.state_dict(), path)
    loaded = load_vit("timm:vit_tiny_patch16_224", checkpoint_path=path, **kwargs)
    images = torch.randn(2, 3, 16, 16)
    with torch.inference_mode():
        assert torch.allclose(loaded.logits(images), original.model(images), atol=1e-6)
    assert [layer.kind for layer in loaded.layers()] == ["embeddings", "block", "block", "head"]
    with pytest.raises(ValueError, match="needs checkpoint_path"):
        load_vit("timm:vit_tiny_patch16_224", **kwargs)
    with pytest.raises(FileNotFoundError):
        load_vit("timm:vit_tiny_patch16_224", checkpoint_path=tmp_path / "none.pt", **kwargs)
    with pytest.raises(ValueError, match=r"shape \[N, 3, 16, 16\]"):
        loaded.logits(torch.randn(1, 1, 16, 16))
