"""The draft of a target read with safetensors (or InstantTensor, modes ``auto`` and
``safetensors``): its planned tensors by explicit reads of their byte ranges."""

from __future__ import annotations

from hybrid_draft.adapter.model_loader.base import PlannedDraftLoader
from hybrid_draft.core import checkpoint, readers
from hybrid_draft.core.policy import FILTERED
from hybrid_draft.core.readers import Weights


class FilteredSafetensorsLoader(PlannedDraftLoader):
    """Safetensors read by the draft's plan: never a tensor the plan leaves out."""

    load_format = FILTERED

    def read(self, selection: checkpoint.Selection) -> Weights:
        return readers.lazy_filtered_iterator(selection, self.progress)
