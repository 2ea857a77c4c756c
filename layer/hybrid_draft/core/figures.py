"""What one load cost: seconds, bytes read, tensors yielded, shards opened.

A load opens a :func:`measuring` scope; inside it, whatever reads reports (the adapter's
wraps of vLLM's loaders, ``adapter/stats.py``, and the layer's own readers): the shards
resolved (:func:`resolved`), those dropped unopened (:func:`dropped`), each tensor yielded,
the bytes received from object storage (:func:`received`). No vLLM import.

Storage bytes come from the kernel (``/proc/self/io``: what this process, all its threads,
fetched from storage, so a warm page cache reads 0), not from file sizes. Bytes from object
storage (``s3://``, ``gs://``, ``az://``) never pass the kernel's storage count: they are
the tensor bytes the load received from there (:func:`fetched`). Other loaders (dummy,
tensorizer...) report seconds and storage bytes only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from hybrid_draft import records

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
    #: The streams of tensors being read now (begun, not yet exhausted): a load can stall
    #: only while one is (``core/watch.py``).
    streaming: int = 0
    #: Tensor bytes received from object storage (None: the load read none from there).
    network: int | None = None
    #: Retries of the layer's own requests to object storage (None: it made none).
    retried: int | None = None
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
            retried=self.retried,
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


class measuring:
    """While open, what reads reports goes to ``stats`` (a new load's figures, or those of a
    load measured over several calls, such as a weight-transfer session's or a trainer's
    direct update's, opened once per call of it: a class, cheaper than a generator)."""

    __slots__ = ("_stats", "_token")

    def __init__(self, stats: LoadStats | None = None) -> None:
        self._stats = stats if stats is not None else LoadStats()

    def __enter__(self) -> LoadStats:
        self._token = _CURRENT.set(self._stats)
        return self._stats

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._token)


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


def retried(count: int) -> None:
    """Record that the current call made requests of its own to object storage, ``count``
    of them retried (0: none was)."""
    stats = _CURRENT.get()
    if stats is not None:
        stats.retried = (stats.retried or 0) + count


Observer = Callable[[str, Any], None]


class Observed:
    """``weights`` as the model takes them (:func:`observed`): each counted as a tensor
    yielded in the load current when the iteration starts, and shown to its observer (the
    one-pass tap), if any. A caller's weights (``callers``: a trainer's stream, which may
    wait on its own broadcast for the next tensor) are being read only while the model
    takes one, not while the caller produces the next."""

    __slots__ = ("_callers", "_items", "_observe", "_started", "_stats")

    def __init__(self, weights: Iterable[tuple[str, Any]], callers: bool = False) -> None:
        self._items = iter(weights)
        self._stats: LoadStats | None = None
        self._observe: Observer | None = None
        self._started = False
        self._callers = callers

    def __iter__(self) -> Observed:
        return self

    def __next__(self) -> tuple[str, Any]:
        if not self._started:
            self._started = True
            stats = self._stats = _CURRENT.get()
            if stats is not None:
                stats.tensors = stats.tensors or 0
                stats.streaming += 1
                self._observe = stats.observe
        stats = self._stats
        waits = self._callers and stats is not None and self._items is not _DONE
        if waits:
            stats.streaming -= 1  # type: ignore[union-attr]
        try:
            item = next(self._items)
        except StopIteration:
            if stats is not None and self._items is not _DONE and not waits:
                stats.streaming -= 1
            self._items = _DONE  # exhausted: counted once
            raise
        except BaseException:
            if waits:
                stats.streaming += 1  # type: ignore[union-attr]
            raise
        if waits:
            stats.streaming += 1  # type: ignore[union-attr]
        if self._stats is not None:
            self._stats.tensors = (self._stats.tensors or 0) + 1
        if self._observe is not None:
            self._observe(*item)
        return item

    def close(self) -> None:
        """The model has stopped taking these weights (its call returned or raised): a
        stream it left part way is no longer being read."""
        if self._started and self._items is not _DONE:
            if self._stats is not None:
                self._stats.streaming -= 1
            self._items = _DONE


_DONE: Iterator[Any] = iter(())


def observed(weights: Iterable[tuple[str, Any]], callers: bool = False) -> Observed:
    """``weights`` as the model takes them (:class:`Observed`; ``callers``: a caller's own
    weights); weights already observed (a loader's stream the load instruments, handed to
    a model's wrapped ``load_weights``) are counted and shown once."""
    return weights if isinstance(weights, Observed) else Observed(weights, callers)


def received(files: list[str], weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``weights`` read from ``files``, counting the tensor bytes that came from object
    storage (:func:`fetched`)."""
    if not any(map(is_object_uri, files)):
        yield from weights
        return
    for name, tensor in weights:
        fetched(int(tensor.numel()) * int(tensor.element_size()))
        yield name, tensor
