"""Text models named by their Hugging Face Hub id (`source: hf:ORG/NAME[@REVISION]`), read from a Hub cache built on
disk with the network off, and pooled as their sentence-transformers config says. No Ray.

The cache has huggingface_hub's layout: `models--ORG--NAME/{blobs,refs,snapshots/<commit>}`, `refs/<branch or tag>`
holding a commit hash, each snapshot file a relative symlink to its blob. Its files are the bundled
all-MiniLM-L6-v2's, with other pooling configs for the second and third checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from transformers import AutoModel, AutoTokenizer

from models import hub
from models.packed_text import ConcatBatchingEngine, PackedTextEncoder
from models.text_encoder import (
    MINILM_SOURCE,
    checkpoint_pooling,
    load_text_encoder,
    load_text_pooling,
    load_text_tokenizer,
    resolve_text_source,
)
from ops.pooling import DEFAULT_POOLING, Pooling
from placement.core.deployment_spec import ModelSpec
from placement.core.model_sources import HubSource, parse_hub_source

torch.set_num_threads(1)

TEXTS = ["The quick brown fox jumps over the lazy dog.", "plexserve",
         "Ray Serve hosts many transformer models on one cluster, and each of them answers within its SLO."]
COMMIT_MAIN = "a" * 40
COMMIT_OLD = "0123456789abcdef0123456789abcdef01234567"
COMMIT_CLS = "c" * 40
COMMIT_MAX = "d" * 40
MINILM_DIR = resolve_text_source(MINILM_SOURCE)
ST_TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
ST_POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
ST_NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def pooling_config(**modes: bool) -> bytes:
    config = {"word_embedding_dimension": 384, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
              "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    config.update(modes)
    return json.dumps(config).encode()


def checkpoint_files(modules: list[dict] | None = None, pooling: bytes | None = None) -> dict[str, Path | bytes]:
    """The bundled MiniLM's files by relative path, with `modules.json` and the pooling config replaced if given."""
    files: dict[str, Path | bytes] = {
        str(path.relative_to(MINILM_DIR)): path for path in MINILM_DIR.rglob("*")
        if path.is_file() and not path.name.startswith(".")
    }
    if modules is not None:
        files["modules.json"] = json.dumps(modules).encode()
    if pooling is not None:
        files["1_Pooling/config.json"] = pooling
    return files


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, Path | bytes], refs: tuple[str, ...] = ()):
    """One commit of a Hub model in huggingface_hub's cache layout (blobs shared, snapshot files symlinked)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for relative, content in files.items():
        if isinstance(content, Path):
            blob = repo / "blobs" / hashlib.sha256(str(content).encode()).hexdigest()
            if not blob.exists():
                blob.symlink_to(content)  # the package's file stands for the downloaded blob
        else:
            blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
            blob.write_bytes(content)
        target = repo / "snapshots" / commit / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(os.path.relpath(blob, target.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes the bare hash, no newline


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An offline Hub cache under a fresh HF_HOME, with every socket connection refused."""
    home = tmp_path / "hf"
    cache = home / "hub"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    attempts: list = []

    def refuse(self, address):
        attempts.append(address)
        raise OSError(f"network is off in this test (connect to {address})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    hub._snapshot.cache_clear()
    default = checkpoint_files()
    add_snapshot(cache, "acme/minilm", COMMIT_OLD, default, refs=("v1",))
    add_snapshot(cache, "acme/minilm", COMMIT_MAIN, default, refs=("main",))
    add_snapshot(cache, "acme/minilm-cls", COMMIT_CLS,
                 checkpoint_files([ST_TRANSFORMER, ST_POOLING], pooling_config(pooling_mode_cls_token=True)),
                 refs=("main",))
    add_snapshot(cache, "acme/minilm-max", COMMIT_MAX,
                 checkpoint_files([ST_TRANSFORMER, ST_POOLING, ST_NORMALIZE],
                                  pooling_config(pooling_mode_max_tokens=True)), refs=("main",))
    yield cache
    hub._snapshot.cache_clear()
    assert attempts == [], "a Hub model was looked up over the network"


@pytest.fixture(scope="module")
def local_minilm():
    return load_text_encoder(MINILM_SOURCE)


def hidden_states(text: str) -> torch.Tensor:
    """The last hidden states of one text alone (no padding), straight from transformers."""
    tokenizer = AutoTokenizer.from_pretrained(MINILM_DIR, local_files_only=True)
    model = AutoModel.from_pretrained(MINILM_DIR, local_files_only=True).eval()
    with torch.inference_mode():
        return model(**tokenizer([text], return_tensors="pt")).last_hidden_state[0]


def test_the_bundled_minilm_declares_mean_pooling_and_normalize():
    assert (MINILM_DIR / "1_Pooling" / "config.json").exists()
    assert checkpoint_pooling(MINILM_DIR) == Pooling("mean", normalize=True) == DEFAULT_POOLING


def test_hub_model_loads_from_the_cache_offline_and_equals_the_local_path(hub_cache, local_minilm):
    expected = local_minilm.embed(TEXTS)
    for source, commit in (("hf:acme/minilm", COMMIT_MAIN), (f"hf:acme/minilm@{COMMIT_OLD}", COMMIT_OLD),
                           ("hf:acme/minilm@v1", COMMIT_OLD), ("hf:acme/minilm@main", COMMIT_MAIN)):
        directory = resolve_text_source(source)
        assert directory == hub_cache / "models--acme--minilm" / "snapshots" / commit
        encoder = load_text_encoder(source, name="hub")
        assert encoder.pooling == DEFAULT_POOLING
        assert torch.equal(encoder.embed(TEXTS), expected), source
    tokenizer = load_text_tokenizer("hf:acme/minilm@v1")
    assert tokenizer.encode(TEXTS) == local_minilm.text_tokenizer.encode(TEXTS)
    assert tokenizer.max_length == local_minilm.max_length


@pytest.mark.parametrize("source, revision", [
    ("hf:acme/minilm@v2", "v2"),
    (f"hf:acme/minilm@{'b' * 40}", "b" * 40),
    ("hf:acme/absent", "main"),
])
def test_a_revision_missing_from_the_cache_is_a_value_error_naming_it(hub_cache, source, revision):
    with pytest.raises(ValueError) as error:
        load_text_encoder(source)
    message = str(error.value)
    assert f"revision {revision!r}" in message and source in message and str(hub_cache) in message
    assert "HF_HUB_OFFLINE" in message
    with pytest.raises(ValueError, match=f"revision '{revision}'"):
        load_text_tokenizer(source)


def test_cls_pooling_from_the_checkpoint_config_is_the_first_token_state(hub_cache, local_minilm):
    """A checkpoint whose Pooling config enables only the CLS token and has no Normalize module: every text path
    (padded, packed) answers the raw [CLS] state, computed here by hand, and that differs from mean pooling."""
    encoder = load_text_encoder("hf:acme/minilm-cls")
    assert encoder.pooling == Pooling("cls", normalize=False) == load_text_pooling("hf:acme/minilm-cls")
    padded = encoder.embed(TEXTS)
    by_hand = torch.stack([hidden_states(text)[0] for text in TEXTS])
    assert torch.allclose(padded, by_hand, atol=1e-5)
    assert not torch.allclose(padded.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-3)  # not normalised
    token_ids = encoder.text_tokenizer.encode(TEXTS)
    packed = PackedTextEncoder(encoder)
    batch = packed.pack(token_ids, row_length_tokens=64)
    assert batch.input_ids.shape[0] < len(TEXTS)  # several texts share a row: each keeps its own [CLS]
    assert torch.allclose(packed.embed_packed(batch).embeddings, by_hand, atol=1e-5)
    assert torch.allclose(ConcatBatchingEngine(encoder, 64, 2).embed(token_ids).embeddings, by_hand, atol=1e-5)
    mean = local_minilm.embed(TEXTS)
    assert (F.normalize(padded, dim=1) - mean).abs().max() > 1e-2


def test_max_pooling_with_normalize(hub_cache):
    encoder = load_text_encoder("hf:acme/minilm-max")
    assert encoder.pooling == Pooling("max", normalize=True)
    by_hand = F.normalize(torch.stack([hidden_states(text).amax(dim=0) for text in TEXTS]), dim=1)
    assert torch.allclose(encoder.embed(TEXTS), by_hand, atol=1e-5)
    packed = PackedTextEncoder(encoder)
    assert torch.allclose(packed.embed_packed(packed.pack(encoder.text_tokenizer.encode(TEXTS), 64)).embeddings,
                          by_hand, atol=1e-5)


def local_checkpoint(directory: Path, files: dict[str, Path | bytes]) -> Path:
    for relative, content in files.items():
        target = directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            target.symlink_to(content)
        else:
            target.write_bytes(content)
    return directory


@pytest.mark.parametrize("modules, pooling, message", [
    (None, pooling_config(pooling_mode_weightedmean_tokens=True), "pooling_mode_weightedmean_tokens is not supported"),
    (None, pooling_config(pooling_mode_mean_tokens=True, pooling_mode_max_tokens=True), "exactly one pooling mode"),
    (None, pooling_config(), "exactly one pooling mode"),
    ([ST_TRANSFORMER, ST_POOLING, {"idx": 2, "name": "2", "path": "2_Dense",
                                   "type": "sentence_transformers.models.Dense"}], None, "Dense' is not supported"),
    ([ST_TRANSFORMER, ST_NORMALIZE, ST_POOLING], None, "Normalize module comes before"),
])
def test_an_unsupported_sentence_transformers_config_is_refused_by_name(tmp_path, modules, pooling, message):
    directory = local_checkpoint(tmp_path / "model", checkpoint_files(modules, pooling))
    with pytest.raises(ValueError, match=message):
        load_text_encoder(str(directory))


def test_a_pooling_width_other_than_the_hidden_size_is_refused(tmp_path):
    config = json.loads(pooling_config(pooling_mode_mean_tokens=True))
    config["word_embedding_dimension"] = 768
    directory = local_checkpoint(tmp_path / "model", checkpoint_files(None, json.dumps(config).encode()))
    with pytest.raises(ValueError, match="word_embedding_dimension 768"):
        load_text_encoder(str(directory))


def test_a_directory_without_sentence_transformers_config_pools_mean_and_normalizes(tmp_path, local_minilm):
    files = {k: v for k, v in checkpoint_files().items() if k != "modules.json" and not k.startswith("1_Pooling")}
    directory = local_checkpoint(tmp_path / "plain", files)
    encoder = load_text_encoder(str(directory))
    assert encoder.pooling == DEFAULT_POOLING
    assert torch.equal(encoder.embed(TEXTS), local_minilm.embed(TEXTS))


def test_hub_sources_are_validated_in_the_spec():
    assert parse_hub_source("hf:acme/minilm") == HubSource("acme/minilm", None)
    assert parse_hub_source("hf:sentence-transformers/all-MiniLM-L6-v2@refs/pr/1") == HubSource(
        "sentence-transformers/all-MiniLM-L6-v2", "refs/pr/1")
    ModelSpec(name="m", kind="text", source=f"hf:acme/minilm@{COMMIT_OLD}")
    for bad, field in (("hf:minilm", "repository id"), ("hf:acme/minilm@", "revision ''"),
                       ("hf:acme/mini lm", "repository id"), ("hf:acme/minilm@v 1", "revision 'v 1'"),
                       ("hf:acme/../x", "repository id"), ("hf:acme/minilm@../main", "revision")):
        with pytest.raises(ValidationError, match=field):
            ModelSpec(name="m", kind="text", source=bad)
    with pytest.raises(ValidationError, match="timm"):
        ModelSpec(name="m", kind="vision", source="hf:acme/vit", num_classes=10)


def test_an_app_naming_a_revision_missing_from_the_cache_fails_before_any_replica(hub_cache):
    """The app builder reads each text model's tokenizer, so a Hub revision the offline cache lacks fails the
    build (no Ray needed), naming it."""
    from rayserve_apps.app import build_app

    spec = {"models": [{"name": "minilm", "kind": "text", "source": "hf:acme/minilm@v9"}],
            "controller": {"enabled": False}}
    with pytest.raises(ValueError, match="revision 'v9'"):
        build_app(spec)
    shutil.rmtree(hub_cache / "models--acme--minilm" / "refs")
    with pytest.raises(ValueError, match="revision 'main'"):
        load_text_tokenizer("hf:acme/minilm")
