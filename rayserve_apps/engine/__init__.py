"""The serving engine every replica embeds: queue -> batch former -> backend -> answers (see `engine.py`)."""

from rayserve_apps.engine.engine import (
                                         BatchBackend,
                                         BatchFormer,
                                         DeviceSlots,
                                         FormedBatch,
                                         ServingEngine,
                                         WorkItem,
                                         answer_requests,
)
from rayserve_apps.engine.text_batches import (
                                         DEFAULT_BATCHING_POLICY,
                                         InProcessTextBackend,
                                         StagedTextBackend,
                                         TextBatchFormer,
                                         batching_scheduler_for,
                                         pack_text_batch,
                                         packed_state,
)
from rayserve_apps.engine.vision_batches import (
                                         ImageBatchFormer,
                                         InProcessOtasBackend,
                                         InProcessVisionBackend,
                                         OtasBatchFormer,
                                         StagedOtasBackend,
                                         StagedVisionBackend,
)

__all__ = ["DEFAULT_BATCHING_POLICY", "BatchBackend", "BatchFormer", "DeviceSlots", "FormedBatch", "ImageBatchFormer",
           "InProcessOtasBackend", "InProcessTextBackend", "InProcessVisionBackend", "OtasBatchFormer",
           "ServingEngine", "StagedOtasBackend", "StagedTextBackend", "StagedVisionBackend", "TextBatchFormer",
           "WorkItem", "answer_requests", "batching_scheduler_for", "pack_text_batch", "packed_state"]
