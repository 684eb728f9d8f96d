"""Model sources named in a spec: the syntax of a Hugging Face Hub source, checked without touching the Hub.

A text model's `source` may be `hf:ORG/NAME` (the Hub repository's default branch, `main`) or
`hf:ORG/NAME@REVISION`, where REVISION is a branch, a tag or a commit hash. The revision rides in the source string
itself, so everything that passes a source along (replicas, stage actors, the ingress' tokenizer) carries it
unchanged. Resolving the source to files is `models.hub`'s (through huggingface_hub's cache); this module only
parses and validates it, so that a malformed source fails at spec validation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Prefix of a Hugging Face Hub source.
HUB_SOURCE_PREFIX = "hf:"
#: One part of a Hub repository id (the organisation or the name), as the Hub accepts them.
_REPO_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"^{_REPO_PART}/{_REPO_PART}$")
#: A git branch, tag or commit hash: letters, digits, '.', '_', '-' and '/' between parts.
_REVISION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*(?:/[A-Za-z0-9_][A-Za-z0-9._-]*)*$")
#: Longest accepted revision, in characters.
MAX_REVISION_CHARS = 255


@dataclass(frozen=True)
class HubSource:
    """A Hub model: its repository id and the revision asked for (None: the default branch)."""

    repo_id: str
    revision: str | None = None

    @property
    def revision_or_default(self) -> str:
        return self.revision or "main"


def is_hub_source(source: str) -> bool:
    return source.startswith(HUB_SOURCE_PREFIX)


def parse_hub_source(source: str) -> HubSource:
    """`hf:ORG/NAME` or `hf:ORG/NAME@REVISION` -> HubSource; ValueError naming the part that is malformed."""
    if not is_hub_source(source):
        raise ValueError(f"source {source!r} is not a Hub source (it starts with {HUB_SOURCE_PREFIX!r})")
    repo_id, at, revision = source[len(HUB_SOURCE_PREFIX):].partition("@")
    if not _REPO_ID.match(repo_id) or ".." in repo_id or "--" in repo_id:
        raise ValueError(f"source {source!r}: a Hub model is named 'hf:ORG/NAME' or 'hf:ORG/NAME@REVISION' (ORG and "
                         f"NAME of letters, digits, '.', '_', '-', at most 96 characters each, no '--' or '..'), "
                         f"got repository id {repo_id!r}")
    if not at:
        return HubSource(repo_id)
    if (not _REVISION.match(revision) or len(revision) > MAX_REVISION_CHARS or ".." in revision
            or revision.endswith(".lock")):
        raise ValueError(f"source {source!r}: revision {revision!r} is not a branch, tag or commit hash (letters, "
                         f"digits, '.', '_', '-', '/' between parts, at most {MAX_REVISION_CHARS} characters)")
    return HubSource(repo_id, revision)
