"""Drafts of fastsafetensors and local Run:ai targets inside real vLLM 0.33 on the CPU: the
draft is read by its target's own loader family, filtered to its planned tensors, the replaced
ones skipped, shards without draft tensors never opened. Only vLLM's
``fastsafetensors_weights_iterator`` (CUDA only) stands in for the target's read, reading the
same tensors with fastsafetensors' own loader on the CPU; Run:ai's streamer runs for real."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import (
    QWEN35_REPLACED,
    Events,
    Recorder,
    assert_qwen35_draft_is_the_checkpoints,
    engine_config,
    load_target_and_draft,
    rule_keeps,
)
from hybrid_draft.core.checkpoint import read_checkpoint

pytestmark = pytest.mark.vllm

REPLACED = QWEN35_REPLACED


@pytest.fixture
def byte_ranges(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """The byte ranges fastsafetensors' copier is told to read, per file (a spy on
    ``SafeTensorsMetadata.select_byte_ranges``, which still computes them)."""
    from fastsafetensors import common

    real = common.SafeTensorsMetadata.select_byte_ranges
    recorder = Recorder()

    def spy(self: Any, keep: Any) -> Any:
        ranges = real(self, keep)
        recorder.calls.append({"file": Path(self.src).name, "ranges": list(ranges)})
        return ranges

    monkeypatch.setattr(common.SafeTensorsMetadata, "select_byte_ranges", spy)
    return recorder


def test_fastsafetensors_target_draft_reads_only_its_own_tensors(
    qwen35: Path,
    events: Events,
    fastsafetensors_standin: Recorder,
    byte_ranges: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HYBRID_DRAFT_HOLD_BUDGET", "0")  # the filtered read alone
    config = engine_config(qwen35, load_format="fastsafetensors")

    loaded = load_target_and_draft(config)

    shards = sorted(p.name for p in qwen35.glob("*.safetensors"))
    assert fastsafetensors_standin.files() == [shards]  # the target: every shard, once
    sizes = {t.name: t.nbytes for s in read_checkpoint(qwen35) for t in s.tensors}
    where = {t.name: s.path.name for s in read_checkpoint(qwen35) for t in s.tensors}
    own = rule_keeps(qwen35, loaded.draft) - REPLACED
    # fastsafetensors read the draft's own tensors' bytes and nothing more, from the shards
    # that hold them only.
    assert sorted(c["file"] for c in byte_ranges.calls) == sorted({where[n] for n in own})
    read = sum(end - start for c in byte_ranges.calls for start, end in c["ranges"])
    assert read == sum(sizes[n] for n in own)

    (draft,) = events.decisions("draft")
    assert (draft["action"], draft["reason"], draft["requested_format"]) == (
        "switched",
        "same_checkpoint",
        "fastsafetensors",
    )
    assert draft["chosen_format"] == "fastsafetensors"
    (draft_load,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"]
    assert draft_load["load_format"] == "fastsafetensors"
    assert draft_load["sources"]["storage"] == {
        "tensors": len(own),
        "bytes": sum(sizes[n] for n in own),
    }
    assert draft_load["sources"]["replaced_by_target"]["tensors"] == len(REPLACED)
    assert loaded.draft.lm_head is loaded.target.lm_head

    assert_qwen35_draft_is_the_checkpoints(qwen35, loaded.draft)


def test_keep_formats_leaves_a_fastsafetensors_draft_untouched(
    qwen35: Path,
    events: Events,
    fastsafetensors_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HYBRID_DRAFT_KEEP_FORMATS", "fastsafetensors")
    config = engine_config(qwen35, load_format="fastsafetensors")

    load_target_and_draft(config)

    (draft,) = events.decisions("draft")
    assert (draft["action"], draft["reason"], draft["chosen_format"]) == (
        "kept",
        "not_instanttensor",
        "fastsafetensors",
    )
    # The draft went through vLLM's fastsafetensors iterator, as the target did.
    assert len(fastsafetensors_standin.calls) == 2
    (target,) = events.decisions("target")
    assert target["one_pass"]["enabled"] is False


def _header_bytes(shard: Path) -> int:
    """A shard's 8-byte length and its JSON header."""
    with shard.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_runai_target_draft_streams_only_its_own_tensors(
    qwen35: Path, events: Events, runai_requests: Recorder
) -> None:
    config = engine_config(qwen35, load_format="runai_streamer")

    loaded = load_target_and_draft(config)

    shards = sorted(qwen35.glob("*.safetensors"))
    sizes = {t.name: t.nbytes for s in read_checkpoint(qwen35) for t in s.tensors}
    where = {t.name: s.path.name for s in read_checkpoint(qwen35) for t in s.tensors}
    own = rule_keeps(qwen35, loaded.draft) - REPLACED
    own_shards = {where[n] for n in own}
    # The target: each shard's length, header, then all its tensors (every byte of it).
    target = runai_requests.calls[: 3 * len(shards)]
    assert sum(c["bytes"] for c in target) == sum(s.stat().st_size for s in shards)
    # The draft: its shards' headers, then exactly its own tensors' bytes; no other shard.
    draft_requests = runai_requests.calls[3 * len(shards) :]
    assert {c["file"] for c in draft_requests} == own_shards
    assert sum(c["bytes"] for c in draft_requests) == sum(sizes[n] for n in own) + sum(
        _header_bytes(qwen35 / s) for s in own_shards
    )

    (draft,) = events.decisions("draft")
    assert (draft["action"], draft["reason"], draft["chosen_format"]) == (
        "switched",
        "same_checkpoint",
        "runai_streamer",
    )
    (draft_load,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"]
    assert draft_load["load_format"] == "runai_streamer"
    assert draft_load["sources"]["storage"] == {
        "tensors": len(own),
        "bytes": sum(sizes[n] for n in own),
    }
    assert loaded.draft.lm_head is loaded.target.lm_head
    assert_qwen35_draft_is_the_checkpoints(qwen35, loaded.draft)


def test_runai_target_one_pass_the_draft_reads_nothing(
    qwen35: Path, events: Events, runai_requests: Recorder
) -> None:
    """Inside a model runner's load scope, the Run:ai target's stream keeps the draft's
    tensors: the draft sends the streamer no request at all."""
    from hybrid_draft.adapter import loadscope

    with loadscope.scope():
        loaded = load_target_and_draft(engine_config(qwen35, load_format="runai_streamer"))

    shards = sorted(qwen35.glob("*.safetensors"))
    sizes = {t.name: t.nbytes for s in read_checkpoint(qwen35) for t in s.tensors}
    own = rule_keeps(qwen35, loaded.draft) - REPLACED
    # Only the target's requests: each shard's length, header and tensors, once.
    assert len(runai_requests.calls) == 3 * len(shards)
    assert sum(c["bytes"] for c in runai_requests.calls) == sum(s.stat().st_size for s in shards)

    (target,) = events.decisions("target")
    assert target["one_pass"]["enabled"] is True
    assert target["one_pass"]["planned_bytes"] == sum(sizes[n] for n in own)
    target_load, draft_load = events.named("hybrid_draft.loaded")
    assert target_load["role"] == "target"
    assert (target_load["shards"], target_load["checkpoint_shards"]) == (len(shards), len(shards))
    assert target_load["tensors"] == len(sizes)
    assert target_load["checkpoint_bytes"] == sum(s.stat().st_size for s in shards)
    assert target_load["network_bytes"] is None  # local files
    assert draft_load["sources"]["storage"] == {"tensors": 0, "bytes": 0}
    assert draft_load["sources"]["stream"] == {
        "tensors": len(own),
        "bytes": sum(sizes[n] for n in own),
    }
    assert draft_load["shards"] == 0
    assert_qwen35_draft_is_the_checkpoints(qwen35, loaded.draft)


def test_fastsafetensors_target_one_pass_the_draft_reads_nothing(
    qwen35: Path,
    events: Events,
    fastsafetensors_standin: Recorder,
    byte_ranges: Recorder,
) -> None:
    """The fastsafetensors target's stream keeps the draft's tensors (copies: each of its
    tensors shares its shard's buffer); the draft's fastsafetensors loader reads nothing."""
    from hybrid_draft.adapter import loadscope

    with loadscope.scope():
        loaded = load_target_and_draft(engine_config(qwen35, load_format="fastsafetensors"))

    sizes = {t.name: t.nbytes for s in read_checkpoint(qwen35) for t in s.tensors}
    own = rule_keeps(qwen35, loaded.draft) - REPLACED
    assert len(fastsafetensors_standin.calls) == 1  # the target's pass only
    assert byte_ranges.calls == []  # the draft's filtered reader never ran
    (target,) = events.decisions("target")
    assert target["one_pass"]["enabled"] is True
    (draft_load,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"]
    assert draft_load["sources"]["stream"] == {
        "tensors": len(own),
        "bytes": sum(sizes[n] for n in own),
    }
    assert draft_load["sources"]["storage"] == {"tensors": 0, "bytes": 0}
    assert draft_load["one_pass"]["peak_bytes"] == sum(sizes[n] for n in own)
    assert_qwen35_draft_is_the_checkpoints(qwen35, loaded.draft)


@pytest.mark.parametrize("fmt", ["fastsafetensors", "runai_streamer"])
def test_plan_for_a_fast_loader_target(
    fmt: str, qwen35: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``plan --load-format``: the stock rows are that loader's (the same shards read whole
    as InstantTensor's), ``auto`` is its filtered read of the same tensors."""
    import json

    from hybrid_draft.tools import cli

    def plan(*argv: str) -> dict[str, Any]:
        capsys.readouterr()
        assert cli.main(["plan", str(qwen35), "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)

    stock, fast = plan(), plan("--load-format", fmt)
    assert fast["load_format"] == fmt and stock["load_format"] == "instanttensor"
    assert fast["auto"] == {
        "action": "switched",
        "reason": "same_checkpoint",
        "chosen_format": fmt,
        "tensor_filter": True,
    }
    assert list(fast["modes"]) == [fmt, f"{fmt}_pruned", "auto", "one_pass"]
    assert fast["modes"][fmt] == stock["modes"]["instanttensor"]
    assert fast["modes"][f"{fmt}_pruned"] == stock["modes"]["instanttensor_pruned"]
    for row in ("auto", "one_pass"):
        assert fast["modes"][row] == stock["modes"][row]
    own = {t.name for s in read_checkpoint(qwen35) for t in s.tensors if t.name.startswith("mtp.")}
    assert fast["modes"]["auto"]["tensors"] == len(own)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_status:
        cli.main(["plan", str(qwen35), "--load-format", "bin"])
    assert exit_status.value.code == 2
    assert capsys.readouterr().err == (
        "hybrid-draft plan: argument --load-format: invalid choice: 'bin' (choose from "
        "'instanttensor', 'fastsafetensors', 'runai_streamer') (see hybrid-draft plan --help)\n"
    )
