"""Text models from the Hugging Face Hub (`source: hf:ORG/NAME[@REVISION]`), resolved through huggingface_hub's cache.

`resolve_hub_source` turns a Hub source (syntax: `placement.core.model_sources`) into the cached snapshot directory
of its revision, `<cache>/models--ORG--NAME/snapshots/<commit>`, which the loaders of `models.text_encoder` then read
like any local model directory:

* the cache is huggingface_hub's: `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`, read from the
  environment at each call;
* offline (`HF_HUB_OFFLINE=1` or `TRANSFORMERS_OFFLINE=1`) only the cache is read: a branch or tag resolves through
  `refs/<name>`, a commit hash through `snapshots/<hash>`, and nothing touches the network;
* online, huggingface_hub fetches into the cache only what a sentence encoder needs: its config, tokenizer files,
  sentence-transformers configs and `model.safetensors` (`pytorch_model.bin` where the revision has no safetensors).

A repository or revision that cannot be resolved is a ValueError naming the source, the revision and the cache
directory, raised while the model loads, before its replica serves. A process resolves each source once and keeps
the commit it found, so that its tokenizer and weights come from the same snapshot even if a branch moves.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HFValidationError

from placement.core.model_sources import HubSource, parse_hub_source

logger = logging.getLogger(__name__)

#: Files of a sentence encoder besides its weights (fnmatch patterns; '*' also matches '/').
_CONFIG_PATTERNS = ["config.json", "tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json",
                    "added_tokens.json", "*.model", "modules.json", "sentence_bert_config.json",
                    "config_sentence_transformers.json", "*/config.json"]
#: Weight files, in order of preference: the second is fetched only when a revision lacks the first.
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_cache_dir() -> Path:
    """huggingface_hub's cache directory as the environment names it now (HF_HUB_CACHE, HF_HOME/hub, default)."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.path.expandvars(os.environ[variable])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """Whether the Hub may not be contacted (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set to a true value)."""
    return constants.HF_HUB_OFFLINE or any((os.environ.get(variable) or "").upper() in _TRUE
                                           for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@functools.lru_cache(maxsize=64)
def _snapshot(repo_id: str, revision: str, cache_dir: str, offline: bool) -> Path:
    """The snapshot directory of one revision (cached per process; failures are not cached)."""
    directory = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=offline,
                                       allow_patterns=_CONFIG_PATTERNS + [_WEIGHT_FILES[0]]))
    if not offline and not (directory / _WEIGHT_FILES[0]).exists():
        directory = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=False,
                                           allow_patterns=_CONFIG_PATTERNS + [_WEIGHT_FILES[1]]))
    return directory


def resolve_hub_source(source: str | HubSource) -> Path:
    """The local snapshot directory of a Hub source; ValueError naming the source, revision and cache when the
    repository or revision cannot be resolved (offline: is not in the cache)."""
    hub = parse_hub_source(source) if isinstance(source, str) else source
    name = source if isinstance(source, str) else f"hf:{hub.repo_id}"
    revision = hub.revision_or_default
    cache_dir, offline = hub_cache_dir(), hub_offline()
    try:
        directory = _snapshot(hub.repo_id, revision, str(cache_dir), offline)
    except (OSError, EntryNotFoundError, HFValidationError) as error:
        if offline:
            raise ValueError(
                f"source {name!r}: revision {revision!r} of Hub model {hub.repo_id!r} is not in the Hugging Face cache "
                f"{cache_dir}, and the Hub is offline (HF_HUB_OFFLINE=1), so only the cache is read; put that revision "
                f"in the cache first (`hf download {hub.repo_id} --revision {revision}` with HF_HUB_CACHE pointing "
                f"there) or name a revision it holds") from error
        raise ValueError(f"source {name!r}: revision {revision!r} of Hub model {hub.repo_id!r} could neither be "
                         f"fetched from the Hub nor found in the Hugging Face cache {cache_dir}: {error}") from error
    logger.info("Hub model %s at revision %s: %s", hub.repo_id, revision, directory)
    return directory
