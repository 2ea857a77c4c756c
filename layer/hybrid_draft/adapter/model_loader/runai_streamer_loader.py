"""The draft of a Run:ai Model Streamer target: its planned tensors streamed by Run:ai's own
``SafetensorsStreamer``, filtered by name (``tensor_names``), so that only their byte ranges
are read and shards without a draft tensor are never opened."""

from __future__ import annotations

from hybrid_draft.adapter.model_loader.base import PlannedDraftLoader
from hybrid_draft.core import checkpoint, readers
from hybrid_draft.core.policy import RUNAI_FILTERED
from hybrid_draft.core.readers import Weights


class FilteredRunaiStreamerLoader(PlannedDraftLoader):
    """Run:ai's streamer reading only the draft's planned tensors, from local files or
    object storage."""

    load_format = RUNAI_FILTERED

    def read(self, selection: checkpoint.Selection) -> Weights:
        if not selection.files:
            return iter(())  # type: ignore[return-value]
        access = self.draft.access if self.draft is not None else None
        return readers.runai_filtered_iterator(selection, self.progress, access)
