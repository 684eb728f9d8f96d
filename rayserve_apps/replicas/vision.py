"""The per-model vision deployment: a replica that classifies images with a ViT, on the serving engine.

Images arrive as float32 arrays [N, C, H, W] already checked by the ingress; the replica checks them again (a
handle caller may skip the ingress) and answers the arg-max label with the class probabilities. Every image is
one item of the model's `ServingEngine` (`rayserve_apps/engine/`), so images of concurrent requests share batches:

* plain (default): a timm ViT; FIFO batches of up to `max_batch_size` images (`ImageBatchFormer`).
* token adaptation (OTAS), when the model's spec names a policy for the role ``token_adaptation``: the unified
  adaptive ViT with its task registry (`models/task_registry.py`), driven by the OTAS policies of
  `placement/otas/` on the wall clock (`rayserve_apps/engine/otas_executor.py`): Alg. 1 batching, eviction of
  queries that cannot meet their deadline, Alg. 2/3 token allocation from the measured profile, and utility
  accounting. Metrics: chosen gamma, batch size, utility and outcomes (`plexserve_otas_*`).
"""

from __future__ import annotations

import numpy as np
import torch
from ray import serve

from models.device import CPU_RESOURCE, select_device
from models.vit import load_vit
from placement.core.deployment_spec import ModelSpec
from rayserve_apps._threads import set_torch_threads_for
from rayserve_apps.engine import ImageBatchFormer, InProcessVisionBackend, ServingEngine
from rayserve_apps.engine.otas_executor import OtasExecutor, OtasMetrics, load_otas_parts, token_adaptation_params


@serve.deployment
class VisionModelDeployment:
    """Hosts one ViT classifier; `classify` is its whole API."""

    def __init__(self, model_spec: dict, device_resource: str = CPU_RESOURCE):
        self.spec = ModelSpec.model_validate(model_spec)
        #: CUDA when this replica reserved a GPU share and torch sees it (`models.device.select_device`), for the
        #: plain ViT and the token-adaptation (OTAS) backbone, heads and prompts alike; each batch goes there and
        #: its answers come back to the CPU.
        self.device = select_device(device_resource)
        set_torch_threads_for(self.spec.num_cpus_per_replica)
        self.otas: OtasExecutor | None = None
        otas = token_adaptation_params(self.spec)
        if otas is not None:
            registry, profile = load_otas_parts(self.spec, otas)
            registry.to(self.device)
            self.otas = OtasExecutor(registry, profile, otas, self.spec.slo_ms, OtasMetrics(self.spec.name),
                                     name=self.spec.name)
            return
        self.classifier = load_vit(
            self.spec.source, checkpoint_path=self.spec.checkpoint_path, num_classes=self.spec.num_classes or 1000,
            image_size_px=self.spec.image_size_px or 224, in_chans=self.spec.in_chans, name=self.spec.name,
            **self.spec.timm_kwargs,
        )
        self.classifier.model.to(self.device)
        former = ImageBatchFormer(self.spec.max_batch_size, self.spec.batch_wait_timeout_ms / 1000.0)
        self.engine = ServingEngine(self.spec.name, former, InProcessVisionBackend(self.classifier))

    async def classify(self, images: np.ndarray, task_id: str | None = None, slo_ms: float | None = None,
                       utility: float | None = None) -> list[dict]:
        """One {'label', 'probabilities'} per image, in input order; ValueError for a bad array.

        With token adaptation each image is an OTAS query of `task_id` (default: the configured task) with `slo_ms`
        and `utility`; the answer also names the task and the gamma its batch ran at.
        """
        tensor = torch.as_tensor(np.asarray(images))
        if self.otas is not None:
            return await self.otas.classify(tensor.float() if tensor.dtype == torch.float64 else tensor, task_id,
                                            slo_ms, utility)
        if task_id is not None:
            raise ValueError(f"model {self.spec.name!r} has no token_adaptation policy, so it takes no task_id")
        self.classifier.check_images(tensor)
        return await self.engine.answer(list(tensor.float()), self.engine.clock() + self.spec.slo_ms / 1000.0)
