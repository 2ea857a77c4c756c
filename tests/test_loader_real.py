"""The layer inside real vLLM on the CPU: real engine configs, real ``get_model``, real
draft routes. Only InstantTensor's reads are replaced (they need CUDA)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import (
    Events,
    Recorder,
    checkpoint_tensors,
    engine_config,
    load_target_and_draft,
    rule_keeps,
)
from hybrid_draft.core.checkpoint import read_checkpoint

pytestmark = pytest.mark.vllm

DECISION_KEYS = {
    "event",
    "level",
    "timestamp",
    "pid",
    "role",
    "mode",
    "mode_source",
    "method",
    "requested_format",
    "chosen_format",
    "action",
    "reason",
    "model",
    "revision",
}
SWITCH_LINE = (
    "Hybrid draft loading: using lazy safetensors for speculative draft weights "
    "while preserving InstantTensor for the target model"
)


def qwen35_mtp_expected(name: str, ckpt: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The checkpoint tensor(s) a Qwen3.5 MTP draft parameter is loaded from."""
    if name in ("lm_head.weight", "model.embed_tokens.weight"):
        return ckpt[name]
    source = "mtp." + name.removeprefix("model.")
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for param, parts in fused.items():
        if param in source:
            return torch.cat([ckpt[source.replace(param, p)] for p in parts])
    return ckpt.get(source)


@pytest.fixture
def vllm_log_lines(vllm_runtime: Any) -> Any:
    """Messages logged through vLLM's own logger for the layer (``vllm.hybrid_draft``)."""
    import logging

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect()
    logger = logging.getLogger("vllm.hybrid_draft")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def test_instanttensor_target_lazy_draft_with_checkpoint_values(
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    lazy_spy: Recorder,
    filtered_reads: Recorder,
    vllm_log_lines: list[str],
) -> None:
    config = engine_config(qwen35)
    target_load_config = config.load_config
    before = dataclasses.asdict(target_load_config)

    loaded = load_target_and_draft(config)

    # The target went through InstantTensor, every shard, exactly once.
    assert instanttensor_standin.files() == [sorted(p.name for p in qwen35.glob("*.safetensors"))]
    # The draft was memory-mapped (lazy safetensors), and only the tensors its class's
    # checkpoint-weight rule keeps were read, each once, from the shards that hold them,
    # but the embedding and the LM head, which vLLM's proposer replaces with the target's.
    assert not lazy_spy.calls
    read = [name for c in filtered_reads.calls for name in c["tensors"]]
    replaced = {"model.embed_tokens.weight", "lm_head.weight"}
    assert replaced <= rule_keeps(qwen35, loaded.draft)
    assert sorted(read) == sorted(rule_keeps(qwen35, loaded.draft) - replaced)
    assert all(c["tensors"] for c in filtered_reads.calls)
    assert loaded.draft.model.embed_tokens is loaded.target.model.embed_tokens
    assert loaded.draft.lm_head is loaded.target.lm_head
    (draft_load,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"]
    sizes = {t.name: t.nbytes for s in read_checkpoint(qwen35) for t in s.tensors}
    # Each read tensor was read whole, and nothing else was read from its shards.
    assert sum(c["bytes"] for c in filtered_reads.calls) == sum(sizes[n] for n in read)
    assert draft_load["sources"] == {
        "storage": {"tensors": len(read), "bytes": sum(sizes[n] for n in read)},
        "stream": {"tensors": 0, "bytes": 0},
        "replaced_by_target": {"tensors": 2, "bytes": sum(sizes[n] for n in replaced)},
    }
    # The target's LoadConfig is the same object, unchanged.
    assert config.load_config is target_load_config
    assert dataclasses.asdict(target_load_config) == before

    ckpt = checkpoint_tensors(qwen35)
    params = dict(loaded.draft.named_parameters())
    assert params, "the draft has no parameters"
    for name, param in params.items():
        expected = qwen35_mtp_expected(name, ckpt)
        assert expected is not None, f"no checkpoint tensor for draft parameter {name}"
        assert torch.equal(param.detach(), expected.to(param.dtype)), name

    target, draft = events.decisions("target"), events.decisions("draft")
    assert [(e["action"], e["reason"], e["chosen_format"]) for e in target] == [
        ("kept", "target_model", "instanttensor")
    ]
    assert [
        (e["action"], e["reason"], e["requested_format"], e["chosen_format"]) for e in draft
    ] == [("switched", "same_checkpoint", "instanttensor", "safetensors")]
    assert draft[0]["method"] == "mtp" and draft[0]["target_model"] == str(qwen35)
    assert (draft[0]["pruning_rule"], draft[0]["tensor_filter"]) == ("vllm", True)
    assert vllm_log_lines == [SWITCH_LINE]


def test_each_get_model_call_emits_one_decision_on_stderr_and_in_the_file(
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    capfd: pytest.CaptureFixture[str],
) -> None:
    capfd.readouterr()
    load_target_and_draft(engine_config(qwen35))
    err = capfd.readouterr().err
    on_stderr = [line for line in err.splitlines() if '"hybrid_draft.decision"' in line]
    in_file = events.decisions()
    assert len(on_stderr) == 2 and len(in_file) == 2  # one target call, one draft call
    import json

    from hybrid_draft.core.policy import REASONS

    for line, record in zip(on_stderr, in_file, strict=True):
        parsed = json.loads(line)
        assert parsed == record
        assert parsed["reason"] in REASONS
        assert parsed.keys() >= DECISION_KEYS
        assert parsed["level"] == "info" and parsed["pid"] == os.getpid()
        assert parsed["timestamp"].endswith(("Z", "+00:00"))
    assert {"target_model", "target_revision"} <= in_file[1].keys()


# --- the mode matrix -----------------------------------------------------------------------


def _scenario(
    name: str, qwen35: Path, qwen35_copy: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> dict[str, Any]:
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    if name == "same":
        return {"model": qwen35, "speculative_config": mtp}
    if name == "different":
        return {"model": qwen35, "speculative_config": {**mtp, "model": str(qwen35_copy)}}
    if name == "symlink":
        link = tmp_path / "link-to-model"
        link.symlink_to(qwen35, target_is_directory=True)
        return {"model": qwen35, "speculative_config": {**mtp, "model": str(link)}}
    if name == "relative_trailing_slash":
        monkeypatch.chdir(qwen35.parent)
        return {"model": qwen35, "speculative_config": {**mtp, "model": f"./{qwen35.name}/"}}
    if name == "explicit_draft_loader":
        return {
            "model": qwen35,
            "speculative_config": {**mtp, "draft_load_config": {"load_format": "safetensors"}},
        }
    if name == "not_instanttensor":
        return {"model": qwen35, "load_format": "safetensors", "speculative_config": mtp}
    if name == "target_revision":
        return {"model": qwen35, "revision": "main", "speculative_config": mtp}
    raise AssertionError(name)


SCENARIOS = (
    "same",
    "different",
    "symlink",
    "relative_trailing_slash",
    "explicit_draft_loader",
    "not_instanttensor",
    "target_revision",
)
SAME = ("same", "symlink", "relative_trailing_slash", "target_revision")

# (scenario, mode) -> (action, reason, chosen format)
EXPECTED: dict[tuple[str, str], tuple[str, str, str]] = {}
for _s in SCENARIOS:
    for _m in ("auto", "safetensors", "instanttensor"):
        if _s == "explicit_draft_loader":
            EXPECTED[_s, _m] = ("kept", "explicit_draft_loader", "safetensors")
        elif _s == "not_instanttensor":
            EXPECTED[_s, _m] = ("kept", "not_instanttensor", "safetensors")
        elif _m == "instanttensor":
            EXPECTED[_s, _m] = ("kept", "mode_instanttensor", "instanttensor")
        elif _m == "safetensors":
            EXPECTED[_s, _m] = ("switched", "forced_safetensors", "safetensors")
        elif _s in SAME:
            EXPECTED[_s, _m] = ("switched", "same_checkpoint", "safetensors")
        else:
            EXPECTED[_s, _m] = ("kept", "different_checkpoint", "instanttensor")


@pytest.mark.parametrize(("scenario", "mode"), sorted(EXPECTED))
def test_mode_matrix(
    scenario: str,
    mode: str,
    qwen35: Path,
    qwen35_copy: Path,
    events: Events,
    instanttensor_standin: Recorder,
    lazy_spy: Recorder,
    filtered_reads: Recorder,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", mode)
    kwargs = _scenario(scenario, qwen35, qwen35_copy, monkeypatch, tmp_path)
    config = engine_config(kwargs.pop("model"), **kwargs)
    target_load_config, before = config.load_config, dataclasses.asdict(config.load_config)

    load_target_and_draft(config)

    (draft,) = events.decisions("draft")
    action, reason, chosen = EXPECTED[scenario, mode]
    assert (draft["action"], draft["reason"], draft["chosen_format"]) == (action, reason, chosen)
    assert (draft["mode"], draft["mode_source"]) == (mode, "env")
    target_uses_it = scenario != "not_instanttensor"
    # Which of vLLM's iterators the draft really went through:
    draft_it_calls = len(instanttensor_standin.calls) - (1 if target_uses_it else 0)
    draft_lazy_calls = [c for c in lazy_spy.calls if target_uses_it or c is not lazy_spy.calls[0]]
    if chosen == "instanttensor":
        assert draft_it_calls == 1 and not draft_lazy_calls and not filtered_reads.calls
    elif action == "switched":  # lazy safetensors through the tensor filter (a vLLM rule)
        assert draft_it_calls == 0 and not draft_lazy_calls and filtered_reads.calls
        assert draft["tensor_filter"] is True
    else:  # the user's own safetensors loader: vLLM's iterator, as configured
        assert draft_it_calls == 0 and not filtered_reads.calls
        assert [c["strategy"] for c in draft_lazy_calls] == [None]
        assert draft["tensor_filter"] is False
    assert config.load_config is target_load_config
    assert dataclasses.asdict(target_load_config) == before


def test_instanttensor_mode_passes_the_draft_to_instanttensor(
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the real InstantTensor iterator for the draft, vLLM's own CUDA check fires."""
    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", "instanttensor")
    config = engine_config(qwen35)
    import vllm.model_executor.model_loader.default_loader as default_loader
    from vllm.model_executor.model_loader import get_model

    real_load_weights = default_loader.DefaultModelLoader.load_weights
    calls = []

    def after_target(self: Any, model: Any, model_config: Any) -> None:
        calls.append(model_config)
        if len(calls) == 2:  # the draft: hand it to the real InstantTensor iterator
            instanttensor_standin.real = True
        return real_load_weights(self, model, model_config)

    monkeypatch.setattr(default_loader.DefaultModelLoader, "load_weights", after_target)
    with pytest.raises(ValueError, match="InstantTensor requires NVIDIA GPUs"):
        load_target_and_draft(config)
    assert len(instanttensor_standin.calls) == 2
    (draft,) = events.decisions("draft")
    assert draft["reason"] == "mode_instanttensor"
    assert callable(get_model)


# --- every route a supported vLLM loads a draft by (V1 routes: 0.33 only) ----------------


@pytest.mark.parametrize("route", ["eagle", "mrv2_eagle"])
def test_mtp_routes_switch_same_checkpoint_drafts(
    route: str,
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    lazy_spy: Recorder,
    filtered_reads: Recorder,
) -> None:
    loaded = load_target_and_draft(engine_config(qwen35), route=route)
    (draft,) = events.decisions("draft")
    assert (draft["action"], draft["reason"]) == ("switched", "same_checkpoint")
    assert not lazy_spy.calls
    # Both routes replace the draft's embedding and LM head with the target's: never read.
    replaced = {"model.embed_tokens.weight", "lm_head.weight"}
    assert sorted(n for c in filtered_reads.calls for n in c["tensors"]) == sorted(
        rule_keeps(qwen35, loaded.draft) - replaced
    )
    assert loaded.draft.model.embed_tokens is loaded.target.model.embed_tokens
    assert loaded.draft.lm_head is loaded.target.lm_head
    assert not events.named("hybrid_draft.replaced_fallback")
    assert len(instanttensor_standin.calls) == 1


@pytest.mark.parametrize("route", ["draft_model", "mrv2_standalone"])
@pytest.mark.parametrize(
    ("mode", "same", "expected"),
    [
        ("auto", False, ("kept", "different_checkpoint")),
        ("auto", True, ("switched", "same_checkpoint")),
        ("safetensors", False, ("switched", "forced_safetensors")),
    ],
)
def test_standalone_draft_model_routes(
    route: str,
    mode: str,
    same: bool,
    expected: tuple[str, str],
    qwen3_pair: tuple[Path, Path],
    events: Events,
    instanttensor_standin: Recorder,
    lazy_spy: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``draft_model`` proposers pass neither model_config nor load_config to get_model."""
    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", mode)
    target, other = qwen3_pair
    spec = {
        "method": "draft_model",
        "model": str(target if same else other),
        "num_speculative_tokens": 2,
    }
    load_target_and_draft(engine_config(target, speculative_config=spec), route=route)
    (draft,) = events.decisions("draft")
    assert (draft["action"], draft["reason"]) == expected
    assert draft["method"] == "draft_model"
    switched = expected[0] == "switched"
    assert len(instanttensor_standin.calls) == (1 if switched else 2)
    # Qwen3ForCausalLM has no checkpoint-weight rule: vLLM's own lazy iterator, unfiltered.
    assert [c["strategy"] for c in lazy_spy.calls] == (["lazy"] if switched else [])
    assert draft["tensor_filter"] is False


def test_multithread_load_is_dropped_for_the_draft(
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    lazy_spy: Recorder,
    filtered_reads: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import vllm.model_executor.model_loader.default_loader as default_loader

    multi = []
    real_multi = default_loader.multi_thread_safetensors_weights_iterator
    monkeypatch.setattr(
        default_loader,
        "multi_thread_safetensors_weights_iterator",
        lambda *a, **k: multi.append(a) or real_multi(*a, **k),
    )
    config = engine_config(
        qwen35, model_loader_extra_config={"enable_multithread_load": True, "num_threads": 2}
    )
    load_target_and_draft(config)
    assert not multi, "the draft used the whole-file multi-thread reader"
    assert not lazy_spy.calls and filtered_reads.calls
    assert config.load_config.model_loader_extra_config == {
        "enable_multithread_load": True,
        "num_threads": 2,
    }


def test_invalid_setting_stops_the_load_with_an_event(
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    from hybrid_draft.settings import ConfigError

    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", "fastest")
    config = engine_config(qwen35)
    with pytest.raises(ConfigError) as info:
        load_target_and_draft(config)
    message = str(info.value)
    assert "INSTANTTENSOR_DRAFT_LOADER" in message and "'fastest'" in message
    assert "auto, safetensors, instanttensor, selective" in message
    (error,) = events.named("hybrid_draft.config_error")
    assert error["source"] == "INSTANTTENSOR_DRAFT_LOADER" and error["level"] == "error"
    assert '"hybrid_draft.config_error"' in capfd.readouterr().err
    assert not instanttensor_standin.calls, "the target was loaded despite the error"
