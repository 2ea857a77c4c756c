"""A long or stuck load says where it is: real vLLM loads in process, watched by the layer's
watcher (``core/watch.py``), their reads paced or held by a stand-in of vLLM's InstantTensor
iterator (the one vLLM function the tests replace: it needs CUDA). The stand-in reads every
tensor as InstantTensor does (``conftest.instanttensor_standin``); here it also waits where a
test says, with the shard it reads from open, as a read that hangs on a disk or a network
filesystem does."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    Events,
    Recorder,
    checkpoint_tensors,
    engine_config,
    model_runner,
    reload_weights,
)

pytestmark = pytest.mark.vllm

PROGRESS, STALLED, RESUMED = (
    "hybrid_draft.progress",
    "hybrid_draft.load_stalled",
    "hybrid_draft.load_resumed",
)


@dataclass
class Pacer:
    """How the stand-in reads: ``each`` seconds per tensor; at the ``hold_at``-th tensor
    (counting from 1), ``hold`` seconds more (``None``: until :meth:`release`) with that
    tensor's shard open."""

    each: float = 0.0
    hold_at: int | None = None
    hold: float | None = 0.0
    released: threading.Event = field(default_factory=threading.Event)
    tensors: int = 0

    def release(self) -> None:
        self.released.set()

    def wait(self, files: list[str]) -> None:
        with open(files[-1], "rb") as shard:  # the read that hangs, its shard open
            shard.read(8)
            until = time.monotonic() + (self.hold if self.hold is not None else 120.0)
            while time.monotonic() < until and not self.released.is_set():
                time.sleep(0.02)  # Python between waits: where the layer's stop lands


@pytest.fixture
def pacer(instanttensor_standin: Recorder, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pacer]:
    import vllm.model_executor.model_loader.default_loader as default_loader
    import vllm.model_executor.model_loader.weight_utils as weight_utils

    paced = Pacer()

    def pacing(iterator: Any) -> Any:
        def reading(hf_weights_files: list[str], *args: Any, **kwargs: Any) -> Iterator[Any]:
            for item in iterator(hf_weights_files, *args, **kwargs):
                paced.tensors += 1
                time.sleep(paced.each)
                if paced.tensors == paced.hold_at:
                    paced.wait(list(hf_weights_files))
                yield item

        return reading

    # InstantTensor's stand-in, and vLLM's own lazy safetensors iterator (a Python loop).
    for name in ("instanttensor_weights_iterator", "safetensors_weights_iterator"):
        reading = pacing(getattr(default_loader, name))
        monkeypatch.setattr(default_loader, name, reading)
        monkeypatch.setattr(weight_utils, name, reading)
    yield paced
    paced.release()


def watch_settings(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for name, value in values.items():
        monkeypatch.setenv(f"HYBRID_DRAFT_{name.upper()}", value)


def target_of(model_dir: Path, load_format: str = "instanttensor") -> Any:
    """The target alone, by vLLM's ``get_model`` (a first load) in a load scope, as a model
    runner loads it (its one pass plans the draft's tensors from the checkpoint's headers)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.model_executor.model_loader import get_model

    from hybrid_draft.adapter import loadscope

    config = engine_config(model_dir, load_format=load_format)
    with set_current_vllm_config(config), loadscope.scope():
        ensure_model_parallel_initialized(1, 1)
        return get_model(vllm_config=config)


def report(events: Events) -> str:
    """``hybrid-draft report`` of the test's events file."""
    return subprocess.run(
        [sys.executable, "-m", "hybrid_draft", "report", str(events.path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def checkpoint_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def test_a_long_healthy_load_says_how_far_it_is_how_fast_and_how_long_it_has_left(
    deepseek: Path, pacer: Pacer, events: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    watch_settings(monkeypatch, progress_seconds="0.3", stall_seconds="5")
    pacer.each = 0.05
    pacer.hold_at, pacer.hold = 40, 1.0  # one stretch far slower than the rest

    target_of(deepseek)

    every = [e for e in events.named(PROGRESS) if e["role"] == "target"]
    assert [e["trigger"] for e in every] == ["load"] * len(every)
    done = [e["tensors"] for e in every]
    assert done == sorted(done)
    said = [e for e in every if e["tensors"] > 0]  # once its stream has begun
    assert len(said) >= 3, every
    assert said[-1]["tensors"] > said[0]["tensors"]
    assert {e["planned_bytes"] for e in said} == {checkpoint_bytes(deepseek)}
    # Its shards come from the page cache (no byte from storage): how far it is goes by the
    # tensors its one pass planned (the whole checkpoint's), and the time left shrinks.
    assert {e["planned_tensors"] for e in said} == {len(checkpoint_tensors(deepseek))}
    assert all(e["eta_seconds"] is not None for e in said)
    assert said[-1]["eta_seconds"] < said[0]["eta_seconds"]
    assert events.named(STALLED) == []
    (loaded,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "target"]
    # The slowest stretch: no byte came from storage in any (the page cache), so the one
    # that took the fewest tensors a second, the held one; every other took more.
    slowest = loaded["slowest"]
    assert slowest["bytes_per_s"] == min(e["bytes_per_s"] for e in every) == 0
    rates = [
        (b["tensors"] - a["tensors"]) / (b["seconds"] - a["seconds"])
        for a, b in itertools.pairwise(every)
    ]
    assert slowest["tensors_per_s"] <= min(rates) + 0.5, (slowest, rates)
    assert slowest["tensors_per_s"] < sorted(rates)[len(rates) // 2] / 2, (slowest, rates)
    assert slowest["at_seconds"] + slowest["seconds"] >= 40 * pacer.each
    assert "stalls" not in loaded
    assert "  target (load): its slowest stretch " in report(events)


def test_a_stall_is_named_while_it_lasts_and_its_end_said(
    deepseek: Path, pacer: Pacer, events: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that hangs 1.5 s in the middle of the target's stream: a warning naming the
    shard it hangs on (open in the process), again while it lasts, then the load resumed;
    the ``loaded`` event counts the stall."""
    watch_settings(monkeypatch, progress_seconds="0", stall_seconds="0.4")
    pacer.hold_at, pacer.hold = 10, 1.5

    target_of(deepseek)

    stalled = events.named(STALLED)
    assert len(stalled) >= 2, stalled
    first = stalled[0]
    assert (first["role"], first["store"], first["stoppable"]) == ("target", "file", False)
    assert any(str(deepseek) in w for w in first["waiting_on"]), first
    assert "waits on the kernel" in first["retries"]
    assert first["load_timeout"] is None
    (resumed,) = events.named(RESUMED)
    assert resumed["stalled_seconds"] >= 1.0
    (loaded,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "target"]
    assert loaded["stalls"] == 1 and loaded["longest_stall_seconds"] >= 1.0
    longest = loaded["longest_stall_seconds"]
    assert f"  target (load): 1 stall(s), the longest {longest:.1f} s" in report(events)


def test_with_load_timeout_a_stalled_first_load_is_stopped_naming_what_it_waited_on(
    deepseek: Path, pacer: Pacer, events: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that never ends, in a loader that waits in Python between reads (vLLM's lazy
    safetensors): stopped once it has read nothing for ``load_timeout``, with a
    ``load_failed`` that says so and names the shard; vLLM's ``get_model`` raises, as for
    any failed load."""
    from hybrid_draft.core.watch import LoadStalled

    watch_settings(monkeypatch, stall_seconds="0.3", load_timeout="1")
    pacer.hold_at, pacer.hold = 10, None
    started = time.monotonic()

    with pytest.raises(LoadStalled, match=r"read nothing for \d+ s \(load_timeout 1 s\)"):
        target_of(deepseek, "safetensors")

    assert time.monotonic() - started < 30
    (stopping,) = [e for e in events.named(STALLED) if e.get("action")]
    assert (stopping["action"], stopping["level"], stopping["stoppable"]) == (
        "stopping",
        "error",
        True,
    )
    (failed,) = events.named("hybrid_draft.load_failed")
    assert (failed["role"], failed["reason"], failed["error_type"]) == (
        "target",
        "stalled",
        "LoadStalled",
    )
    assert str(deepseek) in failed["error"]
    assert failed["stalls"] == 1
    assert "  target (load) (stopped: load_timeout): 1 stall(s)" in report(events)


def test_a_load_that_waits_inside_its_library_is_never_stopped_part_way(
    deepseek: Path, pacer: Pacer, events: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    """InstantTensor reads in its C++ library: a stop would land only once the read had
    returned, whole, and fail a load that then had its tensor. Past ``load_timeout`` the
    bound is said (``not_stopped``); the read returns and the load ends ``loaded``."""
    watch_settings(monkeypatch, stall_seconds="0.3", load_timeout="0.8")
    pacer.hold_at, pacer.hold = 10, 2.0

    target_of(deepseek)

    # The held read is one stall (a busy host may add a short one elsewhere: never a bound).
    (bound,) = [e for e in events.named(STALLED) if e.get("action")]
    assert (bound["action"], bound["stoppable"]) == ("not_stopped", False)
    assert "InstantTensor reads in its C++ library" in bound["detail"]
    assert events.named("hybrid_draft.load_failed") == []
    (loaded,) = events.named("hybrid_draft.loaded")
    assert loaded["role"] == "target" and loaded["stalls"] >= 1


def test_a_load_that_moves_again_while_the_watcher_asks_is_never_stopped_afterwards(
    deepseek: Path, pacer: Pacer, events: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race: the watcher finds the load quiet past its bound, then asks what it waits on
    (a store's answer takes seconds), and the read returns meanwhile and the load ends
    ``loaded``. No stop is asked of the load's thread once it no longer waits, and nothing
    lands after its end (the test's own Python keeps running for a while after it). The
    same read held for ever is stopped (the test above): the bound is live here."""
    from hybrid_draft.core import watch

    real = watch._open_shards

    def asking_slowly(paths: set[str]) -> list[str]:
        found = real(paths)
        time.sleep(1.5)  # the store answers late; the read returns meanwhile
        return found

    monkeypatch.setattr(watch, "_open_shards", asking_slowly)
    watch_settings(monkeypatch, stall_seconds="0.4", load_timeout="0.4")
    pacer.hold_at, pacer.hold = 10, 0.8

    target_of(deepseek, "safetensors")
    until = time.monotonic() + 2.5
    while time.monotonic() < until:  # where a stop queued for this thread would land
        time.sleep(0.01)

    stalls = events.named(STALLED)
    assert stalls and [e.get("action") for e in stalls] == [None] * len(stalls), stalls
    assert events.named("hybrid_draft.load_failed") == []
    (loaded,) = events.named("hybrid_draft.loaded")
    assert loaded["role"] == "target" and loaded["stalls"] >= 1


def test_a_reload_past_its_load_timeout_is_said_and_never_stopped_part_way(
    deepseek: Path, pacer: Pacer, events: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model is served: stopping its reload part way would leave it part one step's.
    The bound is said, and the reload completes once its read does."""
    runner = model_runner(engine_config(deepseek))
    watch_settings(monkeypatch, stall_seconds="0.3", load_timeout="0.6")
    pacer.tensors, pacer.hold_at, pacer.hold = 0, 10, 1.5

    reload_weights(runner)

    past = [e for e in events.named(STALLED) if e.get("action")]
    assert [(e["trigger"], e["action"]) for e in past] == [("reload", "not_stopped")]
    assert "not stopped part way" in past[0]["detail"]
    assert events.named("hybrid_draft.load_failed") == []
    reloads = [e for e in events.named("hybrid_draft.loaded") if e["trigger"] == "reload"]
    assert [e["role"] for e in reloads] == ["target", "draft"]


def test_vllms_processing_after_the_stream_is_no_stall(
    deepseek: Path, pacer: Pacer, events: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the stream has given its last tensor nothing is read: vLLM's processing of the
    weights (minutes on a large quantized model) is neither a stall nor stopped."""
    import vllm.model_executor.model_loader.base_loader as base_loader

    real = base_loader.process_weights_after_loading

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(base_loader, "process_weights_after_loading", slow)
    watch_settings(monkeypatch, stall_seconds="0.3", load_timeout="0.6", progress_seconds="0.2")

    target_of(deepseek)

    # The watcher looked all along (its progress events, during the 1.2 s of processing
    # too, every tensor taken by then): it saw no stall.
    late = [e for e in events.named(PROGRESS) if e["tensors"] == pacer.tensors]
    assert len(late) >= 3, events.named(PROGRESS)
    assert events.named(STALLED) == []
    assert [e["role"] for e in events.named("hybrid_draft.loaded")] == ["target"]


def test_a_shard_that_is_a_fifo_fails_at_once_naming_it(
    deepseek: Path, events: Events, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard replaced by a FIFO no one writes to: never a hang, a load that fails at once
    and names it."""
    import shutil

    copy = tmp_path / "deepseek"
    shutil.copytree(deepseek, copy)
    shard = sorted(copy.glob("*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    watch_settings(monkeypatch, stall_seconds="1", load_timeout="3")
    monkeypatch.setenv("HYBRID_DRAFT_HOLD_BUDGET", "0")
    started = time.monotonic()

    with pytest.raises(Exception):  # noqa: B017 - vLLM's own error, whatever it is
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model

        config = engine_config(copy, load_format="safetensors")
        with set_current_vllm_config(config):
            get_model(vllm_config=config)

    assert time.monotonic() - started < 20
    (failed,) = events.named("hybrid_draft.load_failed")
    # The layer's own refusal, before anything opens it (open would wait in the kernel for
    # a writer, where no stop lands): its CheckpointError names the shard and what it is.
    assert failed["error_type"] == "CheckpointError", failed
    assert shard.name in failed["error"] and "FIFO" in failed["error"], failed


@pytest.mark.parametrize("experts", [None, {0}], ids=["every expert", "expert 0 of 4"])
def test_a_targets_planned_tensors_are_those_its_rank_is_given(
    glm: Path, vllm_runtime: Any, experts: set[int] | None
) -> None:
    """With expert parallelism a rank's target load is given its own experts alone (vLLM's
    own filter drops the others before they are read): its progress counts against those,
    or its share would never reach the whole and its time left would be too long."""
    from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight

    from hybrid_draft.adapter import load
    from hybrid_draft.core import checkpoint

    shards = checkpoint.read_checkpoint(glm)
    every = sum(len(s.tensors) for s in shards)
    if experts is None:
        assert load.rank_tensors(shards, None) == every
        return
    mine = load.rank_tensors(shards, lambda name: should_skip_weight(name, experts))
    names = [t.name for s in shards for t in s.tensors]
    theirs = [n for n in names if ".experts." in n and ".experts.0." not in n]
    assert theirs and mine == every - len(theirs)
