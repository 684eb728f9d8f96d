"""The per-model vision deployment: a replica that classifies images with a ViT.

Images arrive as float32 arrays [N, C, H, W] already checked by the ingress; the replica checks them again (a
handle caller may skip the ingress), batches concurrent requests with `@serve.batch` and answers the arg-max
label with the class probabilities.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from ray import serve

from models.vit import load_vit
from placement.spec import ModelSpec
from rayserve_apps._threads import set_torch_threads_for

logger = logging.getLogger("ray.serve")


@serve.deployment
class VisionModelDeployment:
    """Hosts one ViT classifier; `classify` is its whole API."""

    def __init__(self, model_spec: dict):
        self.spec = ModelSpec.model_validate(model_spec)
        set_torch_threads_for(self.spec.num_cpus_per_replica)
        self.classifier = load_vit(
            self.spec.source, checkpoint_path=self.spec.checkpoint_path, num_classes=self.spec.num_classes or 1000,
            image_size_px=self.spec.image_size_px or 224, in_chans=self.spec.in_chans, name=self.spec.name,
            **self.spec.timm_kwargs,
        )
        self._classify_batch.set_max_batch_size(self.spec.max_batch_size)
        self._classify_batch.set_batch_wait_timeout_s(self.spec.batch_wait_timeout_ms / 1000.0)

    async def classify(self, images: np.ndarray) -> list[dict]:
        """One {'label', 'probabilities'} per image, in input order; ValueError for a bad array."""
        tensor = torch.as_tensor(np.asarray(images))
        self.classifier.check_images(tensor)
        return await self._classify_batch(tensor.float())

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def _classify_batch(self, requests: list[torch.Tensor]) -> list[list[dict]]:
        probabilities = torch.softmax(self.classifier.logits(torch.cat(requests)), dim=-1)
        results, start = [], 0
        for request in requests:
            chunk = probabilities[start : start + len(request)]
            results.append([{"label": int(p.argmax()), "probabilities": p.tolist()} for p in chunk])
            start += len(request)
        return results
