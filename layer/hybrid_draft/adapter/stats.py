"""What one ``get_model`` call cost: seconds, bytes read, tensors yielded, shards opened.

The wrapped ``get_model`` opens a :func:`measuring` scope; inside it, vLLM's
``DefaultModelLoader`` (and every loader built on it, hybrid-draft's own included) and its
``RunaiModelStreamerLoader`` report: ``_prepare_weights`` the shards it resolved, vLLM's
shard filters, its Run:ai iterator and this layer's planned loaders the shards they drop or
open, ``get_all_weights`` each tensor it yields to the model. Storage bytes come from the
kernel (``/proc/self/io``: what this process, all its threads, fetched from storage, so a
warm page cache reads 0), not from file sizes. Bytes from object storage (``s3://``,
``gs://``, ``az://``) never pass the kernel's storage count: they are the tensor bytes the
load received from there (:func:`fetched`). Other loaders (dummy, tensorizer...) report
seconds and storage bytes only.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from hybrid_draft import records

#: The shard filters of vLLM's ``default_loader`` whose dropped files are never opened.
FILE_FILTERS = (
    "filter_safetensors_files_by_weight_name",
    "filter_mm_encoder_only_safetensors_files",
)
_MARK = "__hybrid_draft_stats__"
#: The address schemes of object storage, as vLLM's Run:ai loader recognises them.
OBJECT_SCHEMES = ("s3://", "gs://", "az://")


def is_object_uri(path: str) -> bool:
    """Whether ``path`` names an object in object storage, not a local file."""
    return path.lower().startswith(OBJECT_SCHEMES)


def read_bytes() -> int | None:
    """Bytes this process has fetched from storage so far (None where the kernel won't say)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


@dataclass
class LoadStats:
    """One call's figures; shards are the files resolved minus those a filter dropped."""

    started: float = field(default_factory=time.perf_counter)
    read_at_start: int | None = field(default_factory=read_bytes)
    #: Each shard resolved, with its size (None: an object whose size is not known).
    resolved: dict[str, int | None] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)
    tensors: int | None = None
    #: Tensor bytes received from object storage (None: the load read none from there).
    network: int | None = None
    #: Sees every tensor a loader yields to the model during the load (the target's
    #: one-pass tap), or None.
    observe: Observer | None = None

    def resolve(self, files: Iterable[str], sizes: Mapping[str, int] | None = None) -> None:
        for f in files:
            if sizes is not None and f in sizes:
                self.resolved[f] = sizes[f]
            elif f not in self.resolved:
                if is_object_uri(f):
                    self.resolved[f] = None
                    continue
                try:
                    self.resolved[f] = os.path.getsize(f)
                except OSError:
                    self.resolved[f] = 0

    def cost(self) -> records.Cost:
        """The cost keys of ``hybrid_draft.loaded`` / ``load_failed``, as of now."""
        now = read_bytes()
        observed = bool(self.resolved) or self.tensors is not None
        opened = [f for f in self.resolved if f not in self.dropped]
        sizes = list(self.resolved.values())
        return records.Cost(
            seconds=round(time.perf_counter() - self.started, 6),
            bytes_read=(
                now - self.read_at_start
                if now is not None and self.read_at_start is not None
                else None
            ),
            network_bytes=self.network,
            tensors=self.tensors,
            shards=len(opened) if observed else None,
            checkpoint_shards=len(self.resolved) if observed else None,
            checkpoint_bytes=(
                sum(s for s in sizes if s is not None) if observed and None not in sizes else None
            ),
        )


_CURRENT: ContextVar[LoadStats | None] = ContextVar("hybrid_draft_load_stats", default=None)


def current() -> LoadStats | None:
    """The load being measured in this context (None: no load the layer decided)."""
    return _CURRENT.get()


@contextmanager
def measuring() -> Iterator[LoadStats]:
    stats = LoadStats()
    token = _CURRENT.set(stats)
    try:
        yield stats
    finally:
        _CURRENT.reset(token)


def resolved(files: Iterable[str], sizes: Mapping[str, int] | None = None) -> None:
    """Record shards a loader resolved for the current call, with their ``sizes`` where
    known (else a local file's own; no-op outside a call)."""
    stats = _CURRENT.get()
    if stats is not None:
        stats.resolve(files, sizes)


def dropped(files: Iterable[str]) -> None:
    """Record resolved shards a loader will not open."""
    stats = _CURRENT.get()
    if stats is not None:
        stats.dropped.update(files)


def fetched(nbytes: int) -> None:
    """Record tensor bytes the current call received from object storage."""
    stats = _CURRENT.get()
    if stats is not None:
        stats.network = (stats.network or 0) + nbytes


Observer = Callable[[str, Any], None]


def _counting(get_all_weights: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(get_all_weights)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Generator[Any, None, None]:
        stats = _CURRENT.get()
        if stats is not None and stats.tensors is None:
            stats.tensors = 0
        observe = stats.observe if stats is not None else None
        for item in get_all_weights(self, *args, **kwargs):
            if stats is not None:
                stats.tensors = (stats.tensors or 0) + 1
            if observe is not None:
                observe(*item)
            yield item

    return wrapper


def _resolving(prepare_weights: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(prepare_weights)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = prepare_weights(self, *args, **kwargs)
        with suppress(TypeError, IndexError):  # a return shape we don't know: no shard count
            resolved(result[1])
        return result

    return wrapper


def _resolving_list(prepare_weights: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(prepare_weights)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = prepare_weights(self, *args, **kwargs)
        if isinstance(result, list):
            resolved(result)
        return result

    return wrapper


def received(files: list[str], weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``weights`` read from ``files``, counting the tensor bytes that came from object
    storage (:func:`fetched`)."""
    if not any(map(is_object_uri, files)):
        yield from weights
        return
    for name, tensor in weights:
        fetched(int(tensor.numel()) * int(tensor.element_size()))
        yield name, tensor


def _streaming(iterator: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's Run:ai iterator: the files it streams are the shards opened (the rest of
    those resolved were dropped by vLLM's filter), and what it receives is counted."""

    @functools.wraps(iterator)
    def wrapper(hf_weights_files: list[str], *args: Any, **kwargs: Any) -> Any:
        stats = _CURRENT.get()
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
