"""The draft of a fastsafetensors target: its planned tensors read by fastsafetensors'
own loader, filtered by name (``set_tensor_filter``), so that only their byte ranges are
read and shards without a draft tensor are never opened."""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config

from hybrid_draft.adapter.model_loader.base import PlannedDraftLoader
from hybrid_draft.core import checkpoint, readers
from hybrid_draft.core.policy import FASTSAFETENSORS_FILTERED
from hybrid_draft.core.readers import Weights


def draft_device(device: str | None) -> torch.device:
    """The draft's device: the load config's, else the current config's, with CUDA's index."""
    chosen = torch.device(device or get_current_vllm_config().device_config.device or "cpu")
    if chosen.type == "cuda" and chosen.index is None:
        chosen = torch.device("cuda", torch.cuda.current_device())
    return chosen


class FilteredFastsafetensorsLoader(PlannedDraftLoader):
    """fastsafetensors reading only the draft's planned tensors."""

    load_format = FASTSAFETENSORS_FILTERED

    def read(self, selection: checkpoint.Selection) -> Weights:
        if not selection.files:
            return iter(())  # type: ignore[return-value]
        return readers.fastsafetensors_filtered_iterator(
            selection, draft_device(self.load_config.device), self.progress
        )
