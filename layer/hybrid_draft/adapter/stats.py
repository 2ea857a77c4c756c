"""vLLM's loaders, instrumented for the load figures (``core/figures.py``).

vLLM's ``DefaultModelLoader`` (and every loader built on it, hybrid-draft's own included)
and its ``RunaiModelStreamerLoader`` report into the current load's
:class:`~hybrid_draft.core.figures.LoadStats`: ``_prepare_weights`` the shards it resolved,
vLLM's shard filters and its Run:ai iterator the shards they drop or open,
``get_all_weights`` each tensor it yields to the model (and shows it to the load's observer:
the one-pass tap).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import suppress
from typing import Any

from hybrid_draft.core import checkpoint
from hybrid_draft.core.figures import current, dropped, observed, received, resolved

#: The shard filters of vLLM's ``default_loader`` whose dropped files are never opened.
FILE_FILTERS = (
    "filter_safetensors_files_by_weight_name",
    "filter_mm_encoder_only_safetensors_files",
)
_MARK = "__hybrid_draft_stats__"


def _counting(get_all_weights: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(get_all_weights)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        return observed(get_all_weights(self, *args, **kwargs))

    return wrapper


def _resolving(prepare_weights: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(prepare_weights)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = prepare_weights(self, *args, **kwargs)
        with suppress(TypeError, IndexError):  # a return shape we don't know: no shard count
            _shards(result[1])
        return result

    return wrapper


def _resolving_list(prepare_weights: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(prepare_weights)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = prepare_weights(self, *args, **kwargs)
        if isinstance(result, list):
            _shards(result)
        return result

    return wrapper


def _shards(files: list[str]) -> None:
    """The shards a load resolved: recorded, and a local one that is not a regular file (a
    FIFO a read would wait on for ever) refused before vLLM opens it, naming it."""
    checkpoint.refuse_irregular(files)
    resolved(files)


def _streaming(iterator: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's Run:ai iterator: the files it streams are the shards opened (the rest of
    those resolved were dropped by vLLM's filter), and what it receives is counted."""

    @functools.wraps(iterator)
    def wrapper(hf_weights_files: list[str], *args: Any, **kwargs: Any) -> Any:
        stats = current()
        if stats is not None:
            stats.resolve(hf_weights_files)
            stats.dropped.update(set(stats.resolved) - set(hf_weights_files))
        return received(list(hf_weights_files), iterator(hf_weights_files, *args, **kwargs))

    return wrapper


def _dropping(file_filter: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(file_filter)
    def wrapper(hf_weights_files: list[str], *args: Any, **kwargs: Any) -> Any:
        kept = file_filter(hf_weights_files, *args, **kwargs)
        dropped(set(hf_weights_files) - set(kept))
        return kept

    return wrapper


def instrument(default_loader: Any) -> str | None:
    """Install the reporting wraps on vLLM's default loader module; None, or why not.

    Every tensor ``get_all_weights`` yields to the model is counted and shown to the
    current load's ``LoadStats.observe`` (the one-pass tap). Idempotent. A vLLM whose
    loader has another shape is left untouched: its loads are still timed and their bytes
    counted, only tensors and shards stay unknown.
    """
    cls = getattr(default_loader, "DefaultModelLoader", None)

    wraps: list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = [
        (cls, "get_all_weights", _counting),
        (cls, "_prepare_weights", _resolving),
    ]
    missing = [name for owner, name, _ in wraps if not callable(getattr(owner, name, None))]
    if missing:
        return f"DefaultModelLoader has no {', '.join(missing)}"
    # A filter this vLLM lacks is one it never applies.
    wraps += [
        (default_loader, name, _dropping)
        for name in FILE_FILTERS
        if callable(getattr(default_loader, name, None))
    ]
    _install(wraps)
    return None


def instrument_runai(runai_loader: Any) -> None:
    """Install the reporting wraps on vLLM's Run:ai loader module (its names probed by
    ``internals``' ``runai_stream`` part): every tensor its ``get_all_weights`` yields is
    counted and shown to the load's observer, the shards its ``_prepare_weights`` resolves
    and its iterator streams are recorded, and bytes from object storage counted.
    Idempotent."""
    cls = runai_loader.RunaiModelStreamerLoader
    _install(
        [
            (cls, "get_all_weights", _counting),
            (cls, "_prepare_weights", _resolving_list),
            (runai_loader, "runai_safetensors_weights_iterator", _streaming),
        ]
    )


def _install(
    wraps: list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]],
) -> None:
    for owner, name, wrap in wraps:
        current = getattr(owner, name)
        if not getattr(current, _MARK, False):
            wrapped = wrap(current)
            setattr(wrapped, _MARK, True)
            setattr(owner, name, wrapped)
