"""What each load cost, as events: ``hybrid_draft.loaded`` / ``load_failed`` from real vLLM
loads on the CPU, and ``hybrid-draft report`` on the events file they leave."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import Events, Recorder, engine_config, load_target_and_draft, rule_keeps
from hybrid_draft.core import checkpoint

pytestmark = pytest.mark.vllm

LOADED_KEYS = {
    "event",
    "level",
    "timestamp",
    "pid",
    "role",
    "model",
    "load_format",
    "seconds",
    "bytes_read",
    "tensors",
    "shards",
    "tensor_filter",
    "checkpoint_shards",
    "checkpoint_bytes",
}


def _load_draft(target: Any, config: Any) -> Any:
    """The draft's load as model runner v2 makes it (``load_eagle_model``)."""
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

    return load_eagle_model(target, config)


def test_every_load_says_what_it_read(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
) -> None:
    loaded = load_target_and_draft(engine_config(deepseek))
    shards = checkpoint.read_checkpoint(deepseek)
    target, draft = events.named("hybrid_draft.loaded")
    for event in (target, draft):
        assert event.keys() >= LOADED_KEYS
        assert event["pid"] == os.getpid() and event["model"] == str(deepseek)
        assert event["seconds"] > 0 and isinstance(event["bytes_read"], int)
        assert event["checkpoint_shards"] == len(shards)
        assert event["checkpoint_bytes"] == sum(s.path.stat().st_size for s in shards)
    # The target: a full InstantTensor pass, every tensor of every shard yielded.
    assert (target["role"], target["load_format"], target["tensor_filter"]) == (
        "target",
        "instanttensor",
        False,
    )
    assert target["tensors"] == sum(len(s.tensors) for s in shards)
    assert target["shards"] == len(shards)
    # The draft: lazy safetensors, only what DeepSeekMTP keeps, from the shards holding it.
    assert (draft["role"], draft["load_format"], draft["tensor_filter"]) == (
        "draft",
        "safetensors",
        True,
    )
    # (but the embeddings and the shared head, which vLLM replaces with the target's)
    keeps = rule_keeps(deepseek, loaded.draft)
    replaced = {n for n in keeps if n.endswith(("embed_tokens.weight", "shared_head.head.weight"))}
    assert draft["tensors"] == len(keeps - replaced) and len(replaced) == 3
    assert draft["sources"]["replaced_by_target"]["tensors"] == 3
    assert draft["sources"]["storage"]["tensors"] == len(keeps - replaced)
    assert draft["shards"] == len(filtered_reads.calls) < len(shards)
    # Each load's event follows its decision.
    order = [
        (e["event"], e["role"])
        for e in events.all()
        if e["event"] in ("hybrid_draft.decision", "hybrid_draft.loaded")
    ]
    assert order == [
        ("hybrid_draft.decision", "target"),
        ("hybrid_draft.loaded", "target"),
        ("hybrid_draft.decision", "draft"),
        ("hybrid_draft.loaded", "draft"),
    ]


def test_bytes_read_come_from_storage(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
) -> None:
    """The same draft load, from a warm page cache and then a cold one: the figure is what
    the kernel fetched, not a size computed from the files."""
    from vllm.config import set_current_vllm_config

    from hybrid_draft.tools.bench import pagecache

    loaded = load_target_and_draft(engine_config(deepseek))  # leaves the shards cached
    files = [str(p) for p in sorted(deepseek.glob("*.safetensors"))]

    def load_draft_again() -> dict[str, Any]:
        config = engine_config(deepseek)  # a draft's layers register once per config
        with set_current_vllm_config(config):
            _load_draft(loaded.target, config)
        return events.named("hybrid_draft.loaded")[-1]

    # Read just before, as a suite beside this one (an image build) may evict them meanwhile.
    assert all(Path(f).read_bytes() for f in files)
    assert all(pagecache.resident_pages(f)[0] == pagecache.resident_pages(f)[1] for f in files)
    warm = load_draft_again()  # (the first draft load above imported the draft's code)
    assert pagecache.evict(files) == 0
    cold = load_draft_again()
    assert warm["role"] == cold["role"] == "draft"
    read = cold["sources"]["storage"]
    assert read["tensors"] == len(rule_keeps(deepseek, loaded.draft)) - 3  # 3 replaced
    # Warm: the shards' pages fetch nothing (a page or two of another file the process
    # reads meanwhile may count: the figure is the whole process's); cold: at least the
    # draft's own tensors.
    assert warm["bytes_read"] < read["bytes"] <= cold["bytes_read"]


def test_a_load_that_raises_says_so_and_the_exception_is_unchanged(
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.model_executor.models.qwen3_5_mtp import Qwen3_5MTP

    failure = RuntimeError("the draft's weights are corrupt")

    def load_weights(self: Any, weights: Any) -> None:
        raise failure

    monkeypatch.setattr(Qwen3_5MTP, "load_weights", load_weights)
    with pytest.raises(RuntimeError) as info:
        load_target_and_draft(engine_config(qwen35))
    assert info.value is failure
    (target,) = events.named("hybrid_draft.loaded")
    (failed,) = events.named("hybrid_draft.load_failed")
    assert target["role"] == "target"
    assert (failed["role"], failed["level"], failed["load_format"]) == (
        "draft",
        "error",
        "safetensors",
    )
    assert (failed["error_type"], failed["error"]) == (
        "RuntimeError",
        "the draft's weights are corrupt",
    )
    assert failed["seconds"] > 0
    assert "failed_read" not in failed  # every shard it opened reads whole: nothing to name


@pytest.mark.parametrize("load_format", ["runai_streamer", "fastsafetensors"])
@pytest.mark.parametrize("cut", [1000, 0], ids=["truncated", "emptied"])
def test_a_local_target_that_fails_names_the_shard_it_cannot_read_whole(
    qwen35: Path,
    tmp_path: Path,
    events: Events,
    vllm_runtime: Any,
    cut: int,
    load_format: str,
    request: pytest.FixtureRequest,
) -> None:
    """Run:ai's and fastsafetensors' errors name no file; the target's ``load_failed``
    does, and why."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.model_executor.model_loader import get_model

    if load_format == "fastsafetensors":
        request.getfixturevalue("fastsafetensors_standin")
    local = tmp_path / "checkpoint"
    shutil.copytree(qwen35, local)
    shard = sorted(local.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - cut] if cut else b"")
    config = engine_config(local, load_format=load_format)

    with pytest.raises(Exception) as info, set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        get_model(vllm_config=config)

    (failed,) = events.named("hybrid_draft.load_failed")
    assert (failed["role"], failed["error_type"]) == ("target", type(info.value).__name__)
    assert failed["error"] == str(info.value)  # the loader's own words, unchanged
    read = failed["failed_read"]
    assert (read["address"], read["status"], read["code"]) == (str(shard), None, None)
    assert read["answer"].startswith(f"{shard}: ") and "\n" not in read["answer"]


def test_an_invalid_setting_is_a_failed_load(
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybrid_draft.settings import ConfigError

    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", "fastest")
    with pytest.raises(ConfigError):
        load_target_and_draft(engine_config(qwen35))
    (failed,) = events.named("hybrid_draft.load_failed")
    assert (failed["role"], failed["error_type"]) == ("target", "ConfigError")
    assert failed["error"].startswith("INSTANTTENSOR_DRAFT_LOADER: 'fastest'")
    assert not events.named("hybrid_draft.loaded")


# --- hybrid-draft report -------------------------------------------------------------------


def report(events_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hybrid_draft", "report", str(events_file), *args],
        capture_output=True,
        text=True,
    )


def test_report_on_a_real_events_file(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
) -> None:
    load_target_and_draft(engine_config(deepseek))
    target, draft = events.named("hybrid_draft.loaded")
    out = report(events.path, "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    (proc,) = summary["processes"]
    assert proc["pid"] == os.getpid() and not proc["failures"]
    rows = proc["loads"]
    assert [(r["role"], r["load_format"], r["reason"]) for r in rows] == [
        ("target", "instanttensor", "target_model"),
        ("draft", "safetensors", "same_checkpoint"),
    ]
    saved = rows[1]["vs_full_pass"]
    assert saved["full_pass_bytes"] == draft["checkpoint_bytes"]
    assert saved["bytes_saved"] == draft["checkpoint_bytes"] - draft["bytes_read"]
    assert saved["full_pass_seconds"] == target["seconds"]
    assert saved["seconds_saved"] == pytest.approx(target["seconds"] - draft["seconds"])

    text = report(events.path)
    assert text.returncode == 0
    lines = text.stdout.splitlines()
    assert lines[0] == f"process {os.getpid()}"
    assert any(ln.split()[:2] == ["draft", "safetensors"] and "(filtered)" in ln for ln in lines)
    assert any(ln.strip().startswith("draft vs a second full pass: read ") for ln in lines)
    assert lines[-1] == "2 load(s), 0 failed, in 1 process(es)"


def test_report_pairs_each_process_of_a_server(tmp_path: Path) -> None:
    """Lines from an API server and two ranks, interleaved as they are in a shared file."""

    def ev(pid: int, event: str, role: str, **kw: Any) -> str:
        return json.dumps(
            {
                "event": f"hybrid_draft.{event}",
                "level": "info",
                "pid": pid,
                "role": role,
                "model": "/m",
                **kw,
            }
        )

    def loaded(pid: int, role: str, fmt: str, seconds: float, read: int) -> str:
        return ev(
            pid,
            "loaded",
            role,
            load_format=fmt,
            tensor_filter=role == "draft",
            seconds=seconds,
            bytes_read=read,
            tensors=9,
            shards=1,
            checkpoint_shards=4,
            checkpoint_bytes=1000,
        )

    lines = [
        ev(1, "activated", "-"),
        "not json at all",
        ev(10, "decision", "target", action="kept", reason="target_model"),
        ev(11, "decision", "target", action="kept", reason="target_model"),
        loaded(11, "target", "instanttensor", 4.0, 1000),
        loaded(10, "target", "instanttensor", 5.0, 1000),
        ev(10, "decision", "draft", action="switched", reason="same_checkpoint"),
        ev(11, "decision", "draft", action="switched", reason="same_checkpoint"),
        loaded(10, "draft", "safetensors", 1.0, 100),
        ev(
            11,
            "load_failed",
            "draft",
            load_format="safetensors",
            seconds=0.5,
            error_type="ValueError",
            error="boom",
        ),
    ]
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    summary = json.loads(report(path, "--json").stdout)
    by_pid = {p["pid"]: p for p in summary["processes"]}
    assert sorted(by_pid) == [10, 11]
    assert by_pid[10]["loads"][1]["vs_full_pass"] == {
        "full_pass_bytes": 1000,
        "bytes_read": 100,
        "network_bytes": None,
        "bytes_saved": 900,
        "share_read": 0.1,
        "full_pass_seconds": 5.0,
        "seconds": 1.0,
        "seconds_saved": 4.0,
    }
    (failure,) = by_pid[11]["failures"]
    assert (failure["role"], failure["error_type"], failure["reason"]) == (
        "draft",
        "ValueError",
        "same_checkpoint",
    )
    assert (summary["loads"], summary["failures"]) == (3, 1)
    text = report(path).stdout
    assert "FAILED draft load (safetensors) after 0.50 s: ValueError: boom" in text


def test_report_errors_are_one_line(tmp_path: Path) -> None:
    out = report(tmp_path / "missing.jsonl")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"hybrid-draft report: cannot read {tmp_path}/missing.jsonl: No such file or directory"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert report(empty).stdout.startswith("no model loads in these events")
