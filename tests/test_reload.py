"""The draft reloaded with its target: vLLM's own model runner's ``reload_weights``.

Real vLLM on the CPU: the CPU model runner of each route this release has (0.33's V1
runner, model runner v2's), built and loaded as vLLM's CPU worker does it
(``conftest.model_runner``), then its real ``reload_weights``, which reloads the target by
vLLM's own reload function. A level-2 sleep frees the draft's parameters and leaves their
memory as it finds it: here every draft parameter is overwritten with garbage instead
(sleep mode needs CUDA). After the reload, every draft parameter must equal the checkpoint's
it was asked to reload from, in the same storage (CUDA graphs were captured on it). vLLM's
InstantTensor iterator is the only stand-in (conftest); the tap wraps what it yields.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import (
    Events,
    Recorder,
    checkpoint_tensors,
    draft_tensors,
    engine_config,
    load_target_and_draft,
    model_runner,
    reload_weights,
)
from hybrid_draft.tools import synth

pytestmark = pytest.mark.vllm

#: What a level-2 sleep leaves in a parameter it did not keep (any value will do: one that
#: no checkpoint here holds).
GARBAGE = 7.0


def params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def own(runner: Any) -> dict[str, torch.Tensor]:
    """The draft's own parameters: not those it shares with the target, which the target's
    reload restores."""
    theirs = {id(p) for p in runner.get_model().parameters()}
    draft = runner.get_draft_model()
    return {n: p.detach().clone() for n, p in draft.named_parameters() if id(p) not in theirs}


def storage(model: Any) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in model.named_parameters()}


@torch.no_grad()
def garble(model: Any) -> None:
    """Every parameter of ``model`` overwritten, as a level-2 sleep leaves it."""
    for param in model.parameters():
        param.fill_(GARBAGE)


def differing(model: Any, expected: dict[str, torch.Tensor]) -> list[str]:
    """The parameters of ``model`` that differ from ``expected`` (by name)."""
    found = params(model)
    assert found.keys() == expected.keys()
    return [n for n, t in found.items() if not torch.equal(t, expected[n])]


def reloads(events: Events, event: str, role: str = "draft") -> list[dict[str, Any]]:
    return [e for e in events.named(event) if e.get("trigger") == "reload" and e["role"] == role]


def boot_draft(model_dir: Path) -> dict[str, torch.Tensor]:
    """The draft's parameters as vLLM loads them from ``model_dir`` at a first load."""
    return params(load_target_and_draft(engine_config(model_dir, load_format="safetensors")).draft)


@pytest.fixture(scope="module")
def step2(deepseek: Path) -> Iterator[Path]:
    """The next training step's checkpoint of ``deepseek``: the same model, every tensor
    different (another seed)."""
    out = deepseek.parent / "deepseek-step2"
    if not (out / "config.json").exists():
        layout = synth.deepseek_v3("tiny", moe=False)
        synth.write_checkpoint(
            out, layout, synth.shard(layout, num_shards=3, mtp_own_shard=True), seed=2
        )
    yield out


@pytest.fixture(scope="module")
def without_mtp(deepseek: Path) -> Iterator[Path]:
    """``deepseek`` saved without its MTP layer (its config unchanged), as a trainer that
    saves only the base model writes it."""
    out = deepseek.parent / "deepseek-no-mtp"
    if not out.exists():
        shutil.copytree(deepseek, out)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        n = json.loads((out / "config.json").read_text())["num_hidden_layers"]
        mtp = {k: v for k, v in index["weight_map"].items() if k.startswith(f"model.layers.{n}.")}
        for shard in set(mtp.values()):
            (out / shard).unlink()  # the MTP layer's shard of its own
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in mtp}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    yield out


def stream_of(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``model_dir``, in checkpoint format, as a trainer streams them."""
    yield from checkpoint_tensors(model_dir).items()


@pytest.mark.parametrize("route", ["v1", "v2"])
def test_after_a_level_2_sleep_the_draft_takes_its_tensors_from_the_targets_reload(
    route: str,
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
    lazy_spy: Recorder,
) -> None:
    runner = model_runner(engine_config(deepseek), route)
    draft = runner.get_draft_model()
    boot, where = params(draft), storage(draft)
    own = draft_tensors(deepseek, draft)
    garble(draft)
    passes = len(instanttensor_standin.calls)

    reload_weights(runner)

    assert differing(draft, boot) == []
    assert storage(draft) == where
    # The target's reload is the one pass over the checkpoint; the draft opened no shard.
    assert len(instanttensor_standin.calls) == passes + 1
    assert filtered_reads.calls == [] and lazy_spy.calls == []
    (target,) = [d for d in events.decisions("target") if d["trigger"] == "reload"]
    assert target["reload_source"] == "checkpoint"
    assert target["one_pass"]["enabled"] is True
    (decision,) = [d for d in events.decisions("draft") if d["trigger"] == "reload"]
    assert (decision["action"], decision["reason"], decision["reload_source"]) == (
        "switched",
        "same_checkpoint",
        "checkpoint",
    )
    (loaded,) = reloads(events, "hybrid_draft.loaded")
    assert loaded["sources"]["storage"] == {"tensors": 0, "bytes": 0}
    assert loaded["sources"]["stream"] == {"tensors": len(own), "bytes": sum(own.values())}
    assert loaded["sources"]["replaced_by_target"]["tensors"] == 3
    assert loaded["load_format"] == "safetensors"


def test_with_the_hold_off_the_draft_reads_its_own_tensors_only(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HYBRID_DRAFT_HOLD_BUDGET", "0")
    runner = model_runner(engine_config(deepseek))
    draft = runner.get_draft_model()
    boot = params(draft)
    own = draft_tensors(deepseek, draft)
    garble(draft)
    first = len(filtered_reads.calls)

    reload_weights(runner)

    assert differing(draft, boot) == []
    read = filtered_reads.calls[first:]
    assert sorted(t for c in read for t in c["tensors"]) == sorted(own)
    assert sum(c["bytes"] for c in read) == sum(own.values())
    (loaded,) = reloads(events, "hybrid_draft.loaded")
    assert loaded["sources"]["storage"] == {"tensors": len(own), "bytes": sum(own.values())}
    assert loaded["sources"]["stream"] == {"tensors": 0, "bytes": 0}


@pytest.mark.parametrize("route", ["v1", "v2"])
def test_a_new_checkpoint_reloads_the_draft_from_it(
    route: str,
    deepseek: Path,
    step2: Path,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
) -> None:
    expected = boot_draft(step2)
    runner = model_runner(engine_config(deepseek), route)
    draft = runner.get_draft_model()
    where = storage(draft)
    garble(draft)

    reload_weights(runner, weights_path=str(step2))

    assert differing(draft, expected) == []
    assert storage(draft) == where
    spec = runner.vllm_config.speculative_config
    assert runner.vllm_config.model_config.model == str(step2)
    assert spec.draft_model_config.model == str(step2)
    assert instanttensor_standin.calls[-1]["files"] == sorted(
        p.name for p in step2.glob("*.safetensors")
    )
    assert filtered_reads.calls == []  # from the target's stream of the new checkpoint
    (decision,) = [d for d in events.decisions("draft") if d["trigger"] == "reload"]
    assert (decision["reason"], decision["reload_source"], decision["model"]) == (
        "same_checkpoint",
        "weights_path",
        str(step2),
    )


@pytest.mark.parametrize("route", ["v1", "v2"])
def test_a_weights_stream_reloads_the_draft_from_the_same_stream(
    route: str,
    deepseek: Path,
    step2: Path,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
) -> None:
    """The trainer's stream refills one buffer per shape, as a bucketed transfer does: the
    draft's tensors are copies taken as they pass."""
    expected = boot_draft(step2)
    runner = model_runner(engine_config(deepseek), route)
    draft = runner.get_draft_model()
    where = storage(draft)
    own = draft_tensors(deepseek, draft)
    garble(draft)
    passes = len(instanttensor_standin.calls)
    buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def trainer() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in stream_of(step2):
            buffer = buffers.setdefault((tensor.shape, tensor.dtype), torch.empty_like(tensor))
            buffer.copy_(tensor)
            yield name, buffer

    reload_weights(runner, weights_iterator=trainer())

    assert differing(draft, expected) == []
    assert storage(draft) == where
    assert len(instanttensor_standin.calls) == passes and filtered_reads.calls == []
    (decision,) = [d for d in events.decisions("draft") if d["trigger"] == "reload"]
    assert (decision["action"], decision["reason"], decision["chosen_format"]) == (
        "switched",
        "reload_stream",
        "weights_iterator",
    )
    (loaded,) = reloads(events, "hybrid_draft.loaded")
    assert loaded["sources"]["stream"] == {"tensors": len(own), "bytes": sum(own.values())}
    assert loaded["sources"]["storage"] == {"tensors": 0, "bytes": 0}
    assert loaded["tensors"] == len(own)


def test_a_stream_without_the_drafts_tensors_keeps_the_draft_and_says_what_it_lacked(
    deepseek: Path, step2: Path, events: Events, instanttensor_standin: Recorder
) -> None:
    runner = model_runner(engine_config(deepseek))
    boot = own(runner)
    n = runner.vllm_config.model_config.hf_config.num_hidden_layers
    lacking = f"model.layers.{n}.eh_proj.weight"

    stream = ((k, v) for k, v in stream_of(step2) if k != lacking)
    reload_weights(runner, weights_iterator=stream)

    # Kept, whole: no layer half from another step.
    assert boot and all(torch.equal(t, boot[n]) for n, t in own(runner).items())
    (decision,) = [d for d in events.decisions("draft") if d["trigger"] == "reload"]
    assert decision["level"] == "warning"
    assert (decision["action"], decision["reason"]) == ("kept", "incomplete_stream")
    assert lacking in decision["detail"] and "the draft keeps its weights" in decision["detail"]
    assert reloads(events, "hybrid_draft.loaded") == []
    assert len(reloads(events, "hybrid_draft.loaded", "target")) == 1


def test_a_new_checkpoint_without_the_drafts_tensors_keeps_the_draft(
    deepseek: Path, without_mtp: Path, events: Events, instanttensor_standin: Recorder
) -> None:
    runner = model_runner(engine_config(deepseek))
    boot = own(runner)

    reload_weights(runner, weights_path=str(without_mtp))

    assert boot and all(torch.equal(t, boot[n]) for n, t in own(runner).items())
    (decision,) = [d for d in events.decisions("draft") if d["trigger"] == "reload"]
    assert decision["level"] == "warning"
    assert (decision["action"], decision["reason"]) == ("kept", "no_draft_tensors")
    assert str(without_mtp) in decision["detail"]
    assert [w["code"] for w in decision["warnings"]] == ["no_draft_tensors"]
    assert reloads(events, "hybrid_draft.loaded") == []


def test_a_kernel_format_stream_is_left_to_vllm(
    deepseek: Path, events: Events, instanttensor_standin: Recorder
) -> None:
    runner = model_runner(engine_config(deepseek))
    boot = own(runner)
    kernel = [(n, p.detach() * 2) for n, p in runner.get_model().named_parameters()]

    # (vLLM copies kernel-format weights into parameters with in-place copies, which a
    # parameter that requires grad refuses outside no_grad.)
    with torch.no_grad():
        reload_weights(runner, weights_iterator=iter(kernel), is_checkpoint_format=False)

    assert boot and all(torch.equal(t, boot[n]) for n, t in own(runner).items())
    (decision,) = [d for d in events.decisions("draft") if d["trigger"] == "reload"]
    assert (decision["action"], decision["reason"], decision["level"]) == (
        "kept",
        "kernel_format",
        "warning",
    )
    assert reloads(events, "hybrid_draft.loaded") == []


def test_with_the_reload_off_vllm_reloads_the_target_alone(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What vLLM does without the layer: the draft keeps what the sleep left."""
    monkeypatch.setenv("HYBRID_DRAFT_RELOAD", "off")
    runner = model_runner(engine_config(deepseek))
    target = runner.get_model()
    expected = params(target)
    garble(runner.get_draft_model())

    reload_weights(runner)

    assert differing(target, expected) == []
    left = own(runner)
    assert left and all(bool((t == GARBAGE).all()) for t in left.values())
    (decision,) = [d for d in events.decisions("draft") if d["trigger"] == "reload"]
    assert (decision["reason"], decision["level"]) == ("reload_off", "info")
    assert reloads(events, "hybrid_draft.loaded") == []


@pytest.mark.parametrize("route", ["v1", "v2"])
def test_a_draft_with_a_checkpoint_of_its_own(
    route: str,
    qwen3_pair: tuple[Path, Path],
    events: Events,
    instanttensor_standin: Recorder,
) -> None:
    """Reloaded from its own checkpoint when the target reloads from its original one;
    kept, with a warning, when the target reloads from a new checkpoint."""
    target_dir, draft_dir = qwen3_pair
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 1}
    runner = model_runner(engine_config(target_dir, speculative_config=spec), route)
    draft = runner.get_draft_model()
    boot = params(draft)
    garble(draft)

    reload_weights(runner)
    assert differing(draft, boot) == []

    garble(draft)
    reload_weights(runner, weights_path=str(target_dir))
    assert all(bool((p == GARBAGE).all()) for p in draft.parameters())
    first, second = [d for d in events.decisions("draft") if d["trigger"] == "reload"]
    assert (first["action"], first["reason"]) == ("kept", "different_checkpoint")
    assert (second["reason"], second["level"]) == ("own_checkpoint_kept", "warning")
    assert [e["reload_source"] for e in reloads(events, "hybrid_draft.loaded")] == ["checkpoint"]
