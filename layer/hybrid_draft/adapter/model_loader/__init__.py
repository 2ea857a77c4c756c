"""The layer's draft loaders, one small class per target format, as vLLM's own
``model_executor/model_loader/`` keeps its loaders: a base (``base.py``) and a module per
format. Imports vLLM: imported only by ``loaders.register``, after vLLM is."""

from __future__ import annotations

from hybrid_draft.adapter.model_loader.base import PlannedDraftLoader
from hybrid_draft.adapter.model_loader.fastsafetensors_loader import (
    FilteredFastsafetensorsLoader,
)
from hybrid_draft.adapter.model_loader.instanttensor_loader import (
    SelectiveInstantTensorLoader,
    UngroupedInstantTensorLoader,
)
from hybrid_draft.adapter.model_loader.runai_streamer_loader import FilteredRunaiStreamerLoader
from hybrid_draft.adapter.model_loader.safetensors_loader import FilteredSafetensorsLoader

#: Every loader the layer registers, by the load format it is registered under.
LOADERS: dict[str, type] = {
    FilteredSafetensorsLoader.load_format: FilteredSafetensorsLoader,
    SelectiveInstantTensorLoader.load_format: SelectiveInstantTensorLoader,
    UngroupedInstantTensorLoader.load_format: UngroupedInstantTensorLoader,
    FilteredFastsafetensorsLoader.load_format: FilteredFastsafetensorsLoader,
    FilteredRunaiStreamerLoader.load_format: FilteredRunaiStreamerLoader,
}

__all__ = ["LOADERS", "PlannedDraftLoader"]
