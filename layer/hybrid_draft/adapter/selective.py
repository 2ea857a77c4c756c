"""The ``selective`` mode's host checks: can a draft be streamed selectively on this host?

A selective draft is loaded by the ``instanttensor_selective`` loader (``loaders.py``):
InstantTensor 0.2.2's ``safe_open(..., tensor_filter=[names], tensor_name_match_mode=
"exact")`` skips unselected tensors before any I/O. That needs a checkpoint-weight rule
(to plan the names), safetensors shards, a plan that keeps something, a CUDA device and an
InstantTensor with ``tensor_filter``. When one is missing the draft falls back to the
filtered lazy path, and the decision says why: a stable ``fallback`` code and a ``detail``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

#: ``fallback`` codes of a ``selective_fallback`` decision.
FALLBACKS = (
    "no_rule",
    "no_safetensors",
    "empty_plan",
    "no_cuda",
    "no_tensor_filter",
    "planning_failed",
    "part_skipped",
)

Blocker = tuple[str, str]  # (fallback code, detail)


def tensor_filter_supported() -> str | None:
    """None when the installed InstantTensor can filter tensors, else why not."""
    try:
        import instanttensor
    except Exception as exc:  # its CUDA extension may fail to load, not only be missing
        return f"instanttensor does not import: {exc!r}"
    try:
        params: Mapping[str, Any] = inspect.signature(instanttensor.safe_open).parameters
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


def host_blocker(device: Any = None) -> Blocker | None:
    """Why selective cannot stream on this host, as ``(fallback code, detail)``, or None:
    the host's half of the selective preflight (the checkpoint's half is the plan's)."""
    for code, problem in (
        ("no_cuda", cuda_unavailable(device)),
        ("no_tensor_filter", tensor_filter_supported()),
    ):
        if problem:
            return code, problem
    return None
