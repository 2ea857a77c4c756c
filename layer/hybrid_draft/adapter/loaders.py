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

The classes, as vLLM's ``model_loader/`` keeps its own, are one small class per target
format behind a registry (``model_loader/``); they read through the core
(``core/draftload.py``, ``core/readers.py``). ``safetensors_filtered`` (modes ``auto`` and
``safetensors``): the kept tensors by explicit reads of their planned byte ranges;
``instanttensor_selective`` (mode ``selective``): InstantTensor's ``tensor_filter``;
``instanttensor_ungrouped``: vLLM's InstantTensor load with ``process_group=None``, for a
draft only the last pipeline stage loads (``drafting.route``); ``fastsafetensors_filtered`` and
``runai_streamer_filtered``: the target's own library, filtered by name.

This module is their one entry, and cheap to import: the hook registers every format with
vLLM as its model loader is imported (:func:`register_all`), so a user's own
``draft_load_config`` may name one, but registers a stand-in that builds the real loader,
importing the classes and the core, only when vLLM first asks for one.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
from typing import TYPE_CHECKING, Any

from hybrid_draft.adapter import internals
from hybrid_draft.core import policy

if TYPE_CHECKING:
    from hybrid_draft import settings

#: Each load format the layer registers, and the part of the layer it belongs to.
PARTS = {
    **{fmt: "draft_loaders" for fmt in (*policy.FILTERED_BY_FAMILY.values(), policy.SELECTIVE)},
    policy.UNGROUPED: "ungrouped_draft",
}


@functools.cache
def _loader_classes() -> dict[str, type]:
    """The registry of loader classes (imports vLLM: called once a loader is built)."""
    from hybrid_draft.adapter.model_loader import LOADERS

    return LOADERS


def _stand_in(load_format: str) -> type:
    """A ``BaseModelLoader`` registered under ``load_format`` whose construction builds
    the layer's real loader for it (imported then), or says why that part is off here."""
    base = sys.modules[f"{internals.MODULE}.base_loader"].BaseModelLoader

    def __new__(cls: type, load_config: Any) -> Any:
        why = internals.capabilities().reason(PARTS[load_format])
        if why is not None:
            raise ValueError(f"load format {load_format} is off here: {why}")
        return _loader_classes()[load_format](load_config)

    return type(
        f"HybridDraftLoader[{load_format}]",
        (base,),
        {"__new__": __new__, "load_format": load_format, "__module__": __name__},
    )


@functools.cache
def register_all() -> dict[str, str]:
    """Register every format of :data:`PARTS` with vLLM, once per process; the parts that
    failed to, with why (a part off is off: its loads stay vLLM's)."""
    failed: dict[str, str] = {}
    for fmt, part in PARTS.items():
        if part in failed:
            continue
        try:
            internals.register_model_loader(fmt, _stand_in(fmt))
        except Exception as exc:  # vLLM without them is vLLM as it was
            failed[part] = f"registering its load formats failed: {type(exc).__name__}: {exc}"
    return failed


def loader_class(load_format: str) -> type:
    """The layer's real loader class of ``load_format`` (imports the classes)."""
    return _loader_classes()[load_format]


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
