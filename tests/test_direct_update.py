"""The draft follows a trainer's direct ``load_weights`` calls on the served target.

Real vLLM on the CPU: the CPU model runner of each route this release has (0.33's V1 runner,
which has ``drafter``; model runner v2's, which 0.34 has alone and which has none), built and
loaded as vLLM's CPU worker does it (``conftest.model_runner``). Each RL framework's sync is
made as its own source makes it (``tests/e2e/standin/hybrid_draft_e2e_trainers.py``: verl,
OpenRLHF and AReaL over NCCL, AReaL from disk, skyrl, TRL, NeMo RL), reaching the runner as a
worker extension does. Its end is what ends it in a server: verl's post-load processing, or
the runner's next step (``execute_model``), before the draft's next proposal. After it the
draft must hold exactly what a fresh boot of the synced checkpoint gives it (its weights and
what vLLM derives from them, in the same storage), or, where the sync did not bring all of its
tensors, exactly what it held before.

vLLM's CPU build (not this CUDA build on the CPU) packs linear weights after loading and
empties the parameters, so there a direct ``load_weights`` raises with or without the layer;
the CUDA build keeps them here, as a GPU does.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import subprocess
import sys
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
    failing_commit,
    load_target_and_draft,
    model_runner,
    reload_weights,
    storage,
)
from test_weight_update import (
    MTP,
    differing,
    differing_exactly,
    own_differing,
    own_state,
    state,
    tensors_of,
)

pytestmark = pytest.mark.vllm

STANDIN = Path(__file__).resolve().parent / "e2e" / "standin"
if str(STANDIN) not in sys.path:
    sys.path.insert(0, str(STANDIN))

import hybrid_draft_e2e_trainers as trainers  # noqa: E402

DECISION, LOADED = "hybrid_draft.decision", "hybrid_draft.loaded"


def cuts(tensors: dict[str, Any]) -> list[str]:
    """Where bucketed syncs cut ``tensors``: right before the MTP layer (a bucket of the
    base model alone, which vLLM's MTP completeness check refuses when it is fed to the
    draft), and inside the MTP layer at a layer vLLM fuses (``fused_qkv_a_proj``)."""
    names = list(tensors)
    first = next(i for i, n in enumerate(names) if n.startswith(MTP))
    return [names[first - 1], f"{MTP}self_attn.q_a_proj.weight"]


@pytest.fixture(autouse=True)
def _standin(instanttensor_standin: Recorder) -> None:
    """Every runner here loads its target with InstantTensor (read by the stand-in)."""


@pytest.fixture(scope="module")
def booted(step2: Path, vllm_runtime: Any) -> Any:
    """The target and draft as vLLM loads them from ``step2`` at a first load."""
    return load_target_and_draft(engine_config(step2, load_format="safetensors"))


def runner_of(model_dir: Path, route: str = "v2", **engine_args: Any) -> Any:
    return model_runner(engine_config(model_dir, **engine_args), route)


def next_step(runner: Any) -> None:
    """The runner's next step as vLLM's worker makes one: ``execute_model`` with nothing
    scheduled. A load-only test runner holds no KV cache, so vLLM's own step stops short of
    a forward (an AttributeError of vLLM's) once whatever runs before it has run."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.sched.output import SchedulerOutput

    with set_current_vllm_config(runner.vllm_config), contextlib.suppress(AttributeError):
        runner.execute_model(SchedulerOutput.make_empty())


def direct(events: Events, event: str, role: str) -> list[dict[str, Any]]:
    return [
        e for e in events.named(event) if e.get("trigger") == "direct_update" and e["role"] == role
    ]


def has_drafter(runner: Any) -> bool:
    return getattr(getattr(runner, "drafter", None), "model", None) is not None


@pytest.mark.parametrize("route", ["v1", "v2"])
@pytest.mark.parametrize("framework", sorted(trainers.SYNCS))
def test_after_each_frameworks_sync_the_draft_is_the_next_steps(
    framework: str,
    route: str,
    deepseek: Path,
    step2: Path,
    booted: Any,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
) -> None:
    """Every framework's sync of the whole next step (buckets that split the MTP layer
    inside a fused layer, where it buckets), then its end: the draft is the next step's, as
    a fresh boot of it has it, in its own storage; nothing was read for it and nothing
    loaded into it twice (the frameworks that feed the draft themselves find its tensors
    taken already); vLLM's MTP completeness check holds for the whole update."""
    runner = runner_of(deepseek, route)
    target, draft = runner.get_model(), runner.get_draft_model()
    where = storage(draft)
    assert differing(draft, state(booted.draft))
    own = draft_tensors(step2, draft)
    passes, reads = len(instanttensor_standin.calls), len(filtered_reads.calls)
    sent = checkpoint_tensors(step2)

    trainers.SYNCS[framework](runner, sent, cuts(sent))
    next_step(runner)

    assert differing(draft, state(booted.draft)) == []
    assert differing(target, state(booted.target)) == []
    assert storage(draft) == where
    assert (len(instanttensor_standin.calls), len(filtered_reads.calls)) == (passes, reads)
    (target_decision,) = direct(events, DECISION, "target")
    assert (target_decision["reason"], target_decision["one_pass"]["draft_tensors"]) == (
        "target_model",
        len(own),
    )
    bucketed = framework in ("verl", "skyrl", "nemo_rl")
    (target_loaded,) = direct(events, LOADED, "target")
    assert target_loaded["calls"] == (3 if bucketed else len(sent))
    assert target_loaded["tensors"] == len(sent)
    ended = "process_weights_after_loading" if framework == "verl" else "next_step"
    assert target_loaded["ended_by"] == ended
    (decision,) = direct(events, DECISION, "draft")
    assert (decision["action"], decision["reason"], decision["chosen_format"]) == (
        "switched",
        "direct_update",
        "direct_load",
    )
    (loaded,) = direct(events, LOADED, "draft")
    replaced = draft_tensors(step2, draft, replaced=True)
    assert loaded["sources"] == {
        "storage": {"tensors": 0, "bytes": 0},
        "stream": {"tensors": len(own), "bytes": sum(own.values())},
        "replaced_by_target": {"tensors": len(replaced), "bytes": sum(replaced.values())},
    }
    feeds = framework in ("verl", "skyrl", "nemo_rl") and has_drafter(runner)
    assert loaded["draft_calls"] == (3 if feeds else 0)
    assert (loaded["tensors"], loaded["bytes_read"], loaded["ended_by"]) == (len(own), 0, ended)
    # The calls that carried any of its tensors: the MTP layer spans two buckets.
    assert loaded["calls"] == (2 if bucketed else len(own))


def qwen35_reads(model_dir: Path) -> dict[str, int]:
    """The tensors a Qwen3.5 MTP draft reads itself: its ``mtp.*`` (vLLM shares the
    embedding and the head with the target), with sizes."""
    from hybrid_draft.core import checkpoint

    return {
        t.name: t.nbytes
        for s in checkpoint.read_checkpoint(model_dir)
        for t in s.tensors
        if t.name.startswith("mtp.")
    }


@pytest.fixture(scope="module")
def qwen35_booted(qwen35_step2: Path, vllm_runtime: Any) -> Any:
    """The target and draft as vLLM loads them from ``qwen35_step2`` at a first load."""
    return load_target_and_draft(engine_config(qwen35_step2, load_format="safetensors"))


@pytest.mark.parametrize("leaves_out", [False, True], ids=["its stream", "its own tensors"])
def test_a_sync_from_disk_gives_the_draft_that_checkpoint_read_once(
    leaves_out: bool,
    qwen35: Path,
    qwen35_step2: Path,
    qwen35_booted: Any,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AReaL's sync from a checkpoint on disk (a Qwen3.5 MTP model: vLLM's own loader check
    refuses such a sync of an MLA target, whose derived ``W_UK_T`` no checkpoint holds). The
    draft's tensors are taken from the target loader's stream as they pass (one pass) and
    the draft follows that checkpoint; where the target's class leaves the MTP layer out
    (vLLM's loader then never opens its shard), the draft reads only its own tensors from it,
    by its plan."""
    runner = runner_of(qwen35)
    target, draft = runner.get_model(), runner.get_draft_model()
    own = qwen35_reads(qwen35_step2)
    if leaves_out:
        monkeypatch.setattr(
            type(target),
            "is_unused_checkpoint_weight",
            lambda self, name: name.startswith("mtp."),
            raising=False,
        )
    passes, reads = len(instanttensor_standin.calls), len(filtered_reads.calls)

    trainers.areal_disk(runner, str(qwen35_step2))
    next_step(runner)

    assert differing(draft, state(qwen35_booted.draft)) == []
    assert differing(target, state(qwen35_booted.target)) == []
    assert len(instanttensor_standin.calls) == passes + 1  # the target's one read
    read = [t for c in filtered_reads.calls[reads:] for t in c["tensors"]]
    assert sorted(read) == (sorted(own) if leaves_out else [])
    spec = runner.vllm_config.speculative_config
    assert spec.draft_model_config.model == str(qwen35_step2)
    (target_loaded,) = direct(events, LOADED, "target")
    assert (target_loaded["weights_path"], target_loaded["calls"]) == (str(qwen35_step2), 1)
    (loaded,) = direct(events, LOADED, "draft")
    figures = {"tensors": len(own), "bytes": sum(own.values())}
    nothing = {"tensors": 0, "bytes": 0}
    assert loaded["sources"]["storage"] == (figures if leaves_out else nothing)
    assert loaded["sources"]["stream"] == (nothing if leaves_out else figures)


def test_a_sync_from_disk_of_an_mla_target_raises_vllms_own_check_and_the_draft_follows(
    deepseek: Path,
    step2: Path,
    booted: Any,
    events: Events,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AReaL's sync from disk of an MLA target: vLLM's loader checks, once the target's
    ``load_weights`` has returned, that every parameter was loaded, and MLA's derived
    ``W_UK_T``/``W_UV`` (parameters no checkpoint holds) make it raise, with the layer off
    as with it on. The target took every tensor by then: the draft follows it."""
    monkeypatch.setenv("HYBRID_DRAFT_RELOAD", "off")
    runner = runner_of(deepseek)
    with pytest.raises(ValueError, match=r"weights were not initialized from checkpoint.*W_U"):
        trainers.areal_disk(runner, str(step2))
    next_step(runner)
    monkeypatch.delenv("HYBRID_DRAFT_RELOAD")
    runner = runner_of(deepseek)

    with pytest.raises(ValueError, match=r"weights were not initialized from checkpoint.*W_U"):
        trainers.areal_disk(runner, str(step2))
    next_step(runner)

    assert differing(runner.get_draft_model(), state(booted.draft)) == []
    assert differing(runner.get_model(), state(booted.target)) == []
    first, second = direct(events, DECISION, "draft")
    assert (first["reason"], second["reason"]) == ("reload_off", "direct_update")


def test_a_caller_that_feeds_the_draft_itself_splitting_its_mtp_layer_no_longer_raises(
    deepseek: Path,
    step2: Path,
    booted: Any,
    events: Events,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NeMo RL's order on the V1 runner (``drafter``), a bucket of the base model first and
    the MTP layer split across two more: as vLLM makes the calls (the reload setting off),
    its MTP completeness check raises at the first bucket fed to the draft; with the layer
    it does not (the check holds for the whole update)."""
    runner = runner_of(deepseek, "v1")
    if not has_drafter(runner):
        pytest.skip("this vLLM's runner has no drafter")
    sent = checkpoint_tensors(step2)
    parts = trainers.buckets(sent, *cuts(sent))
    monkeypatch.setenv("HYBRID_DRAFT_RELOAD", "off")

    with pytest.raises(ValueError, match="MTP speculative decoding layer 2 weights missing"):
        trainers.nemo_rl(runner, parts)

    next_step(runner)
    monkeypatch.delenv("HYBRID_DRAFT_RELOAD")
    runner = runner_of(deepseek, "v1")  # vLLM's failed call left the first one part fed
    assert differing(runner.get_draft_model(), state(booted.draft))
    trainers.nemo_rl(runner, parts)
    next_step(runner)
    assert differing(runner.get_draft_model(), state(booted.draft)) == []
    first, second = direct(events, DECISION, "draft")
    assert (first["reason"], second["reason"]) == ("reload_off", "direct_update")


@pytest.mark.parametrize("lacking", ["the MTP layer", "its kv_b_proj"])
def test_a_sync_without_all_of_the_drafts_tensors_keeps_the_draft(
    lacking: str,
    deepseek: Path,
    step2: Path,
    events: Events,
) -> None:
    """A trainer that syncs the base model alone, or part of the MTP layer: the target is
    updated, the draft keeps its weights (never part one step's), and a warning names what
    the update lacked."""
    runner = runner_of(deepseek)
    draft = runner.get_draft_model()
    before, objects = own_state(runner), tensors_of(draft)
    missing = f"{MTP}self_attn.kv_b_proj.weight"
    sent = {
        n: t
        for n, t in checkpoint_tensors(step2).items()
        if not (n.startswith(MTP) if lacking == "the MTP layer" else n == missing)
    }

    trainers.openrlhf(runner, sent)
    next_step(runner)

    assert tensors_of(draft) == objects
    assert own_differing(runner, before) == []
    (decision,) = direct(events, DECISION, "draft")
    assert (decision["action"], decision["level"]) == ("kept", "warning")
    if lacking == "the MTP layer":
        assert decision["reason"] == "no_draft_tensors"
        assert "the direct update brought none of the draft's 16 tensors" in decision["detail"]
    else:
        assert decision["reason"] == "incomplete_stream"
        assert f"it lacked 1: {missing}: the draft keeps its weights" in decision["detail"]
    assert direct(events, LOADED, "draft") == []


def test_with_the_reload_off_every_call_is_the_callers_own(
    deepseek: Path,
    step2: Path,
    booted: Any,
    events: Events,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What vLLM does without the layer: the target is updated, the draft keeps the
    previous step, and the update is only reported."""
    monkeypatch.setenv("HYBRID_DRAFT_RELOAD", "off")
    runner = runner_of(deepseek)
    before = own_state(runner)

    trainers.openrlhf(runner, checkpoint_tensors(step2))
    next_step(runner)

    assert differing(runner.get_model(), state(booted.target)) == []
    assert own_differing(runner, before) == []
    (decision,) = direct(events, DECISION, "draft")
    assert (decision["reason"], decision["level"]) == ("reload_off", "info")
    (target,) = direct(events, LOADED, "target")
    assert target["tensors"] is None  # nothing the caller gave was wrapped
    assert direct(events, LOADED, "draft") == []


def test_a_failure_in_the_drafts_load_never_fails_the_callers_call(
    deepseek: Path,
    step2: Path,
    booted: Any,
    events: Events,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = runner_of(deepseek)
    draft = runner.get_draft_model()
    before = own_state(runner)

    def broken(weights: Any) -> Any:
        raise RuntimeError("the draft cannot take this call")

    monkeypatch.setattr(draft, "load_weights", broken)

    trainers.openrlhf(runner, checkpoint_tensors(step2))
    next_step(runner)

    assert differing(runner.get_model(), state(booted.target)) == []
    assert own_differing(runner, before) == []
    (failed,) = [e for e in events.named("hybrid_draft.load_failed") if e["role"] == "draft"]
    assert (failed["trigger"], failed["error"]) == (
        "direct_update",
        "the draft cannot take this call",
    )


def _streamed(runner: Any, tensors: dict[str, Any]) -> None:
    """A checkpoint-engine style caller: one call on the target, a stream of every tensor."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(runner.vllm_config):
        runner.model.load_weights(weights=(item for item in tensors.items()))


@pytest.mark.parametrize("shape", ["per tensor", "a stream"])
def test_a_caller_that_syncs_twice_with_no_end_between_gets_the_later_step(
    shape: str,
    deepseek: Path,
    step2: Path,
    step3: Path,
    booted: Any,
    events: Events,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sync of one step, then of the next, with no step between, one tensor per call
    (OpenRLHF) or each a stream into one call: a tensor of the draft's brought again ends
    its step there (taken whole) and begins the next. After the second the draft is the
    later step's, which it never held before, as a fresh boot of it gives it. An update's
    plan gives it the draft's names only: the next update of the same checkpoint takes them
    from the last one's, reading no shard header."""
    from hybrid_draft.core import checkpoint

    later = load_target_and_draft(engine_config(step3, load_format="safetensors"))
    runner = runner_of(deepseek)
    sync = trainers.openrlhf if shape == "per tensor" else _streamed
    sync(runner, checkpoint_tensors(deepseek))
    next_step(runner)
    assert differing(runner.get_draft_model(), state(later.draft))  # not the later step yet
    read: list[str] = []
    real = checkpoint.read_shard

    def spy(path: str, *args: Any, **kwargs: Any) -> Any:
        read.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "read_shard", spy)

    sync(runner, checkpoint_tensors(step2))
    sync(runner, checkpoint_tensors(step3))
    next_step(runner)

    assert read == []
    assert differing(runner.get_draft_model(), state(later.draft)) == []
    assert differing(runner.get_model(), state(later.target)) == []
    ends = [e["ended_by"] for e in direct(events, LOADED, "draft")]
    assert ends == ["next_step", "next_sync", "next_step"]


def test_a_reload_ends_an_open_update_first(
    deepseek: Path,
    step2: Path,
    booted: Any,
    events: Events,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OpenRLHF's calls, then vLLM's ``reload_weights`` before any step: the update ends
    (the draft took the next step: as the reload begins, the draft is step 2's, whole), then
    the reload reloads both from the checkpoint."""
    from hybrid_draft.adapter import reload

    runner = runner_of(deepseek)
    boot = own_state(runner)
    at_the_reload: list[list[str]] = []
    real = reload.run

    def run(*args: Any, **kwargs: Any) -> Any:  # a spy: the draft as vLLM's reload begins
        at_the_reload.append(differing(runner.get_draft_model(), state(booted.draft)))
        return real(*args, **kwargs)

    monkeypatch.setattr(reload, "run", run)

    trainers.openrlhf(runner, checkpoint_tensors(step2))
    reload_weights(runner)

    assert at_the_reload == [[]]
    assert own_differing(runner, boot) == []
    (loaded,) = direct(events, LOADED, "draft")
    assert loaded["ended_by"] == "reload"
    names = [(e["event"], e["role"], e.get("trigger")) for e in events.all() if "role" in e]
    assert names.index((LOADED, "draft", "direct_update")) < names.index(
        (DECISION, "target", "reload")
    )


def test_the_callers_buffers_refilled_after_each_call(
    deepseek: Path,
    step2: Path,
    booted: Any,
) -> None:
    """verl's buckets are views into one buffer it refills for the next bucket once a call
    returns; the MTP layer split across two of them still arrives whole."""
    runner = runner_of(deepseek)
    draft = runner.get_draft_model()
    sent = checkpoint_tensors(step2)
    buffer = torch.empty(sum(t.numel() for t in sent.values()), dtype=torch.float32)

    def refilled(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        out, offset = [], 0
        for name, tensor in bucket:
            view = buffer[offset : offset + tensor.numel()].view(tensor.shape)
            view.copy_(tensor)
            out.append((name, view))
            offset += tensor.numel()
        return out

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with set_current_vllm_config(runner.vllm_config):
        for bucket in trainers.buckets(sent, *cuts(sent)):
            runner.model.load_weights(refilled(bucket))
            buffer.fill_(7.0)  # the next bucket's, as far as the call knew
        process_weights_after_loading(runner.model, runner.model_config, runner.device)

    assert differing(draft, state(booted.draft)) == []


def test_a_quantized_copy_of_the_targets_head_is_derived_again(
    deepseek: Path,
    step2: Path,
    events: Events,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``draft_lm_head_quantization``: the draft's head is vLLM's quantized copy of the
    target's, which a direct update of the target's head leaves stale in vLLM; with the
    layer the whole draft (copy included) is what a fresh boot of the next step gives it."""
    spec = {"method": "mtp", "num_speculative_tokens": 1, "draft_lm_head_quantization": "fp8"}
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # the only runner with the copy
    runner = runner_of(deepseek, speculative_config=spec, dtype="bfloat16")
    fresh = runner_of(step2, speculative_config=spec, dtype="bfloat16")
    draft = runner.get_draft_model()
    expected = state(fresh.get_draft_model())
    assert f"{MTP}shared_head.head.weight" in differing_exactly(draft, expected)

    trainers.openrlhf(runner, checkpoint_tensors(step2))
    next_step(runner)

    assert differing_exactly(draft, expected) == []


def test_report_shows_each_direct_update_and_what_its_draft_took_or_kept(
    deepseek: Path,
    step2: Path,
    events: Events,
) -> None:
    runner = runner_of(deepseek)
    sent = checkpoint_tensors(step2)
    trainers.openrlhf(runner, sent)
    next_step(runner)
    trainers.verl(runner, [list({n: t for n, t in sent.items() if not n.startswith(MTP)}.items())])

    def report(*args: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "hybrid_draft", "report", str(events.path), *args],
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    (proc,) = json.loads(report("--json"))["processes"]
    rows = [
        (r["role"], r.get("calls"), r.get("ended_by"))
        for r in proc["loads"]
        if r["trigger"] == "direct_update"
    ]
    assert rows == [
        ("target", len(sent), "next_step"),
        ("draft", 16, "next_step"),
        ("target", 1, "process_weights_after_loading"),
    ]
    (kept,) = proc["not_reloaded"]
    assert (kept["trigger"], kept["reason"]) == ("direct_update", "no_draft_tensors")
    text = report()
    assert "target (direct update: ended by next_step)" in text
    assert "the draft took 16 tensors from 16 of its target's direct load_weights call(s)" in text
    assert "direct update: the draft kept its weights (no_draft_tensors)" in text


def test_a_vllm_whose_post_load_processing_has_another_shape_leaves_the_calls_to_vllm(
    deepseek: Path,
    step2: Path,
    events: Events,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ``direct_update`` part off (vLLM's ``process_weights_after_loading`` of another
    shape): said once with ``part_skipped``, and every call runs as vLLM's own."""
    import vllm.model_executor.model_loader.utils as utils

    from hybrid_draft.adapter import parts

    real = utils.process_weights_after_loading

    def reshaped(model: Any, *rest: Any) -> Any:
        return real(model, *rest)

    monkeypatch.setattr(utils, "process_weights_after_loading", reshaped)
    parts._LATE_SAID.pop("direct_update", None)
    runner = runner_of(deepseek)
    before = own_state(runner)

    trainers.openrlhf(runner, checkpoint_tensors(step2))
    next_step(runner)

    assert own_differing(runner, before) == []
    (skipped,) = [
        e for e in events.named("hybrid_draft.part_skipped") if e["part"] == "direct_update"
    ]
    assert "process_weights_after_loading is (model, *rest)" in skipped["reason"]
    assert [e for e in events.all() if e.get("trigger") == "direct_update"] == []
    parts._LATE_SAID.pop("direct_update", None)


# --- the staging of the draft's own layers: all or nothing ------------------------------


def _failing_on(module: Any, name: str, call: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``module.name`` raising on its ``call``-th call (counting from 1)."""
    real = getattr(module, name)
    count = [0]

    @functools.wraps(real)  # the shape vLLM's own has, as the layer's probe reads it
    def failing(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] == call:
            raise RuntimeError(f"{name} failed (call {call})")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)


@pytest.mark.parametrize(
    ("step", "call"),
    [
        ("initialize_layerwise_reload", 2),
        ("_place_kernel_tensors", 2),
        ("finalize", 1),
        ("finalize_part_way", 1),
    ],
    ids=[
        "staging part way",
        "a copy into the second layer",
        "vLLM's finalize",
        "vLLM's finalize after the attention's processing",
    ],
)
def test_a_failing_step_of_the_staging_leaves_the_draft_as_it_was(
    step: str,
    call: int,
    deepseek: Path,
    step2: Path,
    events: Events,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Putting the draft's layers into vLLM's layerwise reload fails part way; or copying
    the processed layers into their storage fails at the second of them; or vLLM's end of
    the reload fails: every draft layer holds the previous step's weights, and what vLLM
    derives from them, in the same tensors, and none waits in the reload."""
    import vllm.model_executor.model_loader.reload.layerwise as layerwise

    runner = runner_of(deepseek)
    draft = runner.get_draft_model()
    before, objects = own_state(runner), tensors_of(draft)
    failing: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if step == "finalize":
        for name in ("finalize_layerwise_reload", "finalize_layerwise_processing"):

            def broken(model: Any, model_config: Any) -> None:
                raise RuntimeError("finalize failed")

            monkeypatch.setattr(layerwise, name, broken)
    elif step == "finalize_part_way":  # vLLM's own finalize runs, derives MLA's W_UK_T and
        # W_UV from the new kv_b_proj in place, then fails
        failing = failing_commit(runner, "finalize")
    else:
        _failing_on(layerwise, step, call, monkeypatch)

    with failing:
        trainers.openrlhf(runner, checkpoint_tensors(step2))
        next_step(runner)

    assert tensors_of(draft) == objects
    assert own_differing(runner, before) == []
    assert not any(
        layerwise.LAYERWISE_INFO[m].can_load()
        for m in draft.modules()
        if m in layerwise.LAYERWISE_INFO
    )
    (failed,) = [e for e in events.named("hybrid_draft.load_failed") if e["role"] == "draft"]
    assert "failed" in failed["error"]


def test_a_dummy_batch_ends_the_update_before_the_drafts_forward(
    deepseek: Path, step2: Path, booted: Any, events: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle data-parallel rank runs a dummy batch (``execute_dummy_batch``: the runner's
    ``_dummy_run``, the drafter's own dummy run in it) and no ``execute_model``: the update
    ends before vLLM's dummy run begins, the draft whole again."""
    runner = runner_of(deepseek)
    served = vars(runner)["_hybrid_draft_direct"]
    seen: list[Any] = []
    real = type(runner)._dummy_run

    def dummy_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((served.update, differing(runner.get_draft_model(), state(booted.draft))))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(runner), "_dummy_run", dummy_run)
    trainers.openrlhf(runner, checkpoint_tensors(step2))
    assert served.update is not None

    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(runner.vllm_config), contextlib.suppress(Exception):
        runner._dummy_run(1)  # a load-only runner has no KV cache: vLLM's stops short

    assert seen == [(None, [])]
    (loaded,) = direct(events, LOADED, "draft")
    assert loaded["ended_by"] == "dummy_batch"


def test_an_invalid_setting_mid_training_never_fails_a_callers_call(
    deepseek: Path, step2: Path, booted: Any, events: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad value in a new worker's environment (or an edited config file): the caller's
    calls run as vLLM runs them (the target updated), the setting is reported once, and the
    draft keeps its weights with a ``load_failed`` naming it. Once the value is mended, the
    next update carries the draft again."""
    runner = runner_of(deepseek)
    before = own_state(runner)
    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", "fastest")

    trainers.openrlhf(runner, checkpoint_tensors(step2))
    next_step(runner)

    assert differing(runner.get_model(), state(booted.target)) == []
    assert own_differing(runner, before) == []
    (error,) = events.named("hybrid_draft.config_error")
    assert error["source"] == "INSTANTTENSOR_DRAFT_LOADER"
    failed = events.named("hybrid_draft.load_failed")
    assert [(e["role"], e["error_type"]) for e in failed] == [
        ("target", "ConfigError"),
        ("draft", "ConfigError"),
    ]
    assert "INSTANTTENSOR_DRAFT_LOADER" in failed[1]["error"]

    monkeypatch.delenv("INSTANTTENSOR_DRAFT_LOADER")
    trainers.openrlhf(runner, checkpoint_tensors(step2))
    next_step(runner)
    assert differing(runner.get_draft_model(), state(booted.draft)) == []


@pytest.fixture
def planless(deepseek: Path, tmp_path: Path) -> Path:
    """A copy of ``deepseek`` to boot from, whose MTP shard is gone once the runner has
    loaded: no update can plan the draft from it."""
    copy = tmp_path / "deepseek"
    shutil.copytree(deepseek, copy)
    return copy


def _without_its_mtp_shard(model_dir: Path) -> None:
    from hybrid_draft.core import checkpoint

    (mtp,) = [
        s.path
        for s in checkpoint.read_checkpoint(model_dir)
        if any(t.name.startswith(MTP) for t in s.tensors)
    ]
    Path(mtp).unlink()


@pytest.mark.parametrize("feed", ["whole", "lacking a tensor", "failing part way"])
def test_without_a_plan_the_callers_own_feed_of_the_draft_is_taken_whole_or_not_at_all(
    feed: str,
    planless: Path,
    step2: Path,
    booted: Any,
    events: Events,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The draft's plan cannot be made (its boot checkpoint's shard is gone): the target's
    calls carry nothing of it, and a caller that feeds the draft itself (NeMo RL's order) has
    its calls staged all the same. The draft takes them whole, where vLLM's own check finds
    every one of its parameters loaded, or keeps its weights whole, saying why; a feed that
    fails part way leaves nothing of it."""
    runner = runner_of(planless, "v1")
    if not has_drafter(runner):
        pytest.skip("this vLLM's runner has no drafter")
    _without_its_mtp_shard(planless)
    draft = runner.get_draft_model()
    before, objects = own_state(runner), tensors_of(draft)
    sent = checkpoint_tensors(step2)
    if feed == "lacking a tensor":
        del sent[f"{MTP}self_attn.kv_b_proj.weight"]
    if feed == "failing part way":
        cls = type(draft)
        real = cls.load_weights

        def half_then_failed(model: Any, weights: Any) -> Any:
            items = list(weights)
            monkeypatch.setattr(cls, "load_weights", real)
            real(model, items[: len(items) // 2])
            raise RuntimeError("the draft's load failed part way")

        monkeypatch.setattr(cls, "load_weights", half_then_failed)

    trainers.nemo_rl(runner, trainers.buckets(sent, *cuts(sent)))
    next_step(runner)

    assert tensors_of(draft) == objects
    (target,) = direct(events, DECISION, "target")
    one_pass = target["one_pass"]  # vLLM's own resolution of the shards refuses them
    assert one_pass["enabled"] is False and "missing" in one_pass["detail"], one_pass
    (decision,) = direct(events, DECISION, "draft")
    if feed == "whole":
        assert differing(draft, state(booted.draft)) == []
        assert (decision["action"], decision["reason"]) == ("switched", "direct_update")
        (loaded,) = direct(events, LOADED, "draft")
        assert loaded["draft_calls"] == 3
        return
    assert own_differing(runner, before) == []
    if feed == "lacking a tensor":
        assert (decision["action"], decision["reason"]) == ("kept", "incomplete_stream")
        assert "vLLM's check" in decision["detail"]
    else:
        (failed,) = [e for e in events.named("hybrid_draft.load_failed") if e["role"] == "draft"]
        assert failed["error"] == "the draft's load failed part way"
