"""A long or stuck load says where it is (:class:`Watched`, one per load the layer decided).

A DeepSeek-V3-sized target takes minutes to stream, and far longer from object storage;
without this, nothing is said between a load's decision and its outcome, and a slow load
cannot be told from a stuck one. While a load runs, one small thread per process (started
with the first load, gone once none runs) looks at figures the load keeps already (its
``figures.LoadStats``: tensors yielded to the model, shards resolved, bytes received from
object storage) and the kernel's (``/proc/self/io``: bytes read from storage; the shards this
process has open or mapped), never at a tensor itself, and says:

- ``hybrid_draft.progress`` every ``progress_seconds`` once the load has run that long:
  bytes and tensors so far against those planned or known, the rate, the time left, the
  shards being read where the layer knows them;
- ``hybrid_draft.load_stalled`` when none of those figures moved for ``stall_seconds``
  (again every ``stall_seconds`` while it lasts, ``hybrid_draft.load_resumed`` once they move):
  the shard or object it waits on, the store, what the layer itself found when it asked (an
  object's first byte, once per stall), and the loader's own retry behaviour;
- with ``load_timeout``, a model's first load stalled that long, whose loader waits between
  reads in Python, is stopped: the exception :class:`LoadStalled`, naming the object, is
  raised in the loading thread as soon as it runs Python again, and the load ends with
  ``load_failed``; only a load still watched and still quiet then, under the lock its end
  takes, and a stop not yet landed when it ends is taken back. A loader that waits inside
  its library's own I/O is never stopped (the exception would land once its read returned,
  whole: the event says so), nor a reload or an update of weights already served: the
  model would be left part one step's.

A load is stalled only while its loader is reading: from the first tensor it is asked for
until its stream has given the last (``figures.LoadStats.streaming``). Before (the plan, the
shards resolved) and after (vLLM's processing of the weights, which can take minutes on a
large quantized model) nothing is read, and nothing is wrong; a session's or a direct
update's load, between the caller's calls, is not reading either. Moving, for the watcher, is
any of: tensors yielded, bytes received from object storage, or the process's own I/O
(``/proc/self/io``: reads and writes, storage and others, a download from the hub included),
less the watcher thread's own (its events, its looks). No vLLM import.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybrid_draft.core import figures, objectstore
from hybrid_draft.events import Sink, emit

#: The longest the thread sleeps between two looks (it looks more often for short settings).
TICK = 1.0


class LoadStalled(Exception):
    """A first load that read nothing for ``load_timeout``, stopped by the layer; its
    message names what it waited on."""

    message = "the load read nothing for its load_timeout"

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or (type(self).message,)))


#: What each store's client of the Run:ai Model Streamer does about a request that fails
#: or gets no answer, and a local read's: said in a stall, where the layer cannot do more.
RETRIES = {
    "gs": "Run:ai's GCS client (google-cloud-cpp) retries a failed or stalled request by its "
    "own policy, up to 15 minutes, which the Run:ai Model Streamer does not expose",
    "s3": "Run:ai's S3 client cuts a request after RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS and "
    "retries it RUNAI_STREAMER_S3_MAX_RETRIES times",
    "az": "Run:ai's Azure client keeps the Azure SDK's own retry policy, which cuts no answer "
    "that comes late or stalls",
    "file": "a local read is not retried: it waits on the kernel (a stalled disk or network "
    "filesystem)",
}


def store_of(location: str) -> str:
    """``s3``, ``gs``, ``az`` for an object's address; ``file`` for a local path."""
    return location.split("://", 1)[0].lower() if figures.is_object_uri(location) else "file"


def retry_behaviour(location: str) -> str:
    """The loader's own retry behaviour for ``location``, with the limits set here."""
    store = store_of(location)
    said = RETRIES[store]
    if store == "s3":
        timeout = os.environ.get("RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS", "its default")
        retries = os.environ.get("RUNAI_STREAMER_S3_MAX_RETRIES", "its default")
        said += f" ({timeout} ms, {retries} times here)"
    return said


def _io() -> int | None:
    return figures.read_bytes()


_IO_FIELDS = ("rchar", "wchar", "read_bytes", "write_bytes")


def _io_counts(path: str) -> tuple[int, ...]:
    out = dict.fromkeys(_IO_FIELDS, 0)
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in out:
                out[key] = int(value)
    return tuple(out.values())


def activity(own_thread: int | None = None) -> int:
    """The process's I/O so far (bytes read and written, of any kind: ``/proc/self/io``),
    less that of the thread ``own_thread`` (a native id: the watcher's own)."""
    total = sum(_io_counts("/proc/self/io"))
    if own_thread is not None:
        total -= sum(_io_counts(f"/proc/self/task/{own_thread}/io"))
    return total


def _open_shards(paths: set[str]) -> list[str]:
    """Which of the local shard files ``paths`` this process has open or mapped now, with
    the read position of an open one where the kernel says (``/proc/self``)."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target in paths:
                    pos = ""
                    with open(f"/proc/self/fdinfo/{fd}") as info:
                        for line in info:
                            if line.startswith("pos:"):
                                pos = f" (read to byte {int(line.split()[1]):,})"
                    found.setdefault(target, target + pos)
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            target = line.rstrip("\n").split(None, 5)[-1]
            if target in paths:
                found.setdefault(target, f"{target} (mapped)")
    return sorted(found.values())


@dataclass
class Watched:
    """One load as the watcher sees it: what it is, what it may read, what it did so far."""

    role: str | None
    model: str | None
    load_format: str | None
    trigger: str
    cost: figures.LoadStats
    sink: Sink
    progress: float
    stall: float
    timeout: float | None
    #: Where a stall's object is asked (the load's object-storage bounds).
    access: objectstore.Access
    #: The bytes and tensors the load will take, where known then (draft: its plan; a
    #: target: the shards resolved, and the checkpoint's tensors where its tap planned).
    planned: Callable[[], tuple[int | None, int | None]]
    #: Why a stalled load is not stopped at once (None: it stops at its next tensor), or,
    #: for a load that is never stopped (a reload, an update), why not.
    stop_note: str | None = None
    stoppable: bool = True
    #: A load that spans a caller's calls (a session's, a direct update's): between them it
    #: does nothing, and says nothing.
    spans_calls: bool = False
    thread: int = field(default_factory=threading.get_ident)
    started: float = field(default_factory=time.monotonic)
    # What the watcher found.
    read_at_start: int | None = field(default_factory=_io)
    signature: tuple[Any, ...] = ()
    changed: float = field(default_factory=time.monotonic)
    stalled_since: float | None = None
    next_stall: float = 0.0
    stalls: int = 0
    longest_stall: float = 0.0
    where: dict[str, Any] = field(default_factory=dict)
    #: The I/O of the layer's own asking (its threads' reads of a store's answer): not the
    #: load's, so never a sign that it moves.
    asked_io: int = 0
    stop_asked: bool = False
    next_progress: float = 0.0
    #: The reading seconds, the bytes and the tensors done at the last progress event.
    last_progress: tuple[float, int, int] = (0.0, 0, 0)
    slowest: dict[str, float] | None = None
    #: Seconds the load has been reading (a load that spans a caller's calls: only inside
    #: them; any other: since it began), as of the last look.
    reading: float = 0.0
    last_look: float | None = None
    #: The thread was asked to raise :class:`LoadStalled` (and has not yet been told not to).
    queued: bool = False
    #: Held while a stall is said to be over (by the watcher, or by :func:`stop` for a load
    #: that moved and ended between two looks): once.
    resuming: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.next_progress = self.started + self.progress
        self.last_progress = (0.0, 0, 0)
        self.last_look = self.started

    @property
    def tick(self) -> float:
        settings = [s for s in (self.progress, self.stall, self.timeout) if s]
        return max(0.02, min(TICK, *(s / 4 for s in settings)))

    def done_bytes(self, read: int | None) -> int:
        """What the load has read so far: bytes from storage, and from object storage."""
        stored = (
            read - self.read_at_start if read is not None and self.read_at_start is not None else 0
        )
        return max(stored, 0) + (self.cost.network or 0)

    def look(self, now: float, read: int | None, moved: int) -> None:
        """One look (``read``: the process's storage bytes read so far; ``moved``: its I/O
        less the watcher's): a stall begun, lasting or over; progress due; the bound
        reached."""
        if not self.spans_calls:
            self.reading = now - self.started
        elif self.last_look is not None and self.cost.streaming > 0:
            self.reading += now - self.last_look
        self.last_look = now
        signature = self._signature(moved)
        fresh = signature != self.signature
        if fresh or self.cost.streaming <= 0:  # moving, or not reading (nothing to wait on)
            if self.stalled_since is not None:
                self._resumed(now)
            self.signature, self.changed = signature, now
        quiet = now - self.changed
        if quiet >= self.stall:
            if self.stalled_since is None:
                self.stalled_since = self.changed
                self.stalls += 1
                own = threading.get_native_id()
                before = activity(own)
                self.where = self._locate()
                self.asked_io += activity(own) - before
                self._stalled(now, quiet, read)
            elif now >= self.next_stall:
                self._stalled(now, quiet, read)
            if self.timeout is not None and quiet >= self.timeout and not self.stop_asked:
                _stop_if_still_stalled(self, quiet, read)
        if self.progress and now >= self.next_progress:
            if not self.spans_calls or self.cost.streaming > 0:
                self._progress(now, read)
            else:  # between a caller's calls: nothing to say
                self.next_progress = now + self.progress

    def _signature(self, moved: int) -> tuple[Any, ...]:
        """What moves while the load reads: its I/O less the layer's own asking, the bytes
        it received from object storage, its tensors."""
        return (moved - self.asked_io, self.cost.network, self.cost.tensors)

    def still_quiet(self) -> bool:
        """Whether nothing moved since the look that found the stall (asking the store can
        take seconds, in which a load may have moved again, or ended)."""
        own = threading.get_native_id()
        return self.cost.streaming > 0 and self._signature(activity(own)) == self.signature

    # -- what is said ---------------------------------------------------------------------

    def _keys(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "model": self.model,
            "load_format": self.load_format,
            "trigger": self.trigger,
        }

    def _progress(self, now: float, read: int | None) -> None:
        done = self.done_bytes(read)
        tensors = self.cost.tensors or 0
        since, before, before_tensors = self.last_progress
        reading = self.reading
        span = reading - since
        rate = (done - before) / span if span > 0 else 0.0
        tensor_rate = (tensors - before_tensors) / span if span > 0 else 0.0
        planned_bytes, planned_tensors = self.planned()
        # How far it is: by its bytes read, or by its tensors where it planned them (a read
        # the page cache serves reads no byte from storage), whichever says more.
        share = max(
            done / planned_bytes if planned_bytes else 0.0,
            tensors / planned_tensors if planned_tensors else 0.0,
        )
        eta = None
        if share > 0:
            eta = round(reading * (1 - min(share, 1.0)) / share, 1)
        # The slowest stretch by bytes, then (a read the page cache serves moves no byte
        # from storage) by tensors.
        slowest = self.slowest
        if span > 0 and (
            slowest is None
            or (rate, tensor_rate) < (slowest["bytes_per_s"], slowest["tensors_per_s"])
        ):
            self.slowest = {
                "at_seconds": round(since, 3),
                "seconds": round(span, 3),
                "bytes_per_s": round(rate, 1),
                "tensors_per_s": round(tensor_rate, 1),
            }
        self.last_progress = (reading, done, tensors)
        self.next_progress = now + self.progress
        opened = self._opened()
        emit(
            "hybrid_draft.progress",
            sink=self.sink,
            **self._keys(),
            seconds=round(now - self.started, 3),
            tensors=tensors,
            planned_tensors=planned_tensors,
            bytes_read=done,
            planned_bytes=planned_bytes,
            network_bytes=self.cost.network,
            bytes_per_s=round(rate, 1),
            eta_seconds=eta,
            reading=_open_shards({f for f in opened if not figures.is_object_uri(f)}),
        )

    def _opened(self) -> list[str]:
        return [f for f in self.cost.resolved if f not in self.cost.dropped]

    def _locate(self) -> dict[str, Any]:
        """What the load waits on, asked once per stall: an object store's answer for the
        first object that gives one (a refusal before no answer in time), else the local
        shards this process has open or mapped."""
        opened = self._opened()
        objects = [f for f in opened if figures.is_object_uri(f)]
        if objects:
            one = objects[0]
            try:
                found = objectstore.failed_read(objects, self.access)
            except Exception as exc:  # asking is a report, never a failure of the load's
                found, asked = None, f"asking the store failed: {type(exc).__name__}: {exc}"
            else:
                asked = (
                    "every object it reads answered its first byte when the layer asked: "
                    "the loader's own client waits"
                )
            address = found.address if found is not None else one
            return {
                "waiting_on": address if found is not None else objects,
                "store": store_of(one),
                "answer": found.answer if found is not None else asked,
                "retries": retry_behaviour(address),
            }
        local = _open_shards(set(opened))
        return {
            "waiting_on": local or opened,
            "store": "file",
            "answer": (
                "the shards it has open or mapped now"
                if local
                else "no shard of it is open or mapped now (the loader holds none open)"
            ),
            "retries": RETRIES["file"],
        }

    def _stalled(self, now: float, quiet: float, read: int | None) -> None:
        self.next_stall = now + self.stall
        self._say_stalled(
            "warning",
            quiet,
            read,
            detail=self.stop_note or "stopped at its next tensor where load_timeout is set",
        )

    def _say_stalled(self, level: str, quiet: float, read: int | None, **more: Any) -> None:
        emit(
            "hybrid_draft.load_stalled",
            level,
            sink=self.sink,
            **self._keys(),
            stalled_seconds=round(quiet, 3),
            at_seconds=round(self.changed - self.started, 3),
            tensors=self.cost.tensors or 0,
            bytes_read=self.done_bytes(read),
            **self.where,
            load_timeout=self.timeout,
            stoppable=self.stoppable,
            **more,
        )

    def _resumed(self, now: float) -> None:
        with self.resuming:
            since, self.stalled_since = self.stalled_since, None
        if since is None:  # said already, by the other thread
            return
        lasted = now - since
        self.longest_stall = max(self.longest_stall, lasted)
        emit(
            "hybrid_draft.load_resumed",
            sink=self.sink,
            **self._keys(),
            stalled_seconds=round(lasted, 3),
            tensors=self.cost.tensors or 0,
        )

    def _stop(self, quiet: float, read: int | None) -> None:
        """The bound reached (the watch's lock held, the load still watched and still
        quiet): a first load whose loader waits between reads has its thread asked to raise
        :class:`LoadStalled`; a load whose loader waits inside its library (the exception
        would land only once the read returned, whole), a reload or an update is only said
        to be past it."""
        self.stop_asked = True
        waiting = self.where.get("waiting_on")
        named = waiting if isinstance(waiting, str) else ", ".join(map(str, waiting or []))
        message = (
            f"{named or 'the load'}: read nothing for {quiet:.0f} s (load_timeout "
            f"{self.timeout:g} s): {self.where.get('answer', '')}; {self.where.get('retries', '')}"
        )
        stopping = self.trigger == "load" and self.stoppable
        if stopping:
            stalled = type("LoadStalled", (LoadStalled,), {"message": message})
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.thread), ctypes.py_object(stalled)
            )
            self.queued = True
        self._say_stalled(
            "error",
            quiet,
            read,
            action="stopping" if stopping else "not_stopped",
            detail=message
            + (f"; {self.stop_note}" if self.stop_note else "; it stops at its next tensor"),
        )

    def figures(self) -> dict[str, Any]:
        """What the load's ``loaded``/``load_failed`` adds: its stalls, its slowest stretch."""
        if self.stalled_since is not None:
            self.longest_stall = max(self.longest_stall, time.monotonic() - self.stalled_since)
        out: dict[str, Any] = {}
        if self.stalls:
            out["stalls"] = self.stalls
            out["longest_stall_seconds"] = round(self.longest_stall, 3)
        if self.slowest is not None:
            out["slowest"] = self.slowest
        return out


# --- the one thread ------------------------------------------------------------------------

_LOCK = threading.Condition()
_LOADS: list[Watched] = []
_THREAD: list[threading.Thread] = []


def start(watched: Watched) -> Watched:
    """Watch ``watched`` until :func:`stop`; the thread starts with the first load."""
    with _LOCK:
        _LOADS.append(watched)
        if not _THREAD:
            thread = threading.Thread(target=_run, name="hybrid-draft-watch", daemon=True)
            _THREAD.append(thread)
            thread.start()
        _LOCK.notify_all()
    return watched


def stop(watched: Watched) -> None:
    """No longer watch ``watched`` (the thread ends with the last load); a stop the watcher
    asked of its thread and that has not landed yet is taken back: the load is over."""
    with _LOCK:
        if watched in _LOADS:
            _LOADS.remove(watched)
        if watched.queued:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(watched.thread), None)
            watched.queued = False
        _LOCK.notify_all()
    # A stall the load came out of before the watcher looked again (it then ended at once).
    moved = (watched.cost.network, watched.cost.tensors) != watched.signature[1:]
    if watched.stalled_since is not None and moved:
        watched._resumed(time.monotonic())


def _stop_if_still_stalled(watched: Watched, quiet: float, read: int | None) -> None:
    """``watched`` past its ``load_timeout``: stopped only if it is still watched (not ended
    meanwhile) and still quiet now, checked under the lock :func:`stop` takes."""
    with _LOCK:
        if watched not in _LOADS or not watched.still_quiet():
            return
        watched._stop(quiet, read)


def _run() -> None:
    own = threading.get_native_id()
    while True:
        with _LOCK:
            if not _LOADS:
                _THREAD.clear()
                return
            loads = list(_LOADS)
        now, read, moved = time.monotonic(), _io(), activity(own)
        for watched in loads:
            try:
                watched.look(now, read, moved)
            except Exception:  # a report must never end the watch of the other loads
                watched.progress = 0.0
        with _LOCK:
            if _LOADS:
                _LOCK.wait(min(w.tick for w in _LOADS))


def _forget() -> None:
    """A forked child holds none of its parent's loads, nor its thread, nor its lock."""
    global _LOCK
    _LOCK = threading.Condition()
    _LOADS.clear()
    _THREAD.clear()


os.register_at_fork(after_in_child=_forget)
