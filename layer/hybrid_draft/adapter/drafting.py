"""A draft load's decision: the policy's answer, checked against the draft's plan, and how
the draft is read (:func:`draft`).

The policy (``hybrid_draft.core.policy``) says whether a draft switches format; here that is
checked against what can really be done for this draft on this vLLM (its checkpoint-weight
rule, its plan, the parts switched off), and the outcome is one frozen :class:`Draft`:
the decision as it stands, the load config the draft loads with, the read the layer's
loaders follow, and the draft's keys of the decision event. Nothing here emits an event.

Under pipeline parallelism a draft's load also gets its route (:func:`route`): only the last
stage loads the draft, so its load must never wait on a collective that the other stages do
not join.

vLLM builds the drafter only where ``get_pp_group().is_last_rank`` (both model runners),
so with a pipeline-parallel size above 1 the draft's ``get_model`` runs on part of the
world. vLLM 0.33's ``instanttensor_weights_iterator`` reads with ``process_group=`` the
world group's device group whenever the world has more than one rank, and InstantTensor
then all-reduces and all-gathers over that group: the draft's load would wait for ranks
that never call it. vLLM guards ``fastsafetensors`` that way
(``get_pp_safe_draft_load_config``, model runner v2 only), not InstantTensor.

What each mode's draft does with PP > 1:

- lazy safetensors (``auto`` and ``selective`` on the target's checkpoint, ``safetensors``,
  every selective fallback) and the filtered loader: no collective at all;
- ``instanttensor_selective`` (``selective``): InstantTensor with ``process_group=None``;
- InstantTensor kept (``instanttensor``; ``auto``/``selective`` for a draft with a checkpoint
  of its own): :func:`route` sends it to the ``instanttensor_ungrouped`` loader, vLLM's
  InstantTensor read with ``process_group=None``; each rank of the last stage reads it.

The target is loaded by every rank, so its grouped read is left as vLLM makes it.

A reload's draft (``adapter.reload``) is decided here too, by the same steps: its plan is
the checkpoint the target reloads from (what vLLM replaces always left out: the target's
own parameters, which its reload restored), read as at its first load; from a reload's
weights iterator it takes only what the target's stream held for it, all of it or nothing
(a tensor the stream lacked, or one over the hold budget, would leave part of a layer as it
was). A reload with none of the draft's tensors to give keeps the draft's weights, saying
why (:func:`reload_check`). A trainer's weight-transfer session is checked the same way at
its end, against what its chunks passed on to the draft (``hold.Pass``): every one of the
draft's tensors, or the draft keeps its weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybrid_draft import records, settings
from hybrid_draft.adapter import calls, internals, loadscope, parts
from hybrid_draft.core import draftread, hold, objectstore, policy, update
from hybrid_draft.core.planning import DraftPlan
from hybrid_draft.records import ABSENT, Opt

if TYPE_CHECKING:
    from vllm.config import LoadConfig, VllmConfig


#: The decisions of a draft that takes its tensors from its target's update as they pass
#: (a weight-transfer session's, a trainer's direct ``load_weights`` calls).
CARRIED_REASONS = ("weight_update", "direct_update")


@dataclass(frozen=True, kw_only=True)
class Draft:
    """One draft load as decided."""

    decision: policy.Decision
    #: The draft's replacement load config; None keeps the call's.
    load_config: LoadConfig | None
    #: The draft read by this layer's loaders (its plan, hold and sources); None: vLLM's
    #: own path reads it.
    read: draftread.DraftRead | None
    pruning_rule: str | None
    rule_error: Opt[str] = ABSENT
    settings_changed: Opt[records.SettingsChanged] = ABSENT
    plan_error: Opt[str] = ABSENT
    warnings: Opt[list[dict[str, str]] | None] = ABSENT
    selection: Opt[Mapping[str, int]] = ABSENT
    #: Where the plan takes the draft's tensors from (a draft read by its plan).
    sources: Opt[records.Sources] = ABSENT
    #: Why a source of ``sources`` is empty.
    sources_detail: Opt[Mapping[str, str]] = ABSENT
    #: The object store's refusal of the plan's own reads: the load fails with it, once,
    #: rather than asking the same store again by vLLM's own path.
    failure: objectstore.ObjectStoreError | None = None


@dataclass(frozen=True)
class Held:
    """What the target's load left for this draft: the hold, the plan it holds, and how
    the draft's own settings differ from the ones they were made with."""

    hold: hold.Hold | None = None
    plan: DraftPlan | None = None
    changed: tuple[str, ...] = ()
    target_settings_fingerprint: str | None = None
    replanned: bool = False
    released: bool = False

    def report(self, reads_by_plan: bool) -> Opt[records.SettingsChanged]:
        if not self.changed or self.target_settings_fingerprint is None:
            return ABSENT
        stream = "released" if self.released else ("taken" if reads_by_plan else "unused")
        return records.SettingsChanged(
            target_settings_fingerprint=self.target_settings_fingerprint,
            changed=self.changed,
            plan="replanned" if self.replanned else "held",
            stream=stream,
        )


def held(call: calls.Call, current: settings.Settings, scope: loadscope.Scope | None) -> Held:
    """The hold the target's load made for this draft and the plan it holds, as far as the
    draft's own settings allow them: settings that changed between the two loads (a config
    file replaced) are followed, never the target's. A changed ``skip_replaced`` makes the
    held plan another draft's: the draft plans anew. A changed ``hold_budget`` sized the
    hold by other settings: it is released and the draft reads from storage."""
    found = scope.hold_for(call.model_config) if scope is not None else None
    if found is None:
        return Held()
    found.sink = current.sink  # the draft's from here on
    if isinstance(found, hold.Pass):  # a session's: nothing held, no budget spent
        return Held(found, found.plan)
    changed = tuple(
        name
        for name in settings.DECISION_SETTINGS
        if getattr(found.settings, name).value != getattr(current, name).value
    )
    if not changed:
        return Held(found, found.plan)
    replanned = "skip_replaced" in changed
    released = "hold_budget" in changed
    if released:
        found.release(
            "the settings changed between the target's load and the draft's (hold_budget): "
            "the draft reads from storage"
        )
    return Held(
        hold=None if released else found,
        plan=None if replanned else found.plan,
        changed=changed,
        target_settings_fingerprint=found.settings.fingerprint(),
        replanned=replanned,
        released=released,
    )


def draft(
    call: calls.Call,
    request: policy.Request,
    decision: policy.Decision,
    current: settings.Settings,
    scope: loadscope.Scope | None,
    loaders_off: str | None,
) -> Draft:
    """Decide a draft's load: its plan, whether the layer's loaders read it, its config.
    ``loaders_off`` says why the ``draft_loaders`` part is off (None: it is on)."""
    from hybrid_draft.adapter import draftplan, rules

    rule_error: Opt[str] = ABSENT
    try:
        pruning_rule: str | None = rules.install(draftplan.draft_class(call.model_config))
    except Exception as exc:  # vLLM's own load will report a class it cannot resolve
        pruning_rule, rule_error = None, f"{type(exc).__name__}: {exc}"
    same = request.reads_target_checkpoint
    skips = call.skips_replaced(bool(current.skip_replaced.value))
    found = held(call, current, scope)
    plan = found.plan if same or decision.switched else None
    plan_error: Opt[str] = ABSENT
    unsupported: str | None = None
    failure: objectstore.ObjectStoreError | None = None
    access = objectstore.Access.of(current)
    if (
        plan is None
        and (same or decision.switched)
        and decision.reason not in (*policy.NOT_RELOADED, "draft_session")
    ):
        try:
            plan = draftplan.for_call(
                call,
                skips,
                access,
                parts.part_off("runai_stream"),
            )
        except internals.Unsupported as exc:  # a part is off, said with part_skipped
            plan, unsupported = None, str(exc)
        except objectstore.ObjectStoreError as exc:  # vLLM's path would ask the same store
            plan_error = f"{type(exc).__name__}: {exc}"
            failure = exc if decision.switched else None
        except Exception as exc:  # reported, and the draft loads on vLLM's own lazy path
            plan_error = f"{type(exc).__name__}: {exc}"
    warnings: Opt[list[dict[str, str]] | None] = ABSENT
    if same:  # null when planning failed or could not run: unknown, not "nothing to say"
        unknown = bool(plan_error) or loaders_off is not None
        warnings = plan.warnings() if plan is not None else (None if unknown else [])
    selection: Opt[Mapping[str, int]] = ABSENT
    if decision.reason == "selective":
        blocker: tuple[str, str] | None
        if plan is not None:
            blocker = plan.selective_blocker
        elif loaders_off is not None:
            blocker = ("part_skipped", loaders_off)
        else:
            why = plan_error if isinstance(plan_error, str) else "no safetensors shards to plan"
            blocker = ("planning_failed", why)
        if blocker:
            decision = policy.fall_back(decision, *blocker)
        else:
            assert plan is not None
            selection = plan.selection().summary()
    ours = plan is not None and plan.is_unused is not None and loaders_off is None
    if request.trigger is not None and decision.reason not in policy.NOT_RELOADED:
        decision = reload_check(decision, plan if same else None, found.hold, ours, call)
    load_config: LoadConfig | None = None
    reads = False
    if decision.reason in ("reload_stream", *CARRIED_REASONS):
        # From the hold (or what an update passed on) alone: no loader, no storage. A carried
        # draft without a plan took the caller's own feed: nothing read by a plan.
        reads = plan is not None
    elif decision.switched and failure is None:
        family = decision.chosen_format not in (policy.SAFETENSORS, policy.SELECTIVE_FORMAT)
        if not ours and family:  # a fastsafetensors or Run:ai draft: its target's loader
            failed = plan_error if isinstance(plan_error, str) else None
            decision = policy.unplanned(
                decision, loaders_off or failed or unsupported or "the draft has no plan to load by"
            )
        elif not ours:  # vLLM's own lazy path (a selective draft too: its loader is ours)
            load_config = calls.lazy_load_config(call.load_config)
            if decision.chosen_format != policy.SAFETENSORS:
                decision = policy.fall_back(
                    decision,
                    "part_skipped" if loaders_off is not None else "planning_failed",
                    loaders_off or "the draft has no plan to load by",
                )
        else:
            fmt = policy.FILTERED_BY_FAMILY.get(decision.chosen_format, decision.chosen_format)
            load_config = calls.loader_load_config(call.load_config, fmt)
            reads = True
    elif request.requested_format in (*policy.FILTERED_BY_FAMILY.values(), policy.SELECTIVE):
        # The user's own draft_load_config names one of ours; a plan-less draft is read
        # by vLLM's own lazy path.
        reads = ours
    read = None
    if reads:
        assert plan is not None  # (its load format was registered when get_model was wrapped)
        read = draftread.DraftRead(
            plan=plan,
            hold=found.hold,
            sink=current.sink,
            pipeline_parallel_size=call.vllm_config.parallel_config.pipeline_parallel_size,
            method=request.method,
            access=access,
        )
    sources: Opt[records.Sources] = ABSENT
    step = scope.step if scope is not None else None
    if read is not None and isinstance(found.hold, hold.Pass) and step is not None:
        sources = passed_sources(read.plan, step)
    elif read is not None:
        sources = read.plan.sources(set(found.hold.tensors) if found.hold is not None else ())
    skip_off = None
    if request.method == "mtp" and skips:
        skip_off = parts.part_off("skip_replaced")  # said once, with part_skipped
    return Draft(
        decision=decision,
        load_config=load_config,
        read=read,
        pruning_rule=pruning_rule,
        rule_error=rule_error,
        settings_changed=found.report(read is not None),
        plan_error=plan_error,
        warnings=warnings,
        selection=selection,
        sources=sources,
        sources_detail=(
            empty_sources(sources, found, scope, request, skips, skip_off)
            if not isinstance(sources, records.Absent)
            else ABSENT
        ),
        failure=failure,
    )


def empty_sources(
    sources: records.Sources,
    found: Held,
    scope: loadscope.Scope | None,
    request: policy.Request,
    skips: bool,
    skip_off: str | None,
) -> Opt[Mapping[str, str]]:
    """Why the draft takes nothing from the target's stream, or skips nothing that vLLM
    replaces, where that is so (absent: it takes from both)."""
    out = {}
    if not sources.get("stream", {}).get("tensors"):
        if found.released:
            why = "released: the settings changed between the target's load and the draft's"
        elif found.hold is not None and found.hold.changed:
            why = "object_changed: " + next(iter(found.hold.changed.values()))
        elif found.hold is not None:
            why = "hold_empty: the target's stream kept none of this draft's tensors"
        elif scope is None:
            why = "no_load_scope: the draft was not loaded inside a model runner's load_model"
        elif (off := parts.part_off("one_pass") or parts.part_off("draft_loaders")) is not None:
            why = f"part_skipped: {off}"
        else:
            why = "no_hold: the target's load kept no stream for this draft (its one_pass)"
        out["stream"] = why
    if not sources.get("replaced_by_target", {}).get("tensors"):
        if not skips:
            why = "skip_replaced_off: the skip_replaced setting is off"
        elif request.method != "mtp":
            why = f"not_mtp: vLLM replaces nothing in a {request.method} draft"
        elif skip_off is not None:
            why = f"part_skipped: {skip_off}"
        else:
            why = (
                "kept_by_draft: vLLM replaces none of this draft's tensors (its class keeps "
                "its own embedding and head, or the pipeline has several stages)"
            )
        out["replaced_by_target"] = why
    return out or ABSENT


def passed_sources(plan: DraftPlan, step: update.Step) -> dict[str, dict[str, int]]:
    """A carried draft's ``sources``: what its target's update passed on in the step
    (``stream``), what was read from storage where that lacked some (``storage``), and what
    vLLM shares with the target (the target's update loaded it)."""
    sources = plan.sources()
    sources["storage"] = {"tensors": step.read_tensors, "bytes": step.read_bytes}
    sources["stream"] = {
        "tensors": len(step.taken) - step.read_tensors,
        "bytes": step.bytes - step.read_bytes,
    }
    return sources


def reload_check(
    decision: policy.Decision,
    plan: DraftPlan | None,
    held: hold.Hold | None,
    ours: bool,
    call: calls.Call,
) -> policy.Decision:
    """A reload's draft decision against what the reload gives the draft: a same-checkpoint
    draft (``plan``) whose checkpoint holds none of its own tensors, or a stream (a weights
    iterator within the hold budget, a weight-transfer session) that did not carry every one
    of them, keeps its weights."""
    if decision.reason == "draft_session":
        return decision  # vLLM's own: it loads what the trainer sends
    if decision.reason in CARRIED_REASONS:
        return session_check(decision, loadscope.current())
    if decision.reason == "reload_stream":
        if not ours or held is None:
            why = (
                "the draft has no plan to take its tensors from the stream by"
                if not ours
                else "the target's reload held nothing of the stream for it (the target "
                "decision's one_pass says why)"
            )
            return policy.not_reloaded(
                decision, "incomplete_stream", f"{why}: the draft keeps its weights"
            )
        over = sorted(held.needed - held.wanted)
        lacking = sorted(held.wanted - set(held.tensors))
        if over or lacking:
            parts_ = []
            if lacking:
                parts_.append(
                    f"the weights iterator lacked {len(lacking)}: {update.names(lacking)}"
                )
            if over:
                parts_.append(f"{len(over)} did not fit the hold budget ({held.budget} bytes)")
            return policy.not_reloaded(
                decision,
                "incomplete_stream",
                f"of the draft's {len(held.needed)} tensors, {'; '.join(parts_)}: the draft "
                "keeps its weights",
            )
        return decision
    if plan is not None and plan.is_unused is not None and not plan.reads():
        return policy.not_reloaded(
            decision,
            "no_draft_tensors",
            f"the checkpoint at {call.model_config.model} holds none of the draft's own "
            "tensors: the draft keeps its weights",
        )
    return decision


def session_check(decision: policy.Decision, scope: loadscope.Scope | None) -> policy.Decision:
    """A carried draft's load at its step's end (a weight-transfer session's, a direct
    update's): what the step decided (``update.Step.end``). A kept step keeps the draft's
    weights, saying why; a committed or failed one loads (a failed one fails, saying why)."""
    step = scope.step if scope is not None else None
    outcome = step.outcome if step is not None else None
    if outcome is None:
        return policy.not_reloaded(
            decision, "incomplete_stream", "the update has no step: the draft keeps its weights"
        )
    if outcome.state is update.State.KEPT:
        assert outcome.reason is not None and outcome.detail is not None
        return policy.not_reloaded(decision, outcome.reason, outcome.detail)
    return decision


# --- under pipeline parallelism ----------------------------------------------------------


def pipeline_size(vllm_config: VllmConfig) -> int:
    """The server's pipeline-parallel size: the largest of the call's parallel config, the
    target's (a standalone draft's config says 1) and vLLM's PP group, when initialised."""
    spec = getattr(vllm_config, "speculative_config", None)
    sizes = (
        getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", None),
        getattr(getattr(spec, "target_parallel_config", None), "pipeline_parallel_size", None),
        internals.pp_world_size(),
    )
    return max((s for s in sizes if isinstance(s, int) and not isinstance(s, bool)), default=1)


@dataclasses.dataclass(frozen=True)
class Route:
    """A draft that keeps InstantTensor under PP > 1: how it is read (the decision's
    ``pipeline_parallel_size`` and ``process_group``)."""

    pipeline_parallel_size: int
    process_group: str
    #: The draft's load config from here (None: the call's own, vLLM's grouped read).
    load_config: LoadConfig | None


def route(
    call: calls.Call,
    role: str,
    load_format: str | None,
    load_config: LoadConfig | None,
    ungrouped_off: str | None,
) -> Route | None:
    """With PP > 1, a draft that keeps InstantTensor loads without vLLM's world group
    (None: nothing to route). ``ungrouped_off`` says why the ``ungrouped_draft`` part is
    off (None: it is on), in which case vLLM's grouped read is kept."""
    if role != "draft" or load_format != policy.INSTANTTENSOR:
        return None
    size = pipeline_size(call.vllm_config)
    if size <= 1:
        return None
    if ungrouped_off is not None:  # this vLLM's loader is not one the read knows
        return Route(size, f"vLLM's own (part_skipped: {ungrouped_off})", load_config)
    base = load_config if load_config is not None else call.load_config
    return Route(size, "none", dataclasses.replace(base, load_format=policy.UNGROUPED))
