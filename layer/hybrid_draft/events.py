"""Structured events: one JSON object per line on stderr, and in the events file when set.

The layer builds its own structlog logger (a processor chain ending in a JSON renderer) and
never calls ``structlog.configure``: the host process's structlog and logging setups, vLLM's
included, stay exactly as they were. Every event carries ``event``, ``level``, ``timestamp``
(ISO 8601, UTC) and ``pid``. Emitting never raises and never blocks: the events file must
be a regular file (a FIFO, a device or a directory there is reported once, as
``hybrid_draft.events_file_error``, and not written), it is opened with ``O_NONBLOCK``, and an
event that cannot be rendered is still written, as a plain line that says why.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
import time
from collections.abc import MutableMapping
from functools import lru_cache
from typing import Any

import structlog

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


class JsonLinesSink:
    """The final 'logger': writes each rendered line to stderr and appends it to a file.

    The file is opened per line with ``O_APPEND`` and written with one ``write`` call, so
    lines from the many processes of one vLLM server interleave whole. Only a regular file
    (or a path where nothing is yet, created as one) is written; the open never blocks.
    """

    def __init__(self, events_file: str | None) -> None:
        self.events_file = events_file
        self._file_error_reported = False

    def msg(self, line: str) -> None:
        data = line + "\n"
        _stderr(data)
        if self.events_file:
            self._append(data.encode())

    debug = info = warning = error = critical = msg

    def _append(self, data: bytes) -> None:
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
                os.O_WRONLY
                | os.O_APPEND
                | os.O_CREAT
                | os.O_NONBLOCK
                | getattr(os, "O_NOCTTY", 0)
                | getattr(os, "O_CLOEXEC", 0)
            )
            fd = os.open(path, flags, 0o644)
            try:
                mode = os.fstat(fd).st_mode
                if not stat.S_ISREG(mode):  # swapped in after the check above
                    raise _NotRegular(mode)
                os.write(fd, data)
            finally:
                os.close(fd)
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
            self._report(str(exc))
        except _NotRegular as exc:
            self._report(f"{exc}, not a regular file; events go to stderr only")

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
        _stderr(json.dumps(line, default=str) + "\n")


class _NotRegular(Exception):
    def __init__(self, mode: int) -> None:
        super().__init__(describe(mode))


def _stderr(data: str) -> None:
    try:
        sys.stderr.write(data)
        sys.stderr.flush()
    except Exception:  # no stderr (closed, None, a broken pipe): nothing left to tell
        pass


def _now() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"


@lru_cache(maxsize=8)
def logger(level: str = "info", events_file: str | None = None) -> Any:
    """A bound logger for ``level`` and ``events_file``, built once per pair."""
    return structlog.wrap_logger(
        JsonLinesSink(events_file),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_pid,
            _contract_order,
            structlog.processors.JSONRenderer(sort_keys=False, default=str),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        cache_logger_on_first_use=False,
    )


def emit(
    event: str, level: str = "info", *, sink: tuple[str, str | None] | None = None, **fields: Any
) -> None:
    """Write one event; ``sink`` is (level, events_file), read from the settings if omitted.

    Never raises: an event whose fields cannot be rendered is written as a plain line
    with ``event_error`` saying why, so a fault here is seen, and never fails the caller.
    """
    try:
        if sink is None:
            from hybrid_draft import settings

            current, _ = settings.load_lenient()
            sink = (
                (current.level.value, current.events_file.value)
                if current
                else settings.event_sink()
            )
        getattr(logger(*sink), level)(event, **fields)
    except Exception as exc:
        _fallback(event, level, sink, exc)


def _fallback(event: str, level: str, sink: tuple[str, str | None] | None, exc: Exception) -> None:
    try:
        line = json.dumps(
            {
                "event": event,
                "level": level,
                "timestamp": _now(),
                "pid": os.getpid(),
                "event_error": f"{type(exc).__name__}: {exc}",
            },
            default=str,
        )
        events_file = sink[1] if sink and len(sink) > 1 else None
        target = JsonLinesSink(events_file if isinstance(events_file, str) else None)
        target.msg(line)
    except Exception:  # nothing left that could say it
        pass
