"""The target's side of one pass: whether its stream (InstantTensor, fastsafetensors or the
Run:ai Model Streamer) keeps the draft's tensors, and which (:func:`tap`).

Served loads and ``hybrid-draft bench``'s ``one_pass`` strategy both call :func:`tap` on
real vLLM configs, so the bench holds what a served load holds: the draft's plan, less
the tensors vLLM replaces and other ranks' experts (:func:`expert_filter`, vLLM's own
code), within the budget :func:`budget` sets (``hold_budget``, capped by the memory the
target leaves free).

A reload in place taps its stream the same way: vLLM's loader of the target's format when
the target reloads from a checkpoint, or the weights iterator it was given (any format;
each held tensor a copy: the iterator's buffers are its producer's). A trainer's
weight-transfer session taps each chunk the target's ``load_weights`` is given, keeping
nothing (``hold.Pass``: the draft's tensors are handed on to the draft's own load while the
chunk is still the engine's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybrid_draft import records, settings
from hybrid_draft.adapter import calls, draftplan, internals, loaders, loadscope, parts
from hybrid_draft.core import checkpoint, figures, hold, objectstore, policy

if TYPE_CHECKING:
    from vllm.config import ModelConfig


#: The target formats whose stream the tap sees, and the parts that must be on for it:
#: ``DefaultModelLoader`` streams InstantTensor and fastsafetensors, vLLM's
#: ``RunaiModelStreamerLoader`` the Run:ai Model Streamer.
_STREAMED = {
    policy.INSTANTTENSOR: ("one_pass", "draft_loaders"),
    policy.FASTSAFETENSORS: ("one_pass", "draft_loaders"),
    policy.RUNAI_STREAMER: ("one_pass", "draft_loaders", "runai_stream"),
}


@dataclass(frozen=True)
class Tap:
    """A target load's one-pass plan: the hold its stream fills (None: no one pass) and the
    decision's ``one_pass`` saying why."""

    hold: hold.Hold | None
    report: records.OnePass


def _off(reason: str, detail: str | None = None) -> Tap:
    return Tap(None, records.OnePass(enabled=False, reason=reason, detail=detail or records.ABSENT))


def tap(call: calls.Call, current: settings.Settings, scope: loadscope.Scope | None) -> Tap:
    """The target's one pass, or why there is none; the hold joins ``scope``."""
    session = call.trigger is not None and call.trigger.carries  # a session, a direct update
    setting = int(current.hold_budget.value)
    if setting <= 0 and not session:  # a session's pass holds nothing: no budget to spend
        return _off("hold_budget_zero")
    requested = call.request().requested_format
    stream = call.reloads_from("iterator")
    if session:  # its own part was asked before it began (adapter/sessions.py, direct.py)
        needed: tuple[str, ...] = ()
    elif stream:  # the reload's weights iterator, whatever the target's format
        needed = ("one_pass",)
    elif requested not in _STREAMED or requested not in loaders.handled_formats(current):
        if requested in loaders.unfiltered(current):
            return _off("no_tensor_filter", f"the installed {requested} cannot filter by name")
        return _off("not_instanttensor")
    else:
        needed = _STREAMED[requested]
    for part in needed:
        why = parts.part_off(part)
        if why is not None:
            return _off("part_skipped", f"{part}: {why}")
    if scope is None:
        return _off("no_load_scope", "the target was not loaded by a model runner's load_model")
    spec = call.speculative_config
    draft_config = getattr(spec, "draft_model_config", None)
    if draft_config is None or draft_config is getattr(spec, "target_model_config", None):
        return _off("no_draft_model")
    if not internals.pp_group().is_last_rank:
        return _off("not_last_pp_rank", "the draft is built on the last pipeline stage only")
    draft_call = calls.Call.resolve(
        call.vllm_config,
        draft_config,
        internals.draft_load_config(call.vllm_config),
        call.trigger,
    )
    draft_request = draft_call.request()
    draft_decision = policy.decide(
        draft_request,
        str(current.mode.value),
        loaders.handled_formats(current),
        reload_setting=str(current.reload.value),
    )
    if not draft_decision.switched or not draft_request.reads_target_checkpoint:
        return _off("draft_not_switched", f"the draft's decision: {draft_decision.reason}")
    try:
        # An update's figures are the trainer's calls: the plan's header reads are not. An
        # update that carries the draft takes only names from its plan: the plan of the same
        # checkpoint its scope's owner made for an earlier update serves again.
        plan = scope.planned if session else None
        if plan is None:
            with figures.measuring() if session else contextlib.nullcontext():
                plan = draftplan.for_call(
                    draft_call,
                    draft_call.skips_replaced(bool(current.skip_replaced.value)),
                    objectstore.Access.of(current),
                    parts.part_off("runai_stream"),
                )
    except checkpoint.CheckpointError as exc:  # the draft's own decision plans again
        return _off("planning_failed", f"{type(exc).__name__}: {exc}")
    if plan is None or plan.is_unused is None or not plan.kept:
        return _off("no_plan", "the draft has no checkpoint-weight rule or keeps nothing")
    skip = expert_filter(draft_call)
    made: hold.Hold
    if not session:
        # A reload's target is resident already: what is free now is what the hold may share.
        tp = max(1, call.vllm_config.parallel_config.tensor_parallel_size)
        target_bytes = 0 if call.trigger is not None else plan.all_bytes // tp
        limit = budget(setting, stream_device(call, requested), target_bytes)
        made = hold.Hold.of(plan, draft_config, limit, skip, current, copy=stream)
    else:
        made = hold.Pass.passing(plan, draft_config, skip, current)
    scope.holds.append(made)
    return Tap(made, made.report())


def stream_device(call: calls.Call, requested: str) -> object:
    """Where the target's stream puts its tensors, whose memory the hold takes: vLLM's
    Run:ai iterator streams onto the host unless its streaming is distributed; a reload's
    weights iterator is held on the target's device."""
    iterator = call.reloads_from("iterator")
    if requested == policy.RUNAI_STREAMER and not iterator:
        extra = call.load_config.model_loader_extra_config
        if not (isinstance(extra, dict) and extra.get("distributed") is True):
            return "cpu"
    return draftplan.device_of(call)


def budget(setting: int, device: object, target_bytes: int) -> int:
    """Bytes one hold may take: the setting, capped at a quarter of what ``target_bytes``
    (the target's share of the checkpoint, still to load) leave free on ``device``."""
    return hold.effective_budget(setting, hold.free_memory(device), target_bytes)


def expert_filter(draft_call: calls.Call) -> Callable[[str], bool]:
    """Whether the draft's load on this rank skips a name (another rank's expert), by the
    very vLLM code its loader will run."""
    config: ModelConfig = draft_call.model_config
    return internals.local_expert_filter(calls.lazy_load_config(draft_call.load_config), config)
