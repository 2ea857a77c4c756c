"""The draft of an InstantTensor target: the selective read (mode ``selective``) and vLLM's
own InstantTensor load without the world group (a draft only the last pipeline stage loads).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import TYPE_CHECKING

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from hybrid_draft.adapter import internals
from hybrid_draft.adapter.model_loader.base import PlannedDraftLoader
from hybrid_draft.core import checkpoint, policy, readers
from hybrid_draft.core.policy import SELECTIVE, UNGROUPED
from hybrid_draft.core.readers import Weights

if TYPE_CHECKING:
    from vllm.config.load import LoadConfig

    Source = DefaultModelLoader.Source


class SelectiveInstantTensorLoader(PlannedDraftLoader):
    """InstantTensor streaming only the draft's planned tensors onto its device."""

    load_format = SELECTIVE

    def read(self, selection: checkpoint.Selection) -> Weights:
        if not selection.files:
            return iter(())  # type: ignore[return-value]
        device = torch.device(
            self.load_config.device or get_current_vllm_config().device_config.device or "cpu"
        )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return readers.instanttensor_selective_iterator(selection, device, self.progress)


class UngroupedInstantTensorLoader(DefaultModelLoader):
    """vLLM's InstantTensor load, without the world group (a last-stage-only draft)."""

    load_format = UNGROUPED

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(dataclasses.replace(load_config, load_format=policy.INSTANTTENSOR))

    def _get_weights_iterator(self, source: Source) -> Weights:
        from vllm.config import get_current_vllm_config_or_none
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            # vLLM's own read: off CUDA its iterator refuses InstantTensor before it
            # picks a process group, so there is no collective to avoid.
            return super()._get_weights_iterator(source)
        # The steps of vLLM's _get_weights_iterator before its InstantTensor read,
        # through default_loader's names (the layer's load figures see them there).
        default_loader = sys.modules[DefaultModelLoader.__module__]
        folder, files, use_safetensors, index_file = internals.prepare_weights(
            self,
            source.model_or_path,
            source.subfolder,
            source.revision,
            source.fall_back_to_pt,
            source.allow_patterns_overrides,
        )
        if not use_safetensors:  # .bin/.pt: vLLM's readers, which involve no group
            return super()._get_weights_iterator(source)
        if self._encoder_only_lm_prefixes is not None and files:
            files = default_loader.filter_mm_encoder_only_safetensors_files(
                files,
                folder,
                index_file,
                self._encoder_only_lm_prefixes,
                weights_mapper=self._encoder_only_weights_mapper,
            )
        if source.is_unused_weight is not None:
            files = default_loader.filter_safetensors_files_by_weight_name(
                files, source.is_unused_weight
            )
        vllm_config = get_current_vllm_config_or_none()
        engram = getattr(vllm_config, "engram_config", None) if vllm_config else None
        if self.counter_before_loading_weights == 0.0:
            self.counter_before_loading_weights = time.perf_counter()
        weights = readers.instanttensor_ungrouped_iterator(
            files,
            current_platform.current_device(),
            internals.enable_tqdm(self.load_config.use_tqdm_on_load),
            self.local_expert_ids,
            bool(engram and getattr(engram, "cpu_offload", False)),
            internals.should_skip_weight,
            internals.engram_pattern(),
        )
        return ((source.prefix + name, tensor) for name, tensor in weights)
