"""Faults under a real draft load: a shard that changes under the reader, settings that change
between the target's load and the draft's.

Real vLLM on the CPU, as in test_loader_real.py. A shard truncated while the draft's
reader has it open must fail the load with ``hybrid_draft.load_failed`` naming the shard;
a memory-mapped reader would instead die of SIGBUS and take pytest with it, so those loads
run in a child pytest process (the ``child`` tests, skipped in the parent) whose exit status
the parent checks. The settings tests change ``HYBRID_DRAFT_SKIP_REPLACED`` or
``HYBRID_DRAFT_HOLD_BUDGET`` between the two loads of one load scope (a config push between
them) and check that what the draft did and what its events say agree, and follow the
draft's own settings.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    Events,
    Recorder,
    child_pytest,
    draft_tensors,
    engine_config,
    load_target_and_draft,
)
from hybrid_draft import settings

pytestmark = pytest.mark.vllm

CHILD = "HYBRID_DRAFT_TEST_FAULT_CHILD"
in_child = pytest.mark.skipif(
    os.environ.get(CHILD) != "1", reason="run in a child process by test_a_shard_that_changes_*"
)


# --- a shard that changes under the reader (in a child process) ----------------------------


def _failed_draft(events: Events) -> dict[str, Any]:
    (target,) = events.named("hybrid_draft.loaded")
    assert target["role"] == "target"
    (failed,) = events.named("hybrid_draft.load_failed")
    assert (failed["role"], failed["level"], failed["load_format"]) == (
        "draft",
        "error",
        "safetensors",
    )
    assert failed["error_type"] == "ShardChanged"
    return failed


@pytest.fixture
def model(qwen35: Path, tmp_path: Path) -> Path:
    """A copy of the Qwen3.5 checkpoint that a test may cut or rewrite."""
    out = tmp_path / "model"
    shutil.copytree(qwen35, out)
    return out


@in_child
def test_child_a_shard_truncated_while_read(
    model: Path, events: Events, instanttensor_standin: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybrid_draft import files
    from hybrid_draft.core import shardread

    real = shardread.read_into
    cut: list[tuple[str, int, Any]] = []

    def truncating(fd: int, view: memoryview, offset: int, path: str, run: Any) -> None:
        if not cut:  # the first read: cut the shard in the middle of it
            end = offset + len(view) // 2
            cut.append((path, end, next(t for t in run if end < t.end)))
            os.truncate(path, end)
        real(fd, view, offset, path, run)

    monkeypatch.setattr(shardread, "read_into", truncating)
    with pytest.raises(shardread.ShardChanged) as info:
        load_target_and_draft(engine_config(model))
    ((path, end, tensor),) = cut  # the tensor the file now ends in
    failed = _failed_draft(events)
    assert failed["error"] == str(info.value)
    assert failed["error"].startswith(
        f"{path}: expected {tensor.nbytes:,} bytes of tensor {files.show(tensor.name)} "
    )
    assert f"at offset {tensor.start:,}, but the file ends at {end:,}" in failed["error"]
    assert f"(it now has {end:,} bytes)" in failed["error"]


@in_child
def test_child_a_shard_truncated_after_the_plan(
    model: Path, events: Events, instanttensor_standin: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybrid_draft.core import shardread

    real = shardread.read_shard
    sizes: dict[str, int] = {}

    def truncating(path: str, *args: Any) -> Any:
        sizes[path] = os.path.getsize(path)
        os.truncate(path, sizes[path] - 100)
        return real(path, *args)

    monkeypatch.setattr(shardread, "read_shard", truncating)
    with pytest.raises(shardread.ShardChanged):
        load_target_and_draft(engine_config(model))
    ((path, size),) = sizes.items()
    assert _failed_draft(events)["error"] == (
        f"{path}: the file has {size - 100:,} bytes, not the {size:,} its header described "
        "when the draft's load was planned: it changed since"
    )


@in_child
def test_child_a_shard_rewritten_after_the_plan(
    model: Path, events: Events, instanttensor_standin: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same size, another header (one tensor renamed in place): refused, never read at
    the offsets of the header planned."""
    from hybrid_draft.core import shardread

    real = shardread.read_shard
    rewritten: list[str] = []

    def rewriting(path: str, *args: Any) -> Any:
        data = bytearray(Path(path).read_bytes())
        at = data.index(b'"mtp.')
        data[at + 1 : at + 5] = b"MTP."
        Path(path).write_bytes(data)
        rewritten.append(path)
        return real(path, *args)

    monkeypatch.setattr(shardread, "read_shard", rewriting)
    with pytest.raises(shardread.ShardChanged):
        load_target_and_draft(engine_config(model))
    (path,) = rewritten
    assert _failed_draft(events)["error"] == (
        f"{path}: its header is not the one the draft's load was planned from: the file was "
        "replaced or rewritten since"
    )


def test_a_shard_that_changes_under_the_reader_fails_the_load_and_the_process_lives() -> None:
    """The child tests above, in a process of their own: a SIGBUS would end it, not pytest."""
    proc = child_pytest(__file__, "test_child_", {CHILD: "1"}, timeout=900)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode != -signal.SIGBUS, f"the child died of SIGBUS:\n{tail}"
    assert proc.returncode == 0, tail
    assert "3 passed" in proc.stdout, tail


# --- one settings snapshot per draft load --------------------------------------------------


def _counts(sizes: dict[str, int]) -> dict[str, int]:
    return {"tensors": len(sizes), "bytes": sum(sizes.values())}


def _load_with_a_change_between(model: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> Any:
    """Target and draft in one load scope, ``env`` set after the target's load."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

    from hybrid_draft.adapter import loadscope

    config = engine_config(model)
    with loadscope.scope(), set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        target = get_model(vllm_config=config)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return load_eagle_model(target, config)


def _fingerprint() -> str:
    return settings.load().fingerprint()


def _draft_events(events: Events) -> tuple[dict[str, Any], dict[str, Any]]:
    (decision,) = events.decisions("draft")
    (loaded,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"]
    return decision, loaded


def test_skip_replaced_turned_off_between_the_loads_is_followed(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = _fingerprint()
    draft = _load_with_a_change_between(deepseek, monkeypatch, HYBRID_DRAFT_SKIP_REPLACED="false")
    after = _fingerprint()
    own, replaced = draft_tensors(deepseek, draft), draft_tensors(deepseek, draft, replaced=True)
    assert len(replaced) == 3 and before != after
    (target,) = events.decisions("target")
    assert target["settings_fingerprint"] == before and target["one_pass"]["enabled"]
    decision, loaded = _draft_events(events)
    assert decision["settings_fingerprint"] == loaded["settings_fingerprint"] == after
    assert decision["settings_changed"] == {
        "target_settings_fingerprint": before,
        "changed": ["skip_replaced"],
        "plan": "replanned",
        "stream": "taken",
    }
    # The draft's settings say read the replaced tensors: it read them, and only them, from
    # storage; its own tensors came from the target's stream. Decision and load agree.
    assert sorted(n for c in filtered_reads.calls for n in c["tensors"]) == sorted(replaced)
    expected = {
        "storage": _counts(replaced),
        "stream": _counts(own),
        "replaced_by_target": {"tensors": 0, "bytes": 0},
    }
    assert decision["sources"] == loaded["sources"] == expected
    assert not events.named("hybrid_draft.replaced_fallback")


def test_skip_replaced_turned_on_between_the_loads_is_followed(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HYBRID_DRAFT_SKIP_REPLACED", "false")
    before = _fingerprint()
    draft = _load_with_a_change_between(deepseek, monkeypatch, HYBRID_DRAFT_SKIP_REPLACED="true")
    after = _fingerprint()
    own, replaced = draft_tensors(deepseek, draft), draft_tensors(deepseek, draft, replaced=True)
    # The target's plan held the replaced tensors too (its settings read them).
    (target,) = events.decisions("target")
    assert target["one_pass"]["planned_tensors"] == len(own) + len(replaced)
    decision, loaded = _draft_events(events)
    assert decision["settings_fingerprint"] == loaded["settings_fingerprint"] == after
    assert decision["settings_changed"] == {
        "target_settings_fingerprint": before,
        "changed": ["skip_replaced"],
        "plan": "replanned",
        "stream": "taken",
    }
    # The draft's settings say skip them: it took only its own tensors, read nothing, and
    # the held replaced tensors were let go unread.
    assert filtered_reads.calls == []
    expected = {
        "storage": {"tensors": 0, "bytes": 0},
        "stream": _counts(own),
        "replaced_by_target": _counts(replaced),
    }
    assert decision["sources"] == loaded["sources"] == expected
    (released,) = events.named("hybrid_draft.hold_released")
    assert released["released_tensors"] == len(replaced)


def test_a_hold_budget_changed_between_the_loads_sends_the_draft_to_storage(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = _fingerprint()
    draft = _load_with_a_change_between(deepseek, monkeypatch, HYBRID_DRAFT_HOLD_BUDGET="1MiB")
    after = _fingerprint()
    own = draft_tensors(deepseek, draft)
    decision, loaded = _draft_events(events)
    assert decision["settings_fingerprint"] == loaded["settings_fingerprint"] == after
    assert decision["settings_changed"] == {
        "target_settings_fingerprint": before,
        "changed": ["hold_budget"],
        "plan": "held",
        "stream": "released",
    }
    (released,) = events.named("hybrid_draft.hold_released")
    assert released["reason"].startswith("the settings changed between the target's load")
    assert released["released_tensors"] == len(own)
    # Released before the draft decided: everything it reads comes from storage.
    assert sorted(n for c in filtered_reads.calls for n in c["tensors"]) == sorted(own)
    assert decision["sources"]["stream"] == loaded["sources"]["stream"] == _counts({})
    assert decision["sources"]["storage"] == loaded["sources"]["storage"] == _counts(own)
    assert "one_pass" not in loaded


def test_unchanged_settings_keep_the_held_plan_and_say_nothing(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same values from another source (the variable set to the default): the same
    snapshot for what the load decides, so the held plan stands."""
    _load_with_a_change_between(deepseek, monkeypatch, HYBRID_DRAFT_SKIP_REPLACED="true")
    decision, loaded = _draft_events(events)
    assert "settings_changed" not in decision
    assert filtered_reads.calls == []
    assert loaded["sources"]["stream"]["tensors"] > 0


def test_the_loaded_event_carries_the_settings_the_load_decided_with(
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Settings that change while the draft reads do not leak into its loaded event."""
    from hybrid_draft.core import shardread

    real = shardread.read_shard

    def changing(*args: Any) -> Any:
        monkeypatch.setenv("HYBRID_DRAFT_HOLD_BUDGET", "123")
        return real(*args)

    decided = _fingerprint()
    monkeypatch.setattr(shardread, "read_shard", changing)
    load_target_and_draft(engine_config(qwen35))
    assert _fingerprint() != decided
    decision, loaded = _draft_events(events)
    assert decision["settings_fingerprint"] == loaded["settings_fingerprint"] == decided
