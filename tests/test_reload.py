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
    GARBAGE,
    Events,
    Recorder,
    checkpoint_tensors,
    differing,
    draft_tensors,
    engine_config,
    garble,
    load_target_and_draft,
    model_runner,
    own,
    params,
    reload_weights,
    reloads,
    storage,
)

pytestmark = pytest.mark.vllm


def boot_draft(model_dir: Path) -> dict[str, torch.Tensor]:
    """The draft's parameters as vLLM loads them from ``model_dir`` at a first load."""
    return params(load_target_and_draft(engine_config(model_dir, load_format="safetensors")).draft)


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


@pytest.mark.parametrize("source", ["checkpoint", "weights_path"])
@pytest.mark.parametrize("load_format", ["safetensors", "fastsafetensors", "runai_streamer"])
def test_every_target_format(
    load_format: str,
    source: str,
    deepseek: Path,
    step2: Path,
    events: Events,
    request: pytest.FixtureRequest,
    vllm_runtime: Any,
) -> None:
    """A fastsafetensors or Run:ai target's reload stream carries the draft's tensors (one
    pass); a plain safetensors target's draft is reloaded as vLLM loads it, from its own
    shards. vLLM's fastsafetensors iterator (CUDA only) is the only stand-in."""
    if load_format == "fastsafetensors":
        request.getfixturevalue("fastsafetensors_standin")
    requests: Recorder = request.getfixturevalue("runai_requests")
    checkpoint = step2 if source == "weights_path" else deepseek
    expected = boot_draft(checkpoint)
    runner = model_runner(engine_config(deepseek, load_format=load_format))
    draft = runner.get_draft_model()
    own = draft_tensors(deepseek, draft)
    garble(draft)
    first = len(requests.calls)

    if source == "weights_path":
        reload_weights(runner, weights_path=str(step2))
    else:
        reload_weights(runner)

    assert differing(draft, expected) == []
    (decision,) = [d for d in events.decisions("draft") if d["trigger"] == "reload"]
    (loaded,) = reloads(events, "hybrid_draft.loaded")
    if load_format == "safetensors":  # a format the layer leaves to vLLM
        assert (decision["action"], decision["reason"]) == ("kept", "not_instanttensor")
        assert "sources" not in loaded
        return
    assert (decision["action"], decision["chosen_format"]) == ("switched", load_format)
    assert loaded["sources"]["storage"] == {"tensors": 0, "bytes": 0}
    assert loaded["sources"]["stream"] == {"tensors": len(own), "bytes": sum(own.values())}
    if load_format == "runai_streamer":  # the target's requests only: each shard whole, once
        shards = sorted(checkpoint.glob("*.safetensors"))
        served = requests.calls[first:]
        assert len(served) == 3 * len(shards)
        assert sum(c["bytes"] for c in served) == sum(s.stat().st_size for s in shards)


def test_a_failed_draft_read_fails_the_reload_naming_the_shard(
    deepseek: Path,
    tmp_path: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The MTP layer's shard is cut short as the draft's reader opens it, after the
    target's reload read it whole (the hold off): the call fails, in one line naming it."""
    from hybrid_draft.core import shardread

    monkeypatch.setenv("HYBRID_DRAFT_HOLD_BUDGET", "0")
    model_dir = tmp_path / "deepseek"
    shutil.copytree(deepseek, model_dir)
    runner = model_runner(engine_config(model_dir))
    real = shardread.read_shard

    def cut_short(path: str, *args: Any, **kwargs: Any) -> Any:
        shard = Path(path)
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shardread, "read_shard", cut_short)

    with pytest.raises(shardread.ShardChanged) as failure:
        reload_weights(runner)

    message = str(failure.value)
    assert str(model_dir) in message and "it changed since" in message and "\n" not in message
    assert len(reloads(events, "hybrid_draft.loaded", "target")) == 1
    (failed,) = reloads(events, "hybrid_draft.load_failed")
    assert failed["error_type"] == "ShardChanged" and failed["error"] == message


def test_a_vllm_whose_reload_has_another_shape_reloads_the_target_alone(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's reload steps with another shape (a parameter list the layer cannot call them
    by; vLLM's own calls still fit): the ``reload`` part is off, said once with
    ``part_skipped``, and vLLM reloads the target alone, as it would without the layer."""
    import importlib

    names = {
        "vllm.model_executor.model_loader.reload.layerwise": "finalize_layerwise_processing",
        "vllm.model_executor.model_loader.reload.lifecycle": "finish_reload",
    }
    for module_name, attr in names.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:  # 0.33 has no lifecycle
            continue
        real = getattr(module, attr)

        def reshaped(model: Any, *rest: Any, _real: Any = real) -> Any:
            return _real(model, *rest)

        monkeypatch.setattr(module, attr, reshaped)
    runner = model_runner(engine_config(deepseek))
    garble(runner.get_draft_model())

    reload_weights(runner)

    left = own(runner)
    assert left and all(bool((t == GARBAGE).all()) for t in left.values())
    (skipped,) = [e for e in events.named("hybrid_draft.part_skipped") if e["part"] == "reload"]
    assert "finalize_layerwise_processing is (model, *rest, _real=" in skipped["reason"]
    assert [e for e in events.all() if e.get("trigger") == "reload"] == []


def test_report_shows_each_reload_and_what_its_draft_kept(
    deepseek: Path,
    without_mtp: Path,
    events: Events,
    instanttensor_standin: Recorder,
) -> None:
    """A server's events file after a first load, a reload from the same checkpoint and one
    from a checkpoint without the draft's tensors: ``report`` pairs each draft with its own
    target's reload and lists the reload that left the draft's weights as they were."""
    import subprocess
    import sys

    runner = model_runner(engine_config(deepseek))
    reload_weights(runner)
    reload_weights(runner, weights_path=str(without_mtp))

    out = subprocess.run(
        [sys.executable, "-m", "hybrid_draft", "report", str(events.path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (proc,) = json.loads(out.stdout)["processes"]
    rows = [(r["role"], r["trigger"], r["reload_source"], r["reason"]) for r in proc["loads"]]
    assert rows == [
        ("target", "load", None, "target_model"),
        ("draft", "load", None, "same_checkpoint"),
        ("target", "reload", "checkpoint", "target_model"),
        ("draft", "reload", "checkpoint", "same_checkpoint"),
        ("target", "reload", "weights_path", "target_model"),
    ]
    target_reload, draft_reload = proc["loads"][2:4]
    saved = draft_reload["vs_full_pass"]
    assert saved["full_pass_seconds"] == target_reload["seconds"]
    assert saved["bytes_read"] == 0  # from the target's reload stream
    (kept,) = proc["not_reloaded"]
    assert (kept["role"], kept["reason"], kept["reload_source"]) == (
        "draft",
        "no_draft_tensors",
        "weights_path",
    )
    text = subprocess.run(
        [sys.executable, "-m", "hybrid_draft", "report", str(events.path)],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "draft (reload: checkpoint)" in text
    assert "reload (weights_path): the draft kept its weights (no_draft_tensors): " in text
