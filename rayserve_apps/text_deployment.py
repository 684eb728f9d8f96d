"""The per-model text deployment: a replica that embeds already tokenized texts.

The ingress tokenizes and validates; this replica re-checks the token ids (a handle caller may skip the
ingress), forms batches across concurrent requests with `@serve.batch`, pads each batch to its longest text and
runs the encoder. Later execution paths (concat batching) replace the batch former, not this interface.
"""

from __future__ import annotations

import logging

from ray import serve

from models.text_encoder import load_text_encoder
from placement.spec import ModelSpec
from rayserve_apps._threads import set_torch_threads_for

logger = logging.getLogger("ray.serve")


@serve.deployment
class TextModelDeployment:
    """Hosts one text encoder; `embed_token_ids` is its whole API."""

    def __init__(self, model_spec: dict):
        self.spec = ModelSpec.model_validate(model_spec)
        set_torch_threads_for(self.spec.num_cpus_per_replica)
        self.encoder = load_text_encoder(self.spec.source, name=self.spec.name)
        self.limit = self.spec.max_input_length_tokens or self.encoder.max_length
        self._embed_batch.set_max_batch_size(self.spec.max_batch_size)
        self._embed_batch.set_batch_wait_timeout_s(self.spec.batch_wait_timeout_ms / 1000.0)

    async def embed_token_ids(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Unit-norm embeddings of tokenized texts, in input order; ValueError for bad ids."""
        if not isinstance(token_ids, list) or not token_ids:
            raise ValueError("token_ids must be a non-empty list of token id lists")
        self.encoder.text_tokenizer.check_token_ids(token_ids, self.limit)
        return await self._embed_batch(token_ids)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def _embed_batch(self, requests: list[list[list[int]]]) -> list[list[list[float]]]:
        flat = [ids for request in requests for ids in request]
        embeddings = self.encoder.embed_token_ids(flat).tolist()
        results, start = [], 0
        for request in requests:
            results.append(embeddings[start : start + len(request)])
            start += len(request)
        return results

    def check_health(self) -> None:
        if self.encoder is None:  # pragma: no cover - defensive
            raise RuntimeError("encoder not loaded")
