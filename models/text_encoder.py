"""BERT-family sentence encoders loaded from a model directory, pooled as their sentence-transformers config says.

Sources (`resolve_text_source`): `package:all-minilm-l6-v2` and `package:all-mpnet-base-v2` load real weights that
ship in packages (models/packaged.py); `hf:ORG/NAME[@REVISION]` is a Hugging Face Hub model, resolved through
huggingface_hub's cache (`models.hub`: offline, the cache only); any other source is a local Hugging Face model
directory. transformers then reads the directory with `local_files_only=True` and a missing file is a clear error.

Pooling (`checkpoint_pooling`) follows the directory's sentence-transformers modules: `modules.json` lists a
`Pooling` module whose `config.json` names the mode (mean, CLS, max, mean of sqrt length, last token) and, when a
`Normalize` module follows, the embedding is L2-normalised. A directory without `modules.json` is pooled by the
mean of its real tokens' states, L2-normalised (sentence-transformers' usual `Pooling(mean)` + `Normalize`). Any
other module (`Dense`, ...) or pooling mode is refused with a ValueError naming it, so that no model serves
embeddings other than those its checkpoint defines.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal, Sequence

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from models.hub import resolve_hub_source
from models.layers import ActivationState, Layer, parameter_bytes, run_layers
from models.mpnet_layers import is_mpnet, mpnet_body_layers
from models.packaged import packaged_model_directory
from models.partial_load import parameters_on_meta
from ops.concat_attention import SEGMENT_ATTENTION, register_segment_attention
from ops.pooling import DEFAULT_POOLING, Pooling, pool_padded
from placement.core.model_sources import HUB_SOURCE_PREFIX

logger = logging.getLogger(__name__)

PACKAGE_SOURCE_PREFIX = "package:"
MINILM_SOURCE = "package:all-minilm-l6-v2"
#: Model types whose transformers implementation has no sdpa attention (MPNet adds its relative position bias to
#: eager attention scores): they load with eager attention whatever is asked.
EAGER_ONLY_MODEL_TYPES = frozenset({"mpnet"})
#: Weight files of which a Hugging Face model directory must hold one.
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def resolve_text_source(source: str) -> Path:
    """The local directory that holds a text model's config, tokenizer and weights (a Hub model's cached snapshot)."""
    if source.startswith(HUB_SOURCE_PREFIX):
        directory = resolve_hub_source(source)
    elif source.startswith(PACKAGE_SOURCE_PREFIX):
        directory = packaged_model_directory(source[len(PACKAGE_SOURCE_PREFIX):])
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


class PoolingLayer(Layer):
    """The sentence embedding of padded token states: the checkpoint's pooling (`ops.pooling`)."""

    kind = "head"

    def __init__(self, pooling: Pooling = DEFAULT_POOLING):
        super().__init__()
        self.pooling = pooling

    def forward(self, state: ActivationState) -> ActivationState:
        return ActivationState(hidden=pool_padded(state.hidden, state.attention_mask, self.pooling))


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
    """A sentence encoder: tokenizer + BERT-family model + its checkpoint's pooling (and normalisation)."""

    kind = "text"

    def __init__(self, name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, max_length: int,
                 pooling: Pooling = DEFAULT_POOLING):
        self.name = name
        #: How token states become one embedding; every text path (padded, packed, staged) pools with it.
        self.pooling = pooling
        self.model = model.eval()
        self.tokenizer = tokenizer
        #: Longest input in tokens, special tokens included.
        self.max_length = max_length
        #: None for a weightless skeleton (`load_text_encoder(weights="none")`): pipeline stages never tokenize.
        self.text_tokenizer = (TextTokenizer(tokenizer, max_length, model.config.vocab_size) if tokenizer is not None
                               else None)
        body = (mpnet_body_layers(model) if is_mpnet(model)
                else [EmbeddingsLayer(model.embeddings)] + [BlockLayer(b) for b in model.encoder.layer])
        self._layers = body + [PoolingLayer(pooling)]

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
        return run_layers(self._layers, state.to(self.model.device)).hidden

    def embed_token_ids(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """[len(token_ids), hidden] embeddings of already tokenized texts, one padded batch."""
        return self.embed_tokens(self.text_tokenizer.pad(token_ids))

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """[len(texts), hidden] embeddings (unit-norm unless the checkpoint's pooling does not normalise), one padded
        batch."""
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


#: sentence-transformers' Pooling config keys (`1_Pooling/config.json`) -> plexserve's pooling mode; None: refused.
_POOLING_CONFIG_MODES: dict[str, str | None] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "last_token",
    "pooling_mode_weightedmean_tokens": None,
}
#: sentence-transformers' `pooling_mode` string (its Pooling constructor argument) -> plexserve's pooling mode.
_POOLING_MODE_NAMES = {"cls": "cls", "mean": "mean", "max": "max", "mean_sqrt_len_tokens": "mean_sqrt_len",
                       "lasttoken": "last_token"}
#: sentence-transformers module types plexserve applies: the encoder itself, its pooling, L2 normalisation.
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


def _pooling_mode(config: dict, where: Path) -> str:
    """The one pooling mode a sentence-transformers Pooling config enables; ValueError naming what is unsupported."""
    if isinstance(config.get("pooling_mode"), str):
        name = config["pooling_mode"]
        if name not in _POOLING_MODE_NAMES:
            raise ValueError(f"{where}: pooling_mode {name!r} is not supported; supported: "
                             f"{', '.join(_POOLING_MODE_NAMES)}")
        return _POOLING_MODE_NAMES[name]
    enabled = [key for key, value in config.items() if key.startswith("pooling_mode_") and value is True]
    unknown = [key for key in enabled if _POOLING_CONFIG_MODES.get(key) is None]
    if unknown:
        supported = ", ".join(key for key, mode in _POOLING_CONFIG_MODES.items() if mode is not None)
        raise ValueError(f"{where}: pooling mode {unknown[0]} is not supported; supported: {supported}")
    if len(enabled) != 1:
        raise ValueError(f"{where}: exactly one pooling mode must be true (plexserve does not concatenate modes), "
                         f"got {enabled or 'none'}")
    return _POOLING_CONFIG_MODES[enabled[0]]  # type: ignore[return-value]


def checkpoint_pooling(directory: Path) -> Pooling:
    """The pooling a model directory's sentence-transformers config defines (`modules.json`, the Pooling module's
    `config.json`, a Normalize module); mean + L2 normalisation when the directory has no `modules.json`."""
    return _sentence_pooling(directory)[0]


def _sentence_pooling(directory: Path) -> tuple[Pooling, int | None]:
    """`checkpoint_pooling` and the Pooling config's `word_embedding_dimension` (None when it names none)."""
    modules_file = directory / "modules.json"
    if not modules_file.exists():
        return DEFAULT_POOLING, None
    try:
        modules = json.loads(modules_file.read_text())
        types = [str(module["type"]).rsplit(".", 1)[-1] for module in modules]
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{modules_file} is not a sentence-transformers modules list: {error}") from None
    for module, kind in zip(modules, types):
        if kind not in _ST_MODULES:
            raise ValueError(f"{modules_file}: module {module.get('name', '?')!r} of type {module['type']!r} is not "
                             f"supported; plexserve applies {', '.join(_ST_MODULES)} modules only")
    if types.count("Pooling") != 1 or types[0] != "Transformer":
        raise ValueError(f"{modules_file}: expected a Transformer module first and exactly one Pooling module, got "
                         f"{types}")
    pooling_index = types.index("Pooling")
    if "Normalize" in types and types.index("Normalize") < pooling_index:
        raise ValueError(f"{modules_file}: the Normalize module comes before the Pooling module")
    pooling_config = directory / str(modules[pooling_index].get("path", "")) / "config.json"
    if not pooling_config.exists():
        raise ValueError(f"{modules_file}: the Pooling module's config {pooling_config} does not exist")
    try:
        config = json.loads(pooling_config.read_text())
    except ValueError as error:
        raise ValueError(f"{pooling_config} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{pooling_config} must hold a JSON object")
    width = config.get("word_embedding_dimension")
    pooling = Pooling(mode=_pooling_mode(config, pooling_config), normalize="Normalize" in types)
    return pooling, int(width) if width is not None else None


def load_text_pooling(source: str = MINILM_SOURCE) -> Pooling:
    """The pooling of a text model (`checkpoint_pooling` of its directory), without loading its weights."""
    return checkpoint_pooling(resolve_text_source(source))


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
    """Load a BERT-family encoder and its pooling from a source (`resolve_text_source`; a Hub model through the
    cache, which is all it reads offline).

    weights="none": the model is built from its config with its parameters on the meta device and no tokenizer, and
    nothing is read (a pipeline stage then loads only its own tensors by name, `models.partial_load`).
    attn_implementation="sdpa_segments" computes packed rows per request segment (ops/concat_attention.py)."""
    if attn_implementation == SEGMENT_ATTENTION:
        register_segment_attention()
    directory = resolve_text_source(source)
    pooling, pooling_width = _sentence_pooling(directory)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True) if weights == "all" else None
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    if config.model_type in EAGER_ONLY_MODEL_TYPES:
        attn_implementation = "eager"
    if weights == "none":
        with parameters_on_meta():
            model = AutoModel.from_config(config, attn_implementation=attn_implementation)
    else:
        model = AutoModel.from_pretrained(directory, local_files_only=True, attn_implementation=attn_implementation)
    if not hasattr(model, "embeddings") or not hasattr(model, "encoder"):
        raise ValueError(f"{directory} is not a BERT-family encoder (no embeddings/encoder modules)")
    if pooling_width is not None and pooling_width != model.config.hidden_size:
        raise ValueError(f"{directory}: the Pooling config's word_embedding_dimension {pooling_width} differs from the "
                         f"encoder's hidden_size {model.config.hidden_size}")
    max_length = _configured_max_length(directory, model.config.max_position_embeddings)
    logger.info("loaded text encoder %s from %s (max %d tokens, %s attention, %s pooling%s)", name or source,
                directory, max_length, attn_implementation, pooling.mode, ", normalised" if pooling.normalize else "")
    return TextEncoder(name or directory.name, model, tokenizer, max_length, pooling)
