"""Structured events: one JSON object per line on stderr, and in the events file when set.

The layer builds its own structlog logger (a processor chain ending in a JSON renderer) and
never calls ``structlog.configure``: the host process's structlog and logging setups, vLLM's
included, stay exactly as they were. Every event carries ``event``, ``level``, ``timestamp``
(ISO 8601, UTC) and ``pid``. Emitting never raises and never blocks: the events file must
be a regular file (a FIFO, a device or a directory there is reported once, as
``hybrid_draft.events_file_error``, and not written), it is opened with ``O_NONBLOCK``, and an
event that cannot be rendered is still written, as a plain line that says why. Lines stay
whole under any number of writing processes and a full disk (:class:`JsonLinesSink`).

structlog is imported when the first event is written, not with this module: the hook that
wraps vLLM's model loader runs inside vLLM's import, in every process that imports it, and
must cost almost nothing there. Its events (``activated``, ``patched``) are deferred
(:func:`defer`): stamped when they happen, written with structlog before any later event of
the process, at its first load, and at the latest when it exits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import select
import stat
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

from hybrid_draft.files import describe

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def _add_pid(
    _logger: object, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    event_dict["pid"] = os.getpid()
    return event_dict


def _contract_order(
    _logger: object, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Put the four keys every event has first, so lines read well in a terminal."""
    head = {k: event_dict.pop(k) for k in ("event", "level", "timestamp", "pid") if k in event_dict}
    return {**head, **event_dict}


#: The key a shortened stderr line carries (see :func:`_shorten`).
TRUNCATED = "event_truncated"

#: How long a writer waits for another's lock on the events file before it appends anyway.
LOCK_WAIT_SECONDS = 1.0

_HEAD = ("event", "level", "timestamp", "pid")


class JsonLinesSink:
    """The final 'logger': appends each rendered line to the events file, then writes it to
    stderr, each with one ``write(2)``.

    Stderr lines are kept to the pipe's atomic size (:func:`_atomic_size`): a write that
    size or smaller to a pipe never interleaves with another process's, so the workers
    of a server sharing its stderr never tear a line; a larger event goes whole to
    the events file and as a shortened line (:func:`_shorten`) to stderr. The events file is
    opened per line with ``O_APPEND`` and written under an exclusive ``flock``: a short
    write (a full disk) is completed or cut back to where the line began, so the file never
    keeps part of a line, and a line is never appended to a fragment another writer left
    (killed mid-write): it then starts on a new line. Only a regular file (or a path where
    nothing is yet, created as one) is written; the open never blocks.
    """

    def __init__(self, events_file: str | None) -> None:
        self.events_file = events_file
        self._file_error_reported = False

    def msg(self, line: str) -> None:
        data = (line + "\n").encode("utf-8", "backslashreplace")
        problem = self._append(data) if self.events_file else None
        fd = _stderr_fd()
        limit = _atomic_size(fd)
        if len(data) > limit:
            data = _shorten(line, len(data), limit, bool(self.events_file) and problem is None)
        _stderr(data, fd)
        if problem is not None:
            self._report(problem)

    debug = info = warning = error = critical = msg

    def _append(self, data: bytes) -> str | None:
        """Append ``data`` whole, or not at all; ``None``, or why it is not in the file."""
        path = self.events_file or ""
        try:
            try:
                before = os.stat(path)
            except FileNotFoundError:
                parent = os.path.dirname(path)
                if parent:
                    os.makedirs(parent, exist_ok=True)
            else:
                if not stat.S_ISREG(before.st_mode):
                    raise _NotRegular(before.st_mode)
            flags = (
                os.O_APPEND
                | os.O_CREAT
                | os.O_NONBLOCK
                | getattr(os, "O_NOCTTY", 0)
                | getattr(os, "O_CLOEXEC", 0)
            )
            try:  # read access lets the writer see a fragment at the end (_write_whole)
                fd = os.open(path, flags | os.O_RDWR, 0o644)
            except PermissionError:
                fd = os.open(path, flags | os.O_WRONLY, 0o644)
            try:
                mode = os.fstat(fd).st_mode
                if not stat.S_ISREG(mode):  # swapped in after the check above
                    raise _NotRegular(mode)
                _lock(fd)
                _write_whole(fd, data)
            finally:
                os.close(fd)  # releases the lock
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
            return str(exc)
        except _NotRegular as exc:
            return f"{exc}, not a regular file; events go to stderr only"
        return None

    def _report(self, detail: str) -> None:
        if self._file_error_reported:
            return
        self._file_error_reported = True
        line = {
            "event": "hybrid_draft.events_file_error",
            "level": "warning",
            "timestamp": _now(),
            "pid": os.getpid(),
            "events_file": self.events_file,
            "detail": detail,
        }
        _stderr((json.dumps(line, default=str) + "\n").encode(), _stderr_fd())


class _NotRegular(Exception):
    def __init__(self, mode: int) -> None:
        super().__init__(describe(mode))


def _lock(fd: int) -> None:
    """Take the events file's exclusive lock, waiting at most :data:`LOCK_WAIT_SECONDS`
    (a holder stopped mid-write must not stop every other process's events): past that, or
    where the filesystem has no locks, the line is appended without it."""
    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.0005)
        except OSError:
            return


def _write_whole(fd: int, data: bytes) -> None:
    """Append ``data`` to the locked file ``fd``: short writes completed; when the rest
    cannot be written (``ENOSPC``), the part that was is cut off again and the error raised.

    A file that does not end with a newline (a writer killed in the middle of its line)
    gets one first, so this line is never glued to that fragment.
    """
    size = os.fstat(fd).st_size
    if size:
        try:
            last = os.pread(fd, 1, size - 1)
        except OSError:  # opened write-only
            last = b"\n"
        if last != b"\n":
            data = b"\n" + data
    view = memoryview(data)
    written = 0
    start = -1
    try:
        while written < len(data):
            n = os.write(fd, view[written:])
            if n <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if start < 0:  # O_APPEND: the offset is now the end of what was just written
                start = os.lseek(fd, 0, os.SEEK_CUR) - n
            written += n
    except OSError:
        if written:
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_size == start + written:  # nothing appended after it
                    os.ftruncate(fd, start)
        raise


def _stderr_fd() -> int | None:
    """The descriptor under ``sys.stderr``, or ``None`` when it has none (a test's capture)."""
    try:
        return int(sys.stderr.fileno())
    except Exception:
        return None


def _atomic_size(fd: int | None) -> int:
    """The longest line stderr takes: the pipe's atomic write size (``PIPE_BUF``: 4096 on
    Linux), whatever stderr is, so the promise does not depend on what it is."""
    size = select.PIPE_BUF
    if fd is not None:
        with contextlib.suppress(OSError, ValueError):
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                size = os.fpathconf(fd, "PC_PIPE_BUF")
    return max(size, 512) if size > 0 else select.PIPE_BUF


def _shorten(line: str, full_size: int, limit: int, in_file: bool) -> bytes:
    """A stderr line of at most ``limit`` bytes for an event that renders to ``full_size``.

    It keeps the four keys every event has, then as many of the others, whole and in order,
    as fit, and adds :data:`TRUNCATED`: ``{"bytes": full_size, "omitted": [the keys left
    out] (their count when the names do not fit), "in_events_file": whether the whole event
    was appended to the events file}``.
    """
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        record = {"event": "hybrid_draft.unreadable_event"}
    head = {k: record.pop(k) for k in _HEAD if k in record}
    names = list(record)

    def render(kept: list[str], as_count: bool) -> bytes:
        omitted = [k for k in names if k not in kept]
        marker = {
            "bytes": full_size,
            "omitted": len(omitted) if as_count else omitted,
            "in_events_file": in_file,
        }
        body = {**head, **{k: record[k] for k in kept}, TRUNCATED: marker}
        return (json.dumps(body, default=str) + "\n").encode("utf-8", "backslashreplace")

    as_count = len(render([], False)) > limit
    kept: list[str] = []
    for name in names:
        if len(json.dumps(record[name], default=str)) + len(name) >= limit:
            continue  # cannot fit: not rendered again and again
        if len(render([*kept, name], as_count)) <= limit:
            kept.append(name)
    out = render(kept, as_count)
    if len(out) <= limit:
        return out
    minimal = {  # only an event name of thousands of characters gets here
        "event": str(head.get("event"))[:200],
        "level": head.get("level"),
        "timestamp": head.get("timestamp"),
        "pid": head.get("pid"),
        TRUNCATED: {"bytes": full_size, "omitted": len(names), "in_events_file": in_file},
    }
    return (json.dumps(minimal, default=str) + "\n").encode()  # under 512 bytes


def _stderr(data: bytes, fd: int | None) -> None:
    """One ``write(2)`` of the whole line to stderr (completed if it is short)."""
    try:
        if fd is None:  # no descriptor: the object's own write, in one call
            sys.stderr.write(data.decode("utf-8", "backslashreplace"))
            sys.stderr.flush()
            return
        sys.stderr.flush()  # what the process wrote through it before comes first
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except Exception:  # no stderr (closed, None, a broken pipe): nothing left to tell
        pass


def _now() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"


@cache
def _timestamper() -> Any:
    import structlog

    return structlog.processors.TimeStamper(fmt="iso", utc=True)


def _stamp(
    logger: object, method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog's ISO 8601 UTC stamp, unless the event was stamped when it happened (a
    deferred event, :func:`defer`)."""
    if "timestamp" in event_dict:
        return event_dict
    stamped: MutableMapping[str, Any] = _timestamper()(logger, method, event_dict)
    return stamped


@lru_cache(maxsize=8)
def logger(level: str = "info", events_file: str | None = None) -> Any:
    """A bound logger for ``level`` and ``events_file``, built once per pair."""
    import structlog

    return structlog.wrap_logger(
        JsonLinesSink(events_file),
        processors=[
            structlog.processors.add_log_level,
            _stamp,
            _add_pid,
            _contract_order,
            structlog.processors.JSONRenderer(sort_keys=False, default=str),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        cache_logger_on_first_use=False,
    )


#: Where an event goes: (level, events file). The caller passes it: events never read the
#: settings (a load passes its snapshot's, ``Settings.sink``; an event outside any load,
#: ``settings.process_sink()``).
Sink = tuple[str, str | None]


def emit(event: str, level: str = "info", *, sink: Sink, **fields: Any) -> None:
    """Write one event to ``sink``.

    Never raises: an event whose fields cannot be rendered is written as a plain line
    with ``event_error`` saying why, so a fault here is seen, and never fails the caller.
    Events deferred in this process are written first, in order.
    """
    if _deferred().events:
        flush()
    _write(event, level, sink, fields)


def _write(event: str, level: str, sink: Sink, fields: Mapping[str, Any]) -> None:
    try:
        getattr(logger(*sink), level)(event, **fields)
    except Exception as exc:
        _fallback(event, level, sink, exc, fields)


@cache
def unavailable() -> str | None:
    """Why events cannot be written with structlog in this process (None: they can): a
    process whose structlog is missing or broken gets plain lines saying so, and the layer
    leaves its loads to vLLM (``adapter.load``)."""
    try:
        import structlog  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass
class _Deferred:
    """This process's deferred events, in order; each with the pid that deferred it (a
    forked child inherits the list, not the events: they are its parent's)."""

    events: list[tuple[int, str, str, str, Callable[[], Sink], Callable[[], Mapping[str, Any]]]]
    hooked: bool = False


@cache
def _deferred() -> _Deferred:
    return _Deferred([])


def defer(
    event: str,
    level: str = "info",
    *,
    sink: Callable[[], Sink],
    fields: Callable[[], Mapping[str, Any]] = dict,
) -> None:
    """Stamp ``event`` now and write it later (:func:`flush`): before the process's next
    event, and at the latest when it exits (``atexit``, and multiprocessing's exit of a
    child, which skips ``atexit``). ``sink`` and ``fields`` are asked for then, so what
    they cost (reading the settings, probing vLLM) is paid by a process that loads, or
    once at exit. Never raises."""
    try:
        state = _deferred()
        state.events.append((os.getpid(), _now(), event, level, sink, fields))
        if not state.hooked:
            state.hooked = True
            import atexit

            atexit.register(flush)
            mp_util = sys.modules.get("multiprocessing.util")
            if mp_util is not None:  # a multiprocessing child ends in os._exit
                mp_util.Finalize(None, flush, exitpriority=100)
    except Exception as exc:
        _fallback(event, level, None, exc)


def flush() -> None:
    """Write this process's deferred events, in order (those a parent deferred before it
    forked this process are its parent's: dropped). Never raises."""
    state = _deferred()
    pid = os.getpid()
    while state.events:
        owner, stamped, event, level, sink, fields = state.events.pop(0)
        if owner != pid:
            continue
        try:
            where, values = sink(), dict(fields())
        except Exception as exc:
            _fallback(event, level, None, exc)
            continue
        _write(event, level, where, {**values, "timestamp": stamped})


def _fallback(
    event: str,
    level: str,
    sink: Sink | None,
    exc: Exception,
    fields: Mapping[str, Any] | None = None,
) -> None:
    head = {"event": event, "level": level, "timestamp": _now(), "pid": os.getpid()}
    error = {"event_error": f"{type(exc).__name__}: {exc}"}
    try:
        try:  # the event's own fields, where they render
            line = json.dumps({**head, **dict(fields or {}), **error}, default=str)
        except Exception:
            line = json.dumps({**head, **error}, default=str)
        events_file = sink[1] if sink and len(sink) > 1 else None
        target = JsonLinesSink(events_file if isinstance(events_file, str) else None)
        target.msg(line)
    except Exception:  # nothing left that could say it
        pass
