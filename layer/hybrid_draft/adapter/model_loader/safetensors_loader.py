"""The draft of a target read with safetensors (or InstantTensor, modes ``auto`` and
``safetensors``): its planned tensors by explicit reads of their byte ranges."""

from __future__ import annotations

from hybrid_draft import checkpoint
from hybrid_draft.adapter import readers
from hybrid_draft.adapter.draftread import FILTERED
from hybrid_draft.adapter.model_loader.base import PlannedDraftLoader
from hybrid_draft.adapter.readers import Weights


class FilteredSafetensorsLoader(PlannedDraftLoader):
    """Safetensors read by the draft's plan: never a tensor the plan leaves out."""

    load_format = FILTERED

    def read(self, selection: checkpoint.Selection) -> Weights:
        return readers.lazy_filtered_iterator(selection, self.load_config.use_tqdm_on_load)
