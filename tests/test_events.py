"""Events: JSON lines with the contract's keys, level filtering, no global structlog setup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_draft import events

pytestmark = pytest.mark.once  # the same on every vLLM release (docs/testing.md)

#: An emitter that sends each event where the settings say, as the layer's own callers do
#: (events themselves never read the settings).
EMIT = (
    "from hybrid_draft import events\n"
    "from hybrid_draft.settings import process_sink\n"
    "def emit(*args, **fields): events.emit(*args, sink=process_sink(), **fields)\n"
)


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
    )


def test_one_json_object_per_line_on_stderr_and_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "events.jsonl"
    code = (
        EMIT + "emit('hybrid_draft.decision', role='draft', action='switched')\n"
        "emit('hybrid_draft.config_error', 'error', source='X', detail='d')\n"
    )
    out = run(code, HYBRID_DRAFT_EVENTS_FILE=str(path))
    lines = out.stderr.splitlines()
    assert path.read_text().splitlines() == lines
    first, second = (json.loads(line) for line in lines)
    assert list(first)[:4] == ["event", "level", "timestamp", "pid"]
    assert first["event"] == "hybrid_draft.decision" and first["level"] == "info"
    assert first["timestamp"].endswith("Z") and "T" in first["timestamp"]
    assert second["level"] == "error" and second["source"] == "X"
    assert first["pid"] == second["pid"] != os.getpid()


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        ("debug", ["debug", "info", "warning", "error"]),
        ("info", ["info", "warning", "error"]),
        ("warning", ["warning", "error"]),
        ("error", ["error"]),
    ],
)
def test_level_filters_events(level: str, expected: list[str]) -> None:
    code = EMIT + "for lv in ('debug', 'info', 'warning', 'error'): emit('hybrid_draft.x', lv)\n"
    out = run(code, HYBRID_DRAFT_LOG_LEVEL=level)
    assert [json.loads(line)["level"] for line in out.stderr.splitlines()] == expected


def test_structlog_and_logging_stay_unconfigured() -> None:
    code = (
        "import logging, structlog\n"
        "before = structlog.get_config()\n"
        "handlers = list(logging.getLogger().handlers)\n" + EMIT + "emit('hybrid_draft.x')\n"
        "assert structlog.get_config() == before, 'structlog was configured'\n"
        "assert not structlog.is_configured()\n"
        "assert logging.getLogger().handlers == handlers\n"
        "print('unchanged')\n"
    )
    assert run(code).stdout.strip() == "unchanged"


def test_an_unwritable_events_file_does_not_break_the_caller(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = run(
        EMIT + "emit('hybrid_draft.x')\nprint('ok')",
        HYBRID_DRAFT_EVENTS_FILE=str(blocker / "events.jsonl"),
    )
    assert out.stdout.strip() == "ok"
    kinds = [json.loads(line)["event"] for line in out.stderr.splitlines()]
    assert kinds == ["hybrid_draft.x", "hybrid_draft.events_file_error"]


def test_events_from_many_processes_interleave_whole(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    code = EMIT + "for i in range(200): emit('hybrid_draft.x', payload='y' * 2000, i=i)\n"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stderr=subprocess.DEVNULL,
            env={**os.environ, "HYBRID_DRAFT_EVENTS_FILE": str(path)},
        )
        for _ in range(4)
    ]
    assert all(p.wait() == 0 for p in procs)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 800 and len({r["pid"] for r in records}) == 4


def test_sink_is_cached_per_level_and_file() -> None:
    assert events.logger("info", None) is events.logger("info", None)
    assert events.logger("info", None) is not events.logger("debug", None)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory"])
def test_an_events_file_that_is_not_a_regular_file_is_reported_once_and_never_blocks(
    kind: str, tmp_path: Path
) -> None:
    path = tmp_path / "events.jsonl"
    if kind == "fifo":
        os.mkfifo(path)  # no reader: a blocking open would wait for ever
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            EMIT + "for i in range(3): emit('hybrid_draft.x', i=i)\nprint('ok')",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HYBRID_DRAFT_EVENTS_FILE": str(path)},
        timeout=120,
    )
    assert out.stdout.strip() == "ok"
    records = [json.loads(line) for line in out.stderr.splitlines()]
    assert [r["event"] for r in records] == [
        "hybrid_draft.x",
        "hybrid_draft.events_file_error",
        "hybrid_draft.x",
        "hybrid_draft.x",
    ]
    assert records[1]["detail"].endswith(
        "not a regular file; events go to stderr only"
    ) and records[1]["events_file"] == str(path)


def test_an_event_that_cannot_be_rendered_is_still_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    loop: list[object] = []
    loop.append(loop)
    events.emit("hybrid_draft.x", sink=("info", None), value=loop)  # JSON cannot hold a cycle
    events.emit("hybrid_draft.y", "loud", sink=("info", None))  # no such level
    events.emit("hybrid_draft.z", sink=("chatty", None))  # no such sink level
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(r["event"], r["event_error"].split(":")[0]) for r in records] == [
        ("hybrid_draft.x", "ValueError"),
        ("hybrid_draft.y", "AttributeError"),
        ("hybrid_draft.z", "KeyError"),
    ]
    assert all({"timestamp", "pid", "level"} <= r.keys() for r in records)
