"""vLLM's private names the layer calls (interim: see the door module)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import LoadConfig, ModelConfig, VllmConfig


@dataclass(frozen=True)
class Capabilities:
    off: Mapping[str, str]


def capabilities() -> Capabilities:
    from hybrid_draft.adapter import patch

    return Capabilities(off=dict(patch.OFF))


def is_last_pp_rank() -> bool:
    from vllm.distributed.parallel_state import get_pp_group

    return bool(get_pp_group().is_last_rank)


def draft_load_config(vllm_config: VllmConfig) -> LoadConfig:
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    return get_draft_load_config(vllm_config)


def expert_filter(load_config: LoadConfig, model_config: ModelConfig) -> Callable[[str], bool]:
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight

    probe: Any = DefaultModelLoader(load_config)
    probe._init_ep_weight_filter(model_config)
    local = probe.local_expert_ids
    return lambda name: bool(should_skip_weight(name, local))
