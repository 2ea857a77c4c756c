"""The draft follows a trainer's weight-transfer session: vLLM's own worker sessions.

Real vLLM on the CPU: the CPU model runner of each route this release has (0.33's V1
runner, model runner v2's), built and loaded as vLLM's CPU worker does it
(``conftest.model_runner``), inside vLLM's real ``Worker`` (built by its own ``__init__``),
whose real ``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` and
``finish_weight_update`` (and ``start_draft_weight_update``) run each session over a backend
registered with vLLM's ``WeightTransferEngineFactory``
(``tests/e2e/standin/hybrid_draft_e2e_transfer.py``: vLLM's own IPC engine, the chunk's
tensors read from a file the test writes instead of CUDA IPC handles). After a session the
draft must hold exactly what a fresh boot of the checkpoint the trainer sent gives it, its
weights and what vLLM derives from them after loading (MLA's ``W_UK_T``, ``W_UV``), in
the same storage; or, where the session cannot give it all of its tensors, exactly what it
held before, in the same tensors.
"""

from __future__ import annotations

import json
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
    params,
    storage,
)

pytestmark = pytest.mark.vllm

STANDIN = Path(__file__).resolve().parent / "e2e" / "standin"
if str(STANDIN) not in sys.path:
    sys.path.insert(0, str(STANDIN))

import hybrid_draft_e2e_transfer as transfer  # noqa: E402

DECISION, LOADED = "hybrid_draft.decision", "hybrid_draft.loaded"
MTP = "model.layers.2."  # the tiny DeepSeek-V3's MTP layer (2 decoder layers)


@pytest.fixture(scope="module")
def booted(step2: Path, vllm_runtime: Any) -> Any:
    """The target and draft as vLLM loads them from ``step2`` at a first load."""
    return load_target_and_draft(engine_config(step2, load_format="safetensors"))


def state(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model``: its weights and what vLLM derived from them."""
    out = params(model)
    out.update({f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()})
    return out


def differing(model: Any, expected: dict[str, torch.Tensor]) -> list[str]:
    now = state(model)
    return sorted(n for n, v in expected.items() if not torch.equal(now[n], v))


def own_state(runner: Any) -> dict[str, torch.Tensor]:
    """The draft's own weights and what vLLM derived from them: not what vLLM shares with
    the target (the target's session updates those, with the target): its parameters, and
    the buffers of its modules (vLLM caches one rotary embedding for every layer of a
    shape, the target's and the draft's)."""
    target = runner.get_model()
    theirs = {id(p) for p in target.parameters()}
    draft = runner.get_draft_model()
    shared = {n for n, p in draft.named_parameters() if id(p) in theirs}
    modules = set(target.modules())
    shared |= {
        f"buffer:{name}.{b}" if name else f"buffer:{b}"
        for name, module in draft.named_modules()
        if module in modules
        for b in module._buffers
    }
    return {n: t for n, t in state(draft).items() if n not in shared}


def own_differing(runner: Any, expected: dict[str, torch.Tensor]) -> list[str]:
    now = own_state(runner)
    return sorted(n for n, v in now.items() if not torch.equal(v, expected[n]))


def tensors_of(model: Any) -> dict[str, torch.Tensor]:
    """The very parameter objects of ``model`` (CUDA graphs were captured on them)."""
    return dict(model.named_parameters())


def own_tensors(runner: Any) -> dict[str, torch.Tensor]:
    """The draft's own parameter objects: not those vLLM shares with the target, which the
    target's session updates as it goes."""
    theirs = {id(p) for p in runner.get_model().parameters()}
    return {n: p for n, p in tensors_of(runner.get_draft_model()).items() if id(p) not in theirs}


class Trainer:
    """The trainer's side: vLLM's worker with a session backend, chunks written as files."""

    def __init__(self, runner: Any, work: Path, **init_info: bool) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory
        from vllm.v1.worker.gpu_worker import Worker

        config = runner.vllm_config
        self.worker = Worker(config, 0, 0, "tcp://127.0.0.1:1", is_driver_worker=True)
        self.worker.model_runner = runner
        self.worker.device = torch.device("cpu")
        with set_current_vllm_config(config):  # as Worker.load_model makes it
            self.worker.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
                config.weight_transfer_config, config, self.worker.device, runner.get_model()
            )
        self.worker.init_weight_transfer_engine(dict(init_info))
        self.work = work
        self.sent = 0

    def start(self, draft: bool = False) -> None:
        (self.worker.start_draft_weight_update if draft else self.worker.start_weight_update)()

    def send(self, chunk: dict[str, torch.Tensor]) -> None:
        self.sent += 1
        path = self.work / f"chunk-{self.sent}.safetensors"
        try:
            self.worker.update_weights(transfer.write_chunk(str(path), chunk))
        finally:
            path.unlink(missing_ok=True)

    def session(self, chunks: list[dict[str, torch.Tensor]], draft: bool = False) -> None:
        self.start(draft)
        for chunk in chunks:
            self.send(chunk)
        self.worker.finish_weight_update()


@pytest.fixture
def backend(vllm_runtime: Any) -> str:
    transfer.register()
    return transfer.NAME


@pytest.fixture
def runner(deepseek: Path, backend: str, instanttensor_standin: Recorder) -> Any:
    """Model runner v2 of ``deepseek``, loaded, with the tests' session backend."""
    return runner_for(deepseek, backend)


def runner_for(model_dir: Path, backend: str, route: str = "v2", **engine_args: Any) -> Any:
    """The runner of ``route`` for ``model_dir`` (further ``engine_args`` to vLLM's
    ``EngineArgs``), with the session ``backend``."""
    from vllm.config import WeightTransferConfig

    transfer_config = WeightTransferConfig(backend=backend)
    return model_runner(
        engine_config(model_dir, weight_transfer_config=transfer_config, **engine_args), route
    )


def sessions(events: Events, event: str, role: str) -> list[dict[str, Any]]:
    return [
        e for e in events.named(event) if e.get("trigger") == "weight_update" and e["role"] == role
    ]


def split(tensors: dict[str, torch.Tensor], *after: str) -> list[dict[str, torch.Tensor]]:
    """``tensors`` in checkpoint order, cut into chunks right after each name of ``after``."""
    chunks: list[dict[str, torch.Tensor]] = [{}]
    for name, tensor in tensors.items():
        chunks[-1][name] = tensor
        if name in after:
            chunks.append({})
    return [c for c in chunks if c]


@pytest.mark.parametrize("route", ["v1", "v2"])
def test_a_target_session_carrying_the_mtp_layer_updates_the_draft(
    route: str,
    deepseek: Path,
    step2: Path,
    booted: Any,
    backend: str,
    events: Events,
    tmp_path: Path,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
) -> None:
    """A trainer's export of the whole model (MTP layer included) in one chunk: the draft
    is the next step's, as a fresh boot of it has it, and nothing was read for it."""
    runner = runner_for(deepseek, backend, route)
    draft = runner.get_draft_model()
    where = storage(draft)
    assert differing(draft, state(booted.draft))
    own = draft_tensors(step2, draft)
    passes, reads = len(instanttensor_standin.calls), len(filtered_reads.calls)
    sent = checkpoint_tensors(step2)

    Trainer(runner, tmp_path).session([sent])

    assert differing(draft, state(booted.draft)) == []
    assert differing(runner.get_model(), state(booted.target)) == []
    assert storage(draft) == where
    assert (len(instanttensor_standin.calls), len(filtered_reads.calls)) == (passes, reads)
    (target,) = sessions(events, DECISION, "target")
    assert (target["backend"], target["session"], target["reason"]) == (
        backend,
        "target",
        "target_model",
    )
    assert target["one_pass"] == {
        "enabled": True,
        "draft_tensors": len(own),
        "draft_bytes": sum(own.values()),
    }
    (target_loaded,) = sessions(events, LOADED, "target")
    assert (target_loaded["chunks"], target_loaded["tensors"]) == (1, len(sent))
    (decision,) = sessions(events, DECISION, "draft")
    assert (decision["action"], decision["reason"], decision["chosen_format"]) == (
        "switched",
        "weight_update",
        "weight_transfer",
    )
    (loaded,) = sessions(events, LOADED, "draft")
    replaced = draft_tensors(step2, draft, replaced=True)
    assert len(replaced) == 3  # the embedding, both heads
    assert loaded["sources"] == {
        "storage": {"tensors": 0, "bytes": 0},
        "stream": {"tensors": len(own), "bytes": sum(own.values())},
        "replaced_by_target": {"tensors": len(replaced), "bytes": sum(replaced.values())},
    }
    assert (loaded["chunks"], loaded["tensors"], loaded["bytes_read"]) == (1, len(own), 0)


def _one_shard_per_chunk(model_dir: Path) -> list[dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return [load_file(shard) for shard in sorted(model_dir.glob("*.safetensors"))]


def _mtp_split_at_a_fused_layer(model_dir: Path) -> list[dict[str, torch.Tensor]]:
    """The MTP layer across two chunks, cut between ``q_a_proj`` and ``kv_a_proj_with_mqa``,
    which vLLM fuses into one layer (``fused_qkv_a_proj``), and between ``gate_proj`` and
    ``up_proj`` (``gate_up_proj``)."""
    return split(
        checkpoint_tensors(model_dir),
        f"{MTP}self_attn.q_a_proj.weight",
        f"{MTP}mlp.gate_proj.weight",
    )


def _decoder_layer_per_chunk(model_dir: Path) -> list[dict[str, torch.Tensor]]:
    """vLLM's own grouping of a model's tensors per decoder layer (``layerwise_groups``),
    one group per chunk: the sharded backends' unit of transfer."""
    from vllm.distributed.weight_transfer.base import layerwise_groups

    tensors = checkpoint_tensors(model_dir)
    return [{n: tensors[n] for n in group} for group in layerwise_groups(list(tensors))]


@pytest.mark.parametrize(
    ("chunking", "refill"),
    [
        (_one_shard_per_chunk, False),
        (_mtp_split_at_a_fused_layer, False),
        (_decoder_layer_per_chunk, True),
    ],
    ids=["one shard per chunk", "MTP layer split inside a fused layer", "layers, refilled"],
)
def test_whatever_the_chunking_the_draft_is_the_next_steps(
    chunking: Any,
    refill: bool,
    runner: Any,
    step2: Path,
    booted: Any,
    events: Events,
    tmp_path: Path,
) -> None:
    """Chunks may split the MTP layer anywhere; with each chunk's memory refilled once its
    ``update_weights`` returns (chunks of whole layers, which the target copes with too), the
    draft still takes exactly its own tensors."""
    draft = runner.get_draft_model()
    chunks = chunking(step2)

    Trainer(runner, tmp_path, refill=refill).session(chunks)

    assert differing(draft, state(booted.draft)) == []
    assert differing(runner.get_model(), state(booted.target)) == []
    (loaded,) = sessions(events, LOADED, "draft")
    carrying = [c for c in chunks if any(n.startswith(MTP) for n in c)]
    assert loaded["chunks"] == len(carrying)


def test_a_session_whose_shared_tensors_come_after_the_mtp_layer_updates_both(
    runner: Any, step2: Path, booted: Any, events: Events, tmp_path: Path
) -> None:
    """The MTP layer in the first chunk, the embedding and the head (vLLM shares them with
    the draft) in the last: the draft's staging, begun at the first chunk, leaves the
    target's own reload of those modules alone, and both models are the next step's."""
    every = checkpoint_tensors(step2)
    shared = {
        n: t for n, t in every.items() if n.endswith(("embed_tokens.weight", "lm_head.weight"))
    }
    assert shared
    rest = {n: t for n, t in every.items() if n not in shared}
    from hybrid_draft.adapter import internals

    target = runner.get_model()
    embedding = target.get_submodule("model.embed_tokens")
    trainer = Trainer(runner, tmp_path)
    trainer.start()
    trainer.send(rest)
    # The draft's staging began with that chunk: the embedding still waits in the target's
    # own reload for its tensor (vLLM processes it there once it comes).
    assert internals.in_layerwise_reload(embedding)
    trainer.send(shared)
    trainer.worker.finish_weight_update()

    assert differing(runner.get_model(), state(booted.target)) == []
    assert differing(runner.get_draft_model(), state(booted.draft)) == []
    (loaded,) = sessions(events, LOADED, "draft")
    assert loaded["chunks"] == 1


def test_a_session_that_sends_a_step_again_ends_the_drafts_step_and_takes_the_next(
    runner: Any, step2: Path, step3: Path, events: Events, tmp_path: Path
) -> None:
    """One session bringing one step's whole model, then the next's (a trainer that resends
    without a finish between): the draft's step ends where the first tensor comes again
    (taken whole), the next takes the rest, and at the finish the draft is the later step's,
    as its fresh boot gives it, while the session stays one target load."""
    later = load_target_and_draft(engine_config(step3, load_format="safetensors"))
    draft = runner.get_draft_model()
    assert differing(draft, state(later.draft))

    Trainer(runner, tmp_path).session([checkpoint_tensors(step2), checkpoint_tensors(step3)])

    assert differing(draft, state(later.draft)) == []
    assert differing(runner.get_model(), state(later.target)) == []
    assert len(sessions(events, LOADED, "draft")) == 2
    assert len(sessions(events, LOADED, "target")) == 1


def test_with_a_quantized_copy_of_the_targets_head_the_draft_is_the_next_steps(
    deepseek: Path,
    step2: Path,
    backend: str,
    events: Events,
    tmp_path: Path,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``draft_lm_head_quantization``: the draft's head is vLLM's quantized copy of the
    target's, which vLLM re-derives when a target session ends; the draft's own tensors come
    from the session, and the whole draft (copy included) is what a fresh boot of the next
    step gives it."""
    spec = {"method": "mtp", "num_speculative_tokens": 1, "draft_lm_head_quantization": "fp8"}
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # the only runner with the copy
    runner = runner_for(deepseek, backend, speculative_config=spec, dtype="bfloat16")
    fresh = runner_for(step2, backend, speculative_config=spec, dtype="bfloat16")
    draft, head = runner.get_draft_model(), runner.get_draft_model().lm_head
    assert head is not runner.get_model().lm_head and head.weight.dtype == torch.float8_e4m3fn
    expected = state(fresh.get_draft_model())
    copy = {f"{MTP}shared_head.head.weight", f"{MTP}shared_head.head.weight_scale"}
    assert copy < set(differing_exactly(draft, expected))  # the copy, the draft's own and more

    # vLLM's Worker refuses model runner v2 without Triton, as the CPU worker never does.
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    Trainer(runner, tmp_path).session([checkpoint_tensors(step2)])

    assert differing_exactly(draft, expected) == []
    assert draft.lm_head is head
    (loaded,) = sessions(events, LOADED, "draft")
    assert loaded["tensors"] == len(draft_tensors(step2, draft))


def differing_exactly(model: Any, expected: dict[str, torch.Tensor]) -> list[str]:
    """``differing``, float8 tensors (which have no ``torch.equal``) by their exact float32
    values."""

    def exact(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.element_size() == 1 and t.is_floating_point() else t

    now = state(model)
    return sorted(n for n, v in expected.items() if not torch.equal(exact(now[n]), exact(v)))


def test_until_the_session_ends_the_draft_is_as_it_was_and_a_failed_session_leaves_it(
    runner: Any,
    step2: Path,
    events: Events,
    tmp_path: Path,
) -> None:
    """All or nothing: with the whole MTP layer received, the draft's own tensors still
    hold the previous step until ``finish_weight_update``; a session that fails after that
    (a chunk the engine cannot receive) leaves them as they were, the draft's tensors the
    very same objects."""
    draft = runner.get_draft_model()
    before, objects, own = own_state(runner), tensors_of(draft), own_tensors(runner)
    trainer = Trainer(runner, tmp_path)
    trainer.start()
    trainer.send(checkpoint_tensors(step2))
    assert own and all(torch.equal(own[n], before[n]) for n in own)

    with pytest.raises(Exception, match="No such file"):
        trainer.worker.update_weights({"path": str(tmp_path / "lost.safetensors")})

    assert tensors_of(draft) == objects
    assert own_differing(runner, before) == []
    assert sessions(events, LOADED, "draft") == []
    (failed,) = [e for e in events.named("hybrid_draft.load_failed") if e["role"] == "target"]
    assert (failed["trigger"], failed["chunks"]) == ("weight_update", 1)
    (kept,) = sessions(events, DECISION, "draft")
    assert (kept["action"], kept["reason"], kept["level"]) == ("kept", "target_failed", "warning")


@pytest.mark.parametrize(
    "which",
    ["placing", "finalize"],
    ids=["placing the second layer", "finalize after the attention"],
)
def test_a_session_whose_commit_fails_leaves_the_draft_whole(
    which: str,
    runner: Any,
    step2: Path,
    events: Events,
    tmp_path: Path,
) -> None:
    """The session brought the whole MTP layer; then vLLM fails part way through the
    draft's commit: placing the second processed layer into its storage, or its finalize
    after it derived MLA's W_UK_T and W_UV from the new kv_b_proj in place. Every draft
    layer holds the previous step, in the same tensors, and the draft's ``load_failed`` says
    why; the target's session has ended ``loaded``."""
    draft = runner.get_draft_model()
    before, objects = own_state(runner), tensors_of(draft)
    trainer = Trainer(runner, tmp_path)
    trainer.start()
    trainer.send(checkpoint_tensors(step2))

    with failing_commit(runner, which):
        trainer.worker.finish_weight_update()

    assert tensors_of(draft) == objects
    assert own_differing(runner, before) == []
    (loaded,) = sessions(events, LOADED, "target")
    (failed,) = sessions(events, "hybrid_draft.load_failed", "draft")
    assert "failed" in failed["error"] and loaded["tensors"] > 0


@pytest.mark.parametrize("lacking", ["the MTP layer", "its kv_b_proj"])
def test_a_session_without_all_of_the_drafts_tensors_keeps_the_draft(
    lacking: str,
    runner: Any,
    step2: Path,
    events: Events,
    tmp_path: Path,
) -> None:
    """A trainer that exports the base model alone, or part of the MTP layer: the target is
    updated, the draft keeps its weights (never part one step's), and a warning names what
    the session lacked."""
    draft = runner.get_draft_model()
    before, objects = own_state(runner), tensors_of(draft)
    missing = f"{MTP}self_attn.kv_b_proj.weight"
    sent = {
        n: t
        for n, t in checkpoint_tensors(step2).items()
        if not (n.startswith(MTP) if lacking == "the MTP layer" else n == missing)
    }

    Trainer(runner, tmp_path).session([sent])

    assert tensors_of(draft) == objects
    assert own_differing(runner, before) == []
    (decision,) = sessions(events, DECISION, "draft")
    assert (decision["action"], decision["level"]) == ("kept", "warning")
    if lacking == "the MTP layer":
        assert decision["reason"] == "no_draft_tensors"
        assert "brought none of the draft's 16 tensors" in decision["detail"]
    else:
        assert decision["reason"] == "incomplete_stream"
        assert f"it lacked 1: {missing}: the draft keeps its weights" in decision["detail"]
    assert sessions(events, LOADED, "draft") == []


def test_vllms_own_draft_session_is_left_as_vllm_runs_it(
    runner: Any,
    step2: Path,
    booted: Any,
    events: Events,
    tmp_path: Path,
) -> None:
    """After a target session that carried the draft, vLLM's draft session with what a
    trainer's draft export sends (the MTP block, the embedding, the head) loads as vLLM
    loads it (into the modules it shares with the target too: the MTP layer's own copy of
    the head, which here is not the target's, becomes the target's head), and is
    reported."""
    trainer = Trainer(runner, tmp_path)
    everything = checkpoint_tensors(step2)
    trainer.session([everything])
    export = {
        n: t
        for n, t in everything.items()
        if n.startswith(MTP) or n in ("model.embed_tokens.weight", "lm_head.weight")
    }

    trainer.session([export], draft=True)

    assert own_differing(runner, state(booted.draft)) == []
    first, second = sessions(events, DECISION, "draft")
    assert (first["session"], first["reason"]) == ("target", "weight_update")
    assert (second["session"], second["action"], second["reason"]) == (
        "draft",
        "kept",
        "draft_session",
    )
    assert len(sessions(events, DECISION, "target")) == 1  # the draft session's is the draft's
    loads = sessions(events, LOADED, "draft")
    assert [(e["session"], e["chunks"]) for e in loads] == [("target", 1), ("draft", 1)]
    assert loads[1]["tensors"] == len(export)


def test_with_the_reload_off_the_session_is_vllms_own(
    runner: Any,
    step2: Path,
    booted: Any,
    events: Events,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What vLLM does without the layer: the target is updated, the draft keeps the previous
    step, and the layer only reports it (the model's load_weights not even seen)."""
    monkeypatch.setenv("HYBRID_DRAFT_RELOAD", "off")
    before = own_state(runner)

    Trainer(runner, tmp_path).session([checkpoint_tensors(step2)])

    assert differing(runner.get_model(), state(booted.target)) == []
    assert own_differing(runner, before) == []
    (decision,) = sessions(events, DECISION, "draft")
    assert (decision["reason"], decision["level"]) == ("reload_off", "info")
    (target,) = sessions(events, LOADED, "target")
    assert target["tensors"] is None  # nothing of vLLM's call was wrapped
    assert sessions(events, LOADED, "draft") == []


def test_an_engine_that_patches_in_place_leaves_the_draft_saying_why(
    runner: Any,
    events: Events,
    tmp_path: Path,
) -> None:
    """A session in kernel format (the engine copies into the target's parameters, as
    ``sparse_nccl`` does): nothing in it is the draft's."""
    before = own_state(runner)
    target = runner.get_model()
    name, param = next(iter(target.named_parameters()))

    Trainer(runner, tmp_path, in_place=True).session([{name: torch.ones_like(param)}])

    assert bool((param == 1).all())
    assert own_differing(runner, before) == []
    (decision,) = sessions(events, DECISION, "draft")
    assert (decision["reason"], decision["level"]) == ("kernel_format", "warning")
    assert "patches the target's parameters in place" in decision["detail"]


def test_a_chunk_the_draft_cannot_take_fails_the_drafts_update_alone(
    runner: Any,
    step2: Path,
    booted: Any,
    events: Events,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The draft's own load of a chunk fails: the session (the target's) completes, the
    draft keeps its weights, and its update is ``load_failed`` saying why."""
    draft = runner.get_draft_model()
    before = own_state(runner)

    def broken(weights: Any) -> None:
        raise RuntimeError("the draft cannot take this chunk")

    monkeypatch.setattr(draft, "load_weights", broken)

    Trainer(runner, tmp_path).session([checkpoint_tensors(step2)])

    assert differing(runner.get_model(), state(booted.target)) == []
    assert own_differing(runner, before) == []
    (failed,) = [e for e in events.named("hybrid_draft.load_failed") if e["role"] == "draft"]
    assert (failed["trigger"], failed["error"]) == (
        "weight_update",
        "the draft cannot take this chunk",
    )


def test_report_shows_each_session_and_what_its_draft_took_or_kept(
    runner: Any,
    step2: Path,
    backend: str,
    events: Events,
    tmp_path: Path,
) -> None:
    trainer = Trainer(runner, tmp_path)
    everything = checkpoint_tensors(step2)
    trainer.session([everything])
    trainer.session([{n: t for n, t in everything.items() if not n.startswith(MTP)}])

    summary = json.loads(
        subprocess.run(
            [sys.executable, "-m", "hybrid_draft", "report", str(events.path), "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    (proc,) = summary["processes"]
    rows = [
        (r["role"], r["trigger"], r.get("backend"), r.get("session"), r.get("chunks"))
        for r in proc["loads"]
        if r["trigger"] == "weight_update"
    ]
    assert rows == [
        ("target", "weight_update", backend, "target", 1),
        ("draft", "weight_update", backend, "target", 1),
        ("target", "weight_update", backend, "target", 1),
    ]
    (kept,) = proc["not_reloaded"]
    assert (kept["trigger"], kept["backend"], kept["reason"]) == (
        "weight_update",
        backend,
        "no_draft_tensors",
    )
    text = subprocess.run(
        [sys.executable, "-m", "hybrid_draft", "report", str(events.path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"target (weight update: {backend}, target session)" in text
    assert "the draft took 16 tensors" in text and "from 1 chunk(s) of its target's session" in text
    assert f"weight update ({backend}): the draft kept its weights (no_draft_tensors)" in text


def test_a_vllm_whose_layerwise_reload_has_another_shape_leaves_the_session_to_vllm(
    runner: Any,
    step2: Path,
    events: Events,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's step that copies a processed layer into its storage, in another shape (vLLM's
    own calls still fit): the ``weight_update`` part is off, said once with
    ``part_skipped``, and the session runs as vLLM's own, unreported."""
    import vllm.model_executor.model_loader.reload.layerwise as layerwise

    from hybrid_draft.adapter import parts

    real = layerwise._copy_and_restore_kernel_tensors

    def reshaped(layer: Any, *rest: Any) -> Any:
        return real(layer, *rest)

    monkeypatch.setattr(layerwise, "_copy_and_restore_kernel_tensors", reshaped)
    parts._LATE_SAID.pop("weight_update", None)
    before = own_state(runner)

    trainer = Trainer(runner, tmp_path)
    trainer.session([checkpoint_tensors(step2)])
    trainer.session([checkpoint_tensors(step2)])

    assert own_differing(runner, before) == []
    (skipped,) = [
        e for e in events.named("hybrid_draft.part_skipped") if e["part"] == "weight_update"
    ]
    assert "_copy_and_restore_kernel_tensors is (layer, *rest)" in skipped["reason"]
    assert [e for e in events.all() if e.get("trigger") == "weight_update"] == []
    parts._LATE_SAID.pop("weight_update", None)


def test_an_invalid_setting_stops_the_session_before_vllm_begins_it(
    runner: Any,
    events: Events,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybrid_draft.settings import ConfigError

    trainer = Trainer(runner, tmp_path)
    monkeypatch.setenv("HYBRID_DRAFT_RELOAD", "sometimes")

    with pytest.raises(ConfigError, match="HYBRID_DRAFT_RELOAD: 'sometimes'"):
        trainer.start()

    assert trainer.worker._weight_update_active is False
    (error,) = events.named("hybrid_draft.config_error")
    assert error["source"] == "HYBRID_DRAFT_RELOAD"
    assert sessions(events, DECISION, "target") == []  # vLLM began no session
    monkeypatch.delenv("HYBRID_DRAFT_RELOAD")

    trainer.session([{}])  # the next session runs, and the layer sees it

    assert trainer.worker._weight_update_active is False
    (target,) = sessions(events, LOADED, "target")
    assert (target["chunks"], target["tensors"]) == (1, 0)


def test_with_vllms_direct_reload_of_the_target_the_draft_is_updated_all_the_same(
    deepseek: Path,
    step2: Path,
    booted: Any,
    backend: str,
    events: Events,
    tmp_path: Path,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.34's ``VLLM_RELOAD_MODE=direct`` (set for the whole process, from the first
    load) writes the target's chunks straight into its storage, with no layerwise reload and
    no rollback; the draft's update is still vLLM's layerwise reload of the draft's own
    layers, taken whole at the session's end."""
    import vllm.envs as envs

    if not hasattr(envs, "VLLM_RELOAD_MODE"):
        pytest.skip("this vLLM has no direct reload (VLLM_RELOAD_MODE)")
    monkeypatch.setenv("VLLM_RELOAD_MODE", "direct")
    runner = runner_for(deepseek, backend)

    Trainer(runner, tmp_path).session([checkpoint_tensors(step2)])

    assert differing(runner.get_model(), state(booted.target)) == []
    assert differing(runner.get_draft_model(), state(booted.draft)) == []
    (decision,) = sessions(events, DECISION, "draft")
    assert decision["reason"] == "weight_update"
