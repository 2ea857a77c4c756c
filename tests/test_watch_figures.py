"""The watcher's figures, on plain data (``core/watch.py``, ``core/figures.py``; no vLLM): what
a progress event says of a load that spans a caller's calls, of one that began when the
process had read nothing yet, and when a caller's stream is being read. Each case beside its
control: the same figures where the thing they leave out did happen."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybrid_draft.core import figures, objectstore, watch

pytestmark = pytest.mark.once


def watched(tmp_path: Path, spans_calls: bool = False, **more: Any) -> watch.Watched:
    return watch.Watched(
        role="target",
        model="/m",
        load_format="instanttensor",
        trigger="direct_update" if spans_calls else "load",
        cost=figures.LoadStats(),
        sink=("info", str(tmp_path / "events.jsonl")),
        progress=1.0,
        stall=100.0,
        timeout=None,
        access=objectstore.Access(timeout=1.0, retries=1),
        planned=lambda: (1000, 10),
        spans_calls=spans_calls,
        **more,
    )


def said(tmp_path: Path, event: str) -> list[dict[str, Any]]:
    path = tmp_path / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == event]


def test_a_process_that_had_read_nothing_counts_its_bytes_from_zero(tmp_path: Path) -> None:
    fresh = watched(tmp_path, read_at_start=0)
    assert fresh.done_bytes(4096) == 4096
    later = watched(tmp_path, read_at_start=1000)
    assert later.done_bytes(4096) == 3096
    assert watched(tmp_path, read_at_start=None).done_bytes(4096) == 0  # the kernel won't say


def test_a_load_between_a_callers_calls_is_not_reading_and_its_rate_leaves_the_gaps_out(
    tmp_path: Path,
) -> None:
    """A direct update: 500 bytes in its first call (1 s), 10 s of the caller's own between
    calls, 500 more in its second (1 s). Its rate is 500 bytes a second, as read, not 500
    over 12 s; a first load measured the same way counts every second."""
    spans = watched(tmp_path, spans_calls=True, read_at_start=0)
    start = spans.started
    cost = spans.cost
    cost.streaming, cost.tensors = 1, 0
    spans.look(start + 0.5, 0, 0)
    cost.tensors = 5
    spans.look(start + 1.0, 500, 500)  # the first call ends
    cost.streaming = 0
    spans.look(start + 6.0, 500, 500)
    spans.look(start + 11.0, 500, 500)  # the second call begins
    cost.streaming = 1
    cost.tensors = 10
    spans.look(start + 12.0, 1000, 1000)
    assert spans.reading == pytest.approx(2.0)
    (event,) = [e for e in said(tmp_path, "hybrid_draft.progress") if e["bytes_read"] == 1000]
    assert event["bytes_per_s"] == pytest.approx(500.0)
    assert event["eta_seconds"] == 0.0  # every planned byte read: none left

    first = watched(tmp_path / "first", read_at_start=0)
    (tmp_path / "first").mkdir()
    first.cost.streaming = 1
    first.look(first.started + 12.0, 1000, 1000)
    (event,) = said(tmp_path / "first", "hybrid_draft.progress")
    assert event["bytes_per_s"] == pytest.approx(1000 / 12.0, rel=0.01)


def test_the_slowest_stretch_goes_by_tensors_where_no_byte_moved(tmp_path: Path) -> None:
    load = watched(tmp_path, read_at_start=0)
    cost, start = load.cost, load.started
    cost.streaming, cost.tensors = 1, 0
    for second, tensors in ((1, 10), (2, 20), (3, 21), (4, 31)):
        cost.tensors = tensors
        load.look(start + second, 0, 0)
    assert load.slowest == {
        "at_seconds": 2.0,
        "seconds": 1.0,
        "bytes_per_s": 0.0,
        "tensors_per_s": 1.0,
    }


def test_a_callers_stream_is_being_read_only_while_the_model_takes_a_tensor() -> None:
    """A trainer's generator that waits on its own broadcast for the next tensor is not the
    load stalling: while it produces one, nothing is being read; a loader's stream is being
    read throughout."""
    seen: list[int] = []
    stats = figures.LoadStats()

    def callers() -> Iterator[tuple[str, int]]:
        for i in range(3):
            seen.append(stats.streaming)  # while the caller produces the next
            yield f"t{i}", i

    with figures.measuring(stats):
        stream = figures.observed(callers(), callers=True)
        for _ in stream:
            assert stats.streaming == 1  # the model takes it
    assert seen == [0, 0, 0]
    assert (stats.streaming, stats.tensors) == (0, 3)

    seen.clear()
    with figures.measuring(stats):
        for _ in figures.observed(callers()):  # a loader's own stream
            pass
    assert seen == [1, 1, 1] and stats.streaming == 0

    with figures.measuring(stats):  # a model that stops part way: closed, nothing reading
        stream = figures.observed(callers(), callers=True)
        next(stream)
        assert stats.streaming == 1
        stream.close()
    assert stats.streaming == 0


def test_a_load_that_moved_after_its_stall_was_found_is_no_longer_quiet(tmp_path: Path) -> None:
    load = watched(tmp_path, read_at_start=0)
    load.cost.streaming, load.cost.tensors = 1, 3
    load.signature = load._signature(watch.activity(threading.get_native_id()))
    assert load.still_quiet()
    load.cost.tensors = 4
    assert not load.still_quiet()
    load.cost.tensors, load.cost.streaming = 3, 0  # no longer reading: nothing to stop
    assert not load.still_quiet()
