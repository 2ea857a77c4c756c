"""The events sink under faults: many processes on one stderr pipe, a full disk, a fragment.

Each test runs its writers as separate interpreters, as vLLM's workers are.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybrid_draft import events

pytestmark = pytest.mark.once  # the same on every vLLM release (docs/testing.md)

WRITERS = 8
EACH = 400
BIG = 6000  # every fourth event carries this many bytes: over a pipe's atomic write size

#: An emitter that sends each event where the settings say, as the layer's own callers do
#: (events themselves never read the settings).
EMIT = (
    "from hybrid_draft import events\n"
    "from hybrid_draft.settings import process_sink\n"
    "def emit(*args, **fields): events.emit(*args, sink=process_sink(), **fields)\n"
)

WRITER = (
    "import sys\n" + EMIT + "for i in range(int(sys.argv[1])):\n"
    "    emit('hybrid_draft.x', i=i, payload='y' * (int(sys.argv[2]) if i % 4 == 0 else 100))\n"
)


def _env(events_file: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYBRID_DRAFT_EVENTS_FILE"}
    if events_file is not None:
        env["HYBRID_DRAFT_EVENTS_FILE"] = str(events_file)
    return env


@pytest.mark.parametrize("with_file", [True, False], ids=["events-file", "stderr-only"])
def test_eight_writers_on_one_stderr_pipe_never_tear_a_line(
    with_file: bool, tmp_path: Path
) -> None:
    events_file = tmp_path / "events.jsonl" if with_file else None
    read_end, write_end = os.pipe()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(EACH), str(BIG)],
            stderr=write_end,
            env=_env(events_file),
        )
        for _ in range(WRITERS)
    ]
    os.close(write_end)
    with open(read_end, "rb") as pipe:
        out = pipe.read()  # until every writer has exited
    assert all(p.wait(timeout=300) == 0 for p in procs)
    lines = out.split(b"\n")
    assert lines.pop() == b""
    records = [json.loads(line) for line in lines]  # every line parses: none torn
    assert max(map(len, lines)) < select.PIPE_BUF  # with its newline, at most PIPE_BUF
    seen: dict[int, set[int]] = {}
    for r in records:
        assert r["event"] == "hybrid_draft.x" and r["level"] == "info" and r["timestamp"]
        seen.setdefault(r["pid"], set()).add(r["i"])
        if r["i"] % 4 == 0:
            assert "payload" not in r
            whole = {k: r[k] for k in ("event", "level", "timestamp", "pid", "i")}
            assert r[events.TRUNCATED] == {
                "bytes": len(json.dumps({**whole, "payload": "y" * BIG})) + 1,
                "omitted": ["payload"],
                "in_events_file": with_file,
            }
        else:
            assert r["payload"] == "y" * 100 and events.TRUNCATED not in r
    assert len(records) == WRITERS * EACH
    assert len(seen) == WRITERS and all(s == set(range(EACH)) for s in seen.values())
    if events_file is not None:  # the file holds every event whole, the large ones included
        in_file = [json.loads(line) for line in events_file.read_text().splitlines()]
        assert len(in_file) == WRITERS * EACH
        big = [r for r in in_file if r["i"] % 4 == 0]
        assert len(big) == WRITERS * EACH // 4
        assert all(r["payload"] == "y" * BIG and events.TRUNCATED not in r for r in big)


def test_a_shortened_line_keeps_every_field_that_fits_and_names_the_rest() -> None:
    line = json.dumps(
        {
            "event": "hybrid_draft.decision",
            "level": "info",
            "timestamp": "2026-12-01T00:00:00.000000Z",
            "pid": 7,
            "role": "draft",
            "warnings": ["w" * 5000],
            "action": "switched",
        }
    )
    out = events._shorten(line, len(line) + 1, 4096, True)
    record = json.loads(out)
    assert len(out) <= 4096 and out.endswith(b"\n") and out.count(b"\n") == 1
    assert list(record)[:4] == ["event", "level", "timestamp", "pid"]
    assert record["role"] == "draft" and record["action"] == "switched"
    assert record[events.TRUNCATED] == {
        "bytes": len(line) + 1,
        "omitted": ["warnings"],
        "in_events_file": True,
    }
    many = json.dumps({"event": "hybrid_draft.x", **{f"k{i:04}": "v" * 40 for i in range(1000)}})
    record = json.loads(events._shorten(many, len(many) + 1, 4096, False))
    kept = [k for k in record if k.startswith("k")]
    omitted = record[events.TRUNCATED]["omitted"]
    assert isinstance(omitted, int) and len(kept) + omitted == 1000  # too many names to list


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """A real 64 KiB filesystem (tmpfs), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a 64 KiB tmpfs to fill needs root; not root here")
    mount = Path(tempfile.mkdtemp(prefix="hybrid-draft-full-"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        mount.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)
        mount.rmdir()


FILLER = (
    "import os, sys\n"
    + EMIT
    + "for i in range(30): emit('hybrid_draft.x', i=i, payload='y' * 3000)\n"
    "os.unlink(sys.argv[1])\n"  # space returns
    "for i in range(30, 35): emit('hybrid_draft.x', i=i, payload='y' * 3000)\n"
)


def test_a_full_disk_leaves_no_partial_line_is_reported_once_and_recovered_from(
    small_tmpfs: Path,
) -> None:
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"f" * 32 * 1024)  # half the filesystem, freed halfway through
    events_file = small_tmpfs / "events.jsonl"
    out = subprocess.run(
        [sys.executable, "-c", FILLER, str(filler)],
        capture_output=True,
        text=True,
        env=_env(events_file),
        timeout=120,
        check=True,
    )
    on_stderr = [json.loads(line) for line in out.stderr.splitlines()]
    errors = [r for r in on_stderr if r["event"] == "hybrid_draft.events_file_error"]
    assert len(errors) == 1 and "No space left on device" in errors[0]["detail"]
    assert [r["i"] for r in on_stderr if r["event"] == "hybrid_draft.x"] == list(range(35))
    text = events_file.read_text()
    assert text.endswith("\n")
    in_file = [json.loads(line) for line in text.splitlines()]  # no fragment, nothing glued
    written = [r["i"] for r in in_file]
    assert 0 < len(written) < 30
    first_lost = next(i for i in range(30) if i not in written)
    assert written == [*range(first_lost), *range(30, 35)]  # whole again once space returns
    assert all(r["payload"] == "y" * 3000 for r in in_file)


def test_a_line_never_continues_a_fragment_another_writer_left(tmp_path: Path) -> None:
    events_file = tmp_path / "events.jsonl"
    events_file.write_text('{"event": "hybrid_draft.x", "i": 0}\n{"event": "hybrid_dr')
    subprocess.run(
        [sys.executable, "-c", EMIT + "emit('hybrid_draft.y')"],
        capture_output=True,
        env=_env(events_file),
        check=True,
    )
    lines = events_file.read_text().splitlines()
    assert lines[:2] == ['{"event": "hybrid_draft.x", "i": 0}', '{"event": "hybrid_dr']
    assert len(lines) == 3 and json.loads(lines[2])["event"] == "hybrid_draft.y"
