"""Structured events: one JSON object per line on stderr, and in the events file when set.

The layer builds its own structlog logger (a processor chain ending in a JSON renderer) and
never calls ``structlog.configure``: the host process's structlog and logging setups, vLLM's
included, stay exactly as they were. Every event carries ``event``, ``level``, ``timestamp``
(ISO 8601, UTC) and ``pid``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from functools import lru_cache
from typing import Any

import structlog

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def _add_pid(_logger: object, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    event_dict["pid"] = os.getpid()
    return event_dict


def _contract_order(_logger: object, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """Put the four keys every event has first, so lines read well in a terminal."""
    head = {k: event_dict.pop(k) for k in ("event", "level", "timestamp", "pid") if k in event_dict}
    return {**head, **event_dict}


class JsonLinesSink:
    """The final 'logger': writes each rendered line to stderr and appends it to a file.

    The file is opened per line with ``O_APPEND`` and written with one ``write`` call, so
    lines from the many processes of one vLLM server interleave whole.
    """

    def __init__(self, events_file: str | None) -> None:
        self.events_file = events_file
        self._file_error_reported = False

    def msg(self, line: str) -> None:
        data = line + "\n"
        try:
            sys.stderr.write(data)
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        if self.events_file:
            self._append(data.encode())

    debug = info = warning = error = critical = msg

    def _append(self, data: bytes) -> None:
        try:
            parent = os.path.dirname(self.events_file or "")
            if parent:
                os.makedirs(parent, exist_ok=True)
            fd = os.open(self.events_file or "", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            if not self._file_error_reported:
                self._file_error_reported = True
                sys.stderr.write(
                    json.dumps(
                        {
                            "event": "hybrid_draft.events_file_error",
                            "level": "warning",
                            "pid": os.getpid(),
                            "events_file": self.events_file,
                            "detail": str(exc),
                        }
                    )
                    + "\n"
                )


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
    """Write one event; ``sink`` is (level, events_file), read from the settings if omitted."""
    if sink is None:
        from hybrid_draft import settings

        current, _ = settings.load_lenient()
        sink = (
            (current.level.value, current.events_file.value) if current else settings.event_sink()
        )
    getattr(logger(*sink), level)(event, **fields)
