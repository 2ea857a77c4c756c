"""What one ``get_model`` call cost: seconds, storage bytes read, tensors yielded, shards opened.

The wrapped ``get_model`` opens a :func:`measuring` scope; inside it, vLLM's
``DefaultModelLoader`` (and every loader built on it, hybrid-draft's own included) reports:
``_prepare_weights`` the shards it resolved, vLLM's shard filters and this layer's planned
loaders the shards they drop, ``get_all_weights`` each tensor it yields to the model. Bytes
come from the kernel (``/proc/self/io``: what this process, all its threads, fetched from
storage, so a warm page cache reads 0), not from file sizes. Loaders outside
``DefaultModelLoader`` (dummy, tensorizer, Run:ai...) report seconds and bytes only.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Generator, Iterable, Iterator
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
    resolved: dict[str, int] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)
    tensors: int | None = None
    #: Sees every tensor a ``DefaultModelLoader`` yields to the model during the load (the
    #: target's one-pass tap), or None.
    observe: Observer | None = None

    def resolve(self, files: Iterable[str]) -> None:
        for f in files:
            if f not in self.resolved:
                try:
                    self.resolved[f] = os.path.getsize(f)
                except OSError:
                    self.resolved[f] = 0

    def cost(self) -> records.Cost:
        """The cost keys of ``hybrid_draft.loaded`` / ``load_failed``, as of now."""
        now = read_bytes()
        observed = bool(self.resolved) or self.tensors is not None
        opened = [f for f in self.resolved if f not in self.dropped]
        return records.Cost(
            seconds=round(time.perf_counter() - self.started, 6),
            bytes_read=(
                now - self.read_at_start
                if now is not None and self.read_at_start is not None
                else None
            ),
            tensors=self.tensors,
            shards=len(opened) if observed else None,
            checkpoint_shards=len(self.resolved) if observed else None,
            checkpoint_bytes=sum(self.resolved.values()) if observed else None,
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


def resolved(files: Iterable[str]) -> None:
    """Record shards a loader resolved for the current call (no-op outside one)."""
    stats = _CURRENT.get()
    if stats is not None:
        stats.resolve(files)


def dropped(files: Iterable[str]) -> None:
    """Record resolved shards a loader will not open."""
    stats = _CURRENT.get()
    if stats is not None:
        stats.dropped.update(files)


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
    for owner, name, wrap in wraps:
        current = getattr(owner, name)
        if not getattr(current, _MARK, False):
            wrapped = wrap(current)
            setattr(wrapped, _MARK, True)
            setattr(owner, name, wrapped)
    return None
