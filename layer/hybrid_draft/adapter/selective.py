"""The ``selective`` mode's preflight: can this draft be streamed selectively here?

A selective draft is loaded by the ``instanttensor_selective`` loader (``loaders.py``):
InstantTensor 0.2.2's ``safe_open(..., tensor_filter=[names], tensor_name_match_mode=
"exact")`` skips unselected tensors before any I/O. That needs a checkpoint-weight rule
(to plan the names), safetensors shards, a plan that keeps something, a CUDA device and an
InstantTensor with ``tensor_filter``. When one is missing the draft falls back to the
filtered lazy path, and the decision says why: a stable ``fallback`` code and a ``detail``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hybrid_draft import checkpoint
from hybrid_draft.adapter import calls, rules

#: ``fallback`` codes of a ``selective_fallback`` decision.
FALLBACKS = (
    "no_rule",
    "no_safetensors",
    "empty_plan",
    "no_cuda",
    "no_tensor_filter",
    "planning_failed",
)

Blocker = tuple[str, str]  # (fallback code, detail)


def tensor_filter_supported() -> str | None:
    """None when the installed InstantTensor can filter tensors, else why not."""
    try:
        import instanttensor
    except Exception as exc:  # its CUDA extension may fail to load, not only be missing
        return f"instanttensor does not import: {exc!r}"
    try:
        params = inspect.signature(instanttensor.safe_open).parameters
    except (TypeError, ValueError):
        params = {}
    if "tensor_filter" not in params or "tensor_name_match_mode" not in params:
        version = getattr(instanttensor, "__version__", "installed")
        return f"instanttensor {version} has no tensor_filter (0.2.2 or later has)"
    return None


def cuda_unavailable(device: Any = None) -> str | None:
    """None when vLLM runs on CUDA and ``device`` (default: CUDA) is a CUDA device."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda() or not torch.cuda.is_available():
        platform = current_platform.device_type or "none detected"
        return f"CUDA is not available (vLLM platform: {platform})"
    if device is not None and torch.device(device).type != "cuda":
        return f"the draft loads onto {device}, not a CUDA device"
    return None


def draft_class(model_config: Any) -> type:
    from vllm.model_executor.model_loader.utils import get_model_architecture

    return get_model_architecture(model_config)[0]


def preflight(call: calls.Call) -> tuple[Blocker | None, checkpoint.Selection | None]:
    """Whether a selective draft load can run here: ((code, why not), None) or (None, plan).

    The plan comes first (a rule and the shard headers): it holds on any host, so a draft
    that would plan nothing says so even where CUDA is missing.
    """
    cls = draft_class(call.model_config)
    rules.install(cls)
    # vLLM builds an MTP draft with the target's model config: probe with the config the
    # built class would hold, not only the draft's rewritten one.
    is_unused = rules.probe_for(
        cls, call.vllm_config.model_config.hf_config, call.model_config.hf_config
    )
    if is_unused is None:
        return (
            "no_rule",
            f"{cls.__name__} has no checkpoint-weight rule to plan its tensors with",
        ), None
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    lazy = calls.lazy_load_config(call.load_config)
    _, files, use_safetensors, _ = DefaultModelLoader(lazy)._prepare_weights(
        call.model_config.model, None, call.model_config.revision, False, None
    )
    if not use_safetensors:
        return ("no_safetensors", "the checkpoint has no safetensors shards"), None
    plan = checkpoint.select(files, is_unused)
    if not plan.files:
        return (
            "empty_plan",
            f"the {cls.__name__} rule keeps none of the checkpoint's tensors",
        ), None
    device = call.load_config.device or call.vllm_config.device_config.device
    for code, problem in (
        ("no_cuda", cuda_unavailable(device)),
        ("no_tensor_filter", tensor_filter_supported()),
    ):
        if problem:
            return (code, problem), None
    return None, plan
