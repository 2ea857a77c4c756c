"""One pass: the target's InstantTensor stream keeps the draft's tensors, the draft reads none.

Real vLLM on the CPU: the target through ``get_model`` (the CPU runner's route) or straight
through its loader's ``load_model`` (the GPU runners' route), the draft through the real
``EagleProposer``, inside the load scope the model runners open (``loadscope.scope``). vLLM's
InstantTensor iterator is the only stand-in (conftest); the tap wraps what it yields.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import (
    REPLACED,
    Events,
    Recorder,
    checkpoint_tensors,
    draft_tensors,
    engine_config,
    load_target_and_draft,
    vllm_module,
)
from hybrid_draft.core import checkpoint

pytestmark = pytest.mark.vllm


def draft_events(events: Events, name: str) -> list[dict[str, Any]]:
    return [e for e in events.named(name) if e.get("role", "draft") == "draft"]


def test_the_draft_takes_its_tensors_from_the_targets_stream(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
    lazy_spy: Recorder,
) -> None:
    from hybrid_draft.adapter import loadscope

    with loadscope.scope():
        loaded = load_target_and_draft(engine_config(deepseek))
    own = draft_tensors(deepseek, loaded.draft)
    # The target's pass is the one read of the checkpoint; the draft opened no shard.
    assert len(instanttensor_standin.calls) == 1
    assert filtered_reads.calls == [] and lazy_spy.calls == []
    (target,) = events.decisions("target")
    assert target["one_pass"]["enabled"] is True
    assert target["one_pass"]["planned_tensors"] == len(own)
    assert target["one_pass"]["planned_bytes"] == sum(own.values())
    (draft,) = events.decisions("draft")
    assert draft["sources"]["stream"] == {"tensors": len(own), "bytes": sum(own.values())}
    assert draft["sources"]["storage"] == {"tensors": 0, "bytes": 0}
    (load,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"]
    assert load["sources"] == {
        "storage": {"tensors": 0, "bytes": 0},
        "stream": {"tensors": len(own), "bytes": sum(own.values())},
        "replaced_by_target": draft["sources"]["replaced_by_target"],
    }
    assert load["sources"]["replaced_by_target"]["tensors"] == 3
    assert load["one_pass"]["held_bytes"] == sum(own.values())
    (released,) = events.named("hybrid_draft.hold_released")
    assert released["reason"] == "the draft's load ended"
    assert released["released_tensors"] == 0  # every held tensor was taken
    # The draft holds the checkpoint's values.
    ckpt = checkpoint_tensors(deepseek)
    params = dict(loaded.draft.named_parameters())
    n = loaded.config.model_config.hf_config.num_hidden_layers
    for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        expected = ckpt[f"model.layers.{n}.{name}"].float()
        assert torch.equal(params[f"model.layers.{n}.{name}"].detach(), expected), name
    assert loaded.draft.model.embed_tokens is loaded.target.model.embed_tokens


def _state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_tap_changes_nothing_the_target_or_the_draft_loads(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Target and draft, parameter for parameter, with the tap and without it (budget 0)."""
    from hybrid_draft.adapter import loadscope

    with loadscope.scope():
        tapped = load_target_and_draft(engine_config(deepseek))
    monkeypatch.setenv("HYBRID_DRAFT_HOLD_BUDGET", "0")
    with loadscope.scope():
        plain = load_target_and_draft(engine_config(deepseek))
    for a, b in ((tapped.target, plain.target), (tapped.draft, plain.draft)):
        sa, sb = _state(a), _state(b)
        assert sa.keys() == sb.keys() and sa
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key
    first, second = events.decisions("target")
    assert first["one_pass"]["enabled"] is True
    assert second["one_pass"] == {"enabled": False, "reason": "hold_budget_zero"}
    assert instanttensor_standin.calls[0] == instanttensor_standin.calls[1]


def test_held_memory_returns_when_no_draft_load_follows(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The target loads, its pass holds the draft's tensors, and the scope closes without a
    draft load: the hold lets go of every tensor (no reference left anywhere)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.model_executor.model_loader import get_model

    from hybrid_draft.adapter import loadscope

    config = engine_config(deepseek)
    alive: list[weakref.ref[torch.Tensor]] = []
    with loadscope.scope() as scope, set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        get_model(vllm_config=config)
        (held,) = scope.holds
        assert held.tensors and held.held_bytes > 0
        alive = [weakref.ref(t) for t in held.tensors.values()]
        held = None
    gc.collect()
    assert alive and all(ref() is None for ref in alive)
    (released,) = events.named("hybrid_draft.hold_released")
    assert released["reason"] == "no draft load followed the target's in this load scope"
    assert released["released_tensors"] == len(alive) and released["released_bytes"] > 0


def test_a_failed_draft_load_releases_the_hold(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

    from hybrid_draft.adapter import loadscope

    def broken(self: Any, weights: Any) -> Any:
        raise RuntimeError("the draft's weights are corrupt")

    monkeypatch.setattr(DeepSeekMTP, "load_weights", broken)
    with pytest.raises(RuntimeError, match="corrupt"), loadscope.scope():
        load_target_and_draft(engine_config(deepseek))
    (released,) = events.named("hybrid_draft.hold_released")
    assert released["reason"] == "the draft's load failed" and released["released_tensors"] > 0


def test_a_budget_holds_what_fits_and_the_rest_is_read(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybrid_draft.adapter import loadscope

    sizes = sorted(own_tensors_of_layout(deepseek).values(), reverse=True)
    budget = sum(sizes) // 2
    monkeypatch.setenv("HYBRID_DRAFT_HOLD_BUDGET", str(budget))
    with loadscope.scope():
        load_target_and_draft(engine_config(deepseek))
    (load,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"]
    stream, storage = load["sources"]["stream"], load["sources"]["storage"]
    assert 0 < stream["bytes"] <= budget and storage["bytes"] > 0
    assert stream["tensors"] + storage["tensors"] == len(sizes)
    assert stream["bytes"] + storage["bytes"] == sum(sizes)
    read = [n for c in filtered_reads.calls for n in c["tensors"]]
    assert len(read) == storage["tensors"]


def own_tensors_of_layout(model: Path) -> dict[str, int]:
    """What DeepSeekMTP reads itself, from the layout: its MTP layer but the replaced."""
    from hybrid_draft.tools import synth

    layout = synth.deepseek_v3("tiny", moe=False)
    return {
        t.name: t.nbytes
        for t in layout.tensors
        if t.name in layout.is_mtp and not t.name.endswith(REPLACED)
    }


@pytest.mark.parametrize(
    ("setting", "reason"),
    [
        ({"INSTANTTENSOR_DRAFT_LOADER": "instanttensor"}, "draft_not_switched"),
        ({"HYBRID_DRAFT_HOLD_BUDGET": "0"}, "hold_budget_zero"),
    ],
)
def test_nothing_is_held_when_the_draft_does_not_take_it(
    setting: dict[str, str],
    reason: str,
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybrid_draft.adapter import loadscope

    for key, value in setting.items():
        monkeypatch.setenv(key, value)
    with loadscope.scope() as scope:
        load_target_and_draft(engine_config(qwen35))
        assert scope.holds == []
    (target,) = events.decisions("target")
    assert target["one_pass"]["enabled"] is False and target["one_pass"]["reason"] == reason
    assert not events.named("hybrid_draft.hold_released")


def test_no_scope_no_hold(qwen35: Path, events: Events, instanttensor_standin: Recorder) -> None:
    """Outside a model runner's load_model nothing would release a hold: none is made."""
    load_target_and_draft(engine_config(qwen35))
    (target,) = events.decisions("target")
    assert target["one_pass"]["enabled"] is False
    assert target["one_pass"]["reason"] == "no_load_scope"


@pytest.mark.parametrize(
    "runner",
    [
        # Model runner v2, in every supported release.
        "vllm.v1.worker.gpu.model_runner:GPUModelRunner",
        # The V1 runners (0.33; gone in 0.34).
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
    ],
)
def test_the_model_runners_load_model_is_the_scope(runner: str, vllm_runtime: Any) -> None:
    module, _, name = runner.partition(":")
    cls = getattr(vllm_module(module), name)
    assert getattr(cls.load_model, "__hybrid_draft_scope__", False), cls


def test_the_cpu_model_runner_v2_load_model_is_the_scope(vllm_runtime: Any) -> None:
    """0.34's CPU runner subclasses model runner v2 (absent from 0.33)."""
    cls = vllm_module("vllm.v1.worker.cpu.model_runner").CPUModelRunner
    assert getattr(cls.load_model, "__hybrid_draft_scope__", False), cls


def test_a_target_loaded_by_its_loader_directly_is_decided_and_tapped(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
) -> None:
    """vLLM's GPU runners load the target with ``get_model_loader(...).load_model(...)``,
    not ``get_model``: the layer decides, reports and taps it all the same."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

    from hybrid_draft.adapter import loadscope

    config = engine_config(deepseek)
    with loadscope.scope(), set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        target = get_model_loader(config.load_config).load_model(
            vllm_config=config, model_config=config.model_config
        )
        load_eagle_model(target, config)
    (decision,) = events.decisions("target")
    assert (decision["action"], decision["reason"]) == ("kept", "target_model")
    assert decision["one_pass"]["enabled"] is True
    roles = [e["role"] for e in events.named("hybrid_draft.loaded")]
    assert roles == ["target", "draft"]
    assert filtered_reads.calls == []


def test_each_shard_header_is_read_once_per_draft(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The draft's plan is made once: its decision, loader and events share it. With one
    pass it is made at the target's load, and the draft's load reads no header at all."""
    from hybrid_draft.adapter import loadscope

    reads: list[str] = []
    real = checkpoint.read_header

    def counting(path: Any) -> Any:
        reads.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(checkpoint, "read_header", counting)
    shards = sorted(p.name for p in deepseek.glob("*.safetensors"))
    load_target_and_draft(engine_config(deepseek))  # no scope: the draft plans for itself
    assert sorted(reads) == shards
    reads.clear()
    with loadscope.scope():
        load_target_and_draft(engine_config(deepseek))
    assert sorted(reads) == shards  # read once, at the target's load, for the draft


@pytest.mark.parametrize("share", [1, 2])
def test_the_bench_holds_what_a_served_load_holds(
    share: int,
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``hybrid-draft bench``'s one pass decides its hold by production's code: for the same
    checkpoint and settings it holds exactly the tensors a served load's stream keeps (all
    of them, and with a budget that fits only part)."""
    from hybrid_draft.adapter import loadscope
    from hybrid_draft.core import hold
    from hybrid_draft.tools.bench import strategies

    own = own_tensors_of_layout(deepseek)
    monkeypatch.setenv("HYBRID_DRAFT_HOLD_BUDGET", str(sum(own.values()) // share))
    taken: list[str] = []
    take = hold.Hold.take

    def spy(self: hold.Hold, name: str) -> Any:
        tensor = take(self, name)
        if tensor is not None:
            taken.append(name)
        return tensor

    monkeypatch.setattr(hold.Hold, "take", spy)
    with loadscope.scope():
        load_target_and_draft(engine_config(deepseek))
    assert taken and (share == 1) == (set(taken) == set(own))
    assert strategies.held_names(str(deepseek)) == frozenset(taken)
