"""hybrid-draft's draft loaders, registered with vLLM's own ``register_model_loader``.

Each is vLLM's ``DefaultModelLoader`` but for one step: the draft's primary weights are
read from its :class:`~hybrid_draft.core.planning.DraftPlan` (made once, when the load was
decided) instead of by walking every shard. A shard holding nothing the draft keeps is
never opened; a tensor the rule rejects is never touched, as vLLM already skips other
ranks' experts (``should_skip_weight``) before reading; a tensor behind a module vLLM
replaces with the target's right after loading is not read at all (``sharing``); a tensor
the target's stream kept for the draft (``hold``) is taken from memory. Everything else is
vLLM's: the model's ``load_weights``, its "weights were not initialized" check (which the
skipped parameters pass only because vLLM replaces them, and only after the layer has
checked the rest are complete), quantization. A source without a plan (secondary weights,
a loader used without one) is read by vLLM's own lazy path.

The parts, as vLLM's ``model_loader/`` keeps its own:

- ``draftread``: what one load reads (:class:`DraftRead`), handed over by :func:`reading`;
- ``readers``: the weight iterators, one per read path (no vLLM import);
- ``model_loader/``: one small class per target format behind a registry, imported only
  when a loader is registered, after vLLM is. ``safetensors_filtered`` (modes ``auto`` and
  ``safetensors``): the kept tensors by explicit reads of their planned byte ranges;
  ``instanttensor_selective`` (mode ``selective``): InstantTensor's ``tensor_filter``;
  ``instanttensor_ungrouped``: vLLM's InstantTensor load with ``process_group=None``, for a
  draft only the last pipeline stage loads (``pipeline.py``).

This module is their one entry: the names the rest of the adapter, the tools and the tests
use, and :func:`register`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect

from hybrid_draft import settings
from hybrid_draft.adapter import internals
from hybrid_draft.core import policy
from hybrid_draft.core.draftread import (
    FASTSAFETENSORS_FILTERED,
    FILTERED,
    FILTERED_BY_FAMILY,
    RUNAI_FILTERED,
    SELECTIVE,
    UNGROUPED,
    DraftRead,
    current,
    reading,
)
from hybrid_draft.core.readers import (
    Weights,
    fastsafetensors_filtered_iterator,
    instanttensor_selective_iterator,
    instanttensor_ungrouped_iterator,
    lazy_filtered_iterator,
    runai_filtered_iterator,
)

__all__ = [
    "FASTSAFETENSORS_FILTERED",
    "FILTERED",
    "FILTERED_BY_FAMILY",
    "RUNAI_FILTERED",
    "SELECTIVE",
    "UNGROUPED",
    "DraftRead",
    "Weights",
    "available_formats",
    "current",
    "fastsafetensors_filtered_iterator",
    "handled_formats",
    "instanttensor_selective_iterator",
    "instanttensor_ungrouped_iterator",
    "lazy_filtered_iterator",
    "reading",
    "register",
    "runai_filtered_iterator",
    "unfiltered",
    "unfiltered_formats",
]


@functools.cache
def _loader_classes() -> dict[str, type]:
    """The registry of loader classes (imports vLLM: called once a loader is registered)."""
    from hybrid_draft.adapter.model_loader import LOADERS

    return LOADERS


@functools.cache
def register(load_format: str) -> None:
    """Register one of this layer's loaders with vLLM, once per process (a failure is
    not remembered: the next call tries again)."""
    internals.register_model_loader(load_format, _loader_classes()[load_format])


#: What each target format's filtered draft read needs: a module, the name in it that reads,
#: and the parameter that filters by tensor name (InstantTensor's drafts are read with
#: safetensors, always there).
_LIBRARIES = {
    policy.FASTSAFETENSORS: ("fastsafetensors", "SafeTensorsFileLoader.set_tensor_filter", None),
    policy.RUNAI_STREAMER: (
        "runai_model_streamer",
        "SafetensorsStreamer.stream_files",
        "tensor_names",
    ),
}


def _reads_filtered(module: str, name: str, parameter: str | None) -> bool:
    if importlib.util.find_spec(module) is None:
        return False
    try:
        found: object = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
        if parameter is None:
            return True
        return callable(found) and parameter in inspect.signature(found).parameters
    except Exception:  # an older or broken library: its targets' drafts are vLLM's
        return False


@functools.cache
def available_formats() -> tuple[str, ...]:
    """The target formats whose draft loader can run here: its library imports with its
    filter by tensor name (fastsafetensors 0.5, Run:ai Model Streamer 0.17 or later)."""
    return (
        policy.INSTANTTENSOR,
        *(fmt for fmt, need in _LIBRARIES.items() if _reads_filtered(*need)),
    )


@functools.cache
def unfiltered_formats() -> tuple[str, ...]:
    """The target formats whose library imports here but cannot filter by tensor name (an
    older fastsafetensors or Run:ai Model Streamer): their drafts load as vLLM loads them,
    and their decisions say why (``no_tensor_filter``)."""
    return tuple(
        fmt
        for fmt, need in _LIBRARIES.items()
        if importlib.util.find_spec(need[0]) is not None and not _reads_filtered(*need)
    )


def unfiltered(current: settings.Settings) -> tuple[str, ...]:
    """:func:`unfiltered_formats` less those ``keep_formats`` leaves to vLLM anyway (the
    setting is then the reason)."""
    keep = tuple(current.keep_formats.value)
    return tuple(f for f in unfiltered_formats() if f not in keep)


def handled_formats(current: settings.Settings) -> tuple[str, ...]:
    """The target formats whose drafts the layer reads filtered under ``current``."""
    return policy.handled_formats(tuple(current.keep_formats.value), available_formats())
