"""One model load as one typed object (:class:`Load`), and its run (:func:`run`).

Every model load is one :func:`run`: resolve the call, read the settings once (the load's
snapshot: everything after follows it), decide (:func:`decide`: the policy, then the
target's one pass or the draft's plan and read, then the pipeline route), emit exactly one
``hybrid_draft.decision`` rendered from the :class:`Load`, load, then emit
``hybrid_draft.loaded``, or ``hybrid_draft.load_failed`` before the exception propagates
unchanged. The events' keys are the fields of ``hybrid_draft.records``' types.

A reload in place (``adapter.reload``: a model runner's ``reload_weights``) is a load like
any other, run here with its trigger (``policy.Reload``) as data: its events say
``trigger: "reload"``. A reload's draft whose decision reloads nothing (its reason one of
``policy.NOT_RELOADED``, or the layer could not decide it: vLLM reloads no draft) keeps
its weights: no load, no ``loaded`` event.

A trainer's weight-transfer session (``adapter.sessions``) spans several calls into the
worker, so the model it loads into is decided when it starts (:func:`begin`, which emits the
decision) and reported when it ends (:func:`end`); :func:`run` is the two around one call.
Its events say ``trigger: "weight_update"``. A trainer's direct ``load_weights`` calls on the
target (``adapter.direct``) span calls the same way: ``trigger: "direct_update"``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_draft import events, records, settings
from hybrid_draft.adapter import (
    calls,
    drafting,
    internals,
    loaders,
    loadscope,
    onepass,
    parts,
)
from hybrid_draft.core import checkpoint, draftread, figures, hold, objectstore, policy, watch
from hybrid_draft.events import Sink, emit
from hybrid_draft.records import ABSENT

if TYPE_CHECKING:
    from vllm.config import LoadConfig

SWITCH_MESSAGE = {
    policy.SAFETENSORS: "Hybrid draft loading: using lazy safetensors for speculative draft "
    "weights while preserving InstantTensor for the target model",
    policy.SELECTIVE_FORMAT: "Hybrid draft loading: streaming only the speculative draft's "
    "tensors with InstantTensor while preserving InstantTensor for "
    "the target model",
    policy.FASTSAFETENSORS: "Hybrid draft loading: reading only the speculative draft's "
    "tensors with fastsafetensors, as the target model loads",
    policy.RUNAI_STREAMER: "Hybrid draft loading: streaming only the speculative draft's "
    "tensors with the Run:ai Model Streamer, as the target model loads",
    policy.WEIGHTS_ITERATOR: "Hybrid draft loading: reloading the speculative draft's "
    "tensors from the weights iterator the target model reloaded from",
    policy.WEIGHT_TRANSFER: "Hybrid draft loading: updating the speculative draft with its "
    "tensors from the target model's weight-transfer session",
    policy.DIRECT_LOAD: "Hybrid draft loading: updating the speculative draft with its "
    "tensors from the direct load_weights calls on the target model",
}


@dataclass(frozen=True, kw_only=True)
class Load:
    """One model load: what was asked, the settings it was decided with, what was decided,
    and how it is read. Its two events are rendered from it (:meth:`decision_record`,
    :meth:`loaded_record`)."""

    #: The call as the policy sees it (None: the layer could not read the call).
    request: policy.Request | None
    #: The settings the load was decided with: its one snapshot (None: they are invalid).
    snapshot: settings.Settings | None
    where: records.Where
    #: The policy's decision as it stands after the plan's say (None: a layer fault).
    decision: policy.Decision | None = None
    #: A target's one pass.
    target: onepass.Tap | None = None
    #: A draft's plan, read and hold.
    draft: drafting.Draft | None = None
    #: A draft that keeps InstantTensor under pipeline parallelism.
    route: drafting.Route | None = None
    #: Why the layer could not decide (``reason: layer_error``), letting vLLM load as asked.
    fault: str | None = None
    #: What a reload in place reloads from (None: the model's first load).
    trigger: policy.Reload | None = None

    @property
    def sink(self) -> Sink:
        return self.snapshot.sink if self.snapshot is not None else settings.event_sink()

    @property
    def role(self) -> str | None:
        return self.request.role if self.request is not None else None

    @property
    def model(self) -> str | None:
        """The model as the user named it (``policy.Checkpoint.shown``)."""
        model = self.request.model if self.request is not None else None
        return model.shown if model is not None else None

    @property
    def load_config(self) -> LoadConfig | None:
        """The load config the load uses instead of the call's (None: the call's)."""
        if self.route is not None:
            return self.route.load_config
        return self.draft.load_config if self.draft is not None else None

    @property
    def load_format(self) -> str | None:
        if self.decision is not None and self.decision.switched:
            return self.decision.chosen_format
        return self.request.requested_format if self.request is not None else None

    @property
    def read(self) -> draftread.DraftRead | None:
        return self.draft.read if self.draft is not None else None

    @property
    def tap(self) -> hold.Hold | None:
        return self.target.hold if self.target is not None else None

    @property
    def occasion(self) -> dict[str, Any]:
        """The events' ``trigger`` and ``reload_source``, a session's ``backend`` and
        ``session``, or a direct update's ``weights_path`` and ``ended_by``."""
        trigger = self.trigger
        if trigger is None:
            return {"trigger": "load"}
        if trigger.source == "weight_update":
            return {
                "trigger": trigger.kind,
                "backend": trigger.backend or ABSENT,
                "session": trigger.session or ABSENT,
            }
        if trigger.source == "direct":
            return {
                "trigger": trigger.kind,
                "weights_path": trigger.weights_path or ABSENT,
                "ended_by": trigger.ended_by or ABSENT,
            }
        return {"trigger": trigger.kind, "reload_source": trigger.source}

    @property
    def reloads_nothing(self) -> bool:
        """A reload's draft that keeps its weights: its decision says so, or the layer could
        not decide it (vLLM itself reloads no draft)."""
        if self.trigger is None or self.role != "draft":
            return False
        return self.decision is None or self.decision.reason in policy.NOT_RELOADED

    def decision_record(self) -> records.Decision:
        """``hybrid_draft.decision``."""
        request, decision, current = self.request, self.decision, self.snapshot
        if decision is None or request is None or current is None:
            return records.Decision(
                role=self.role,
                mode=None,
                mode_source=None,
                method=None,
                requested_format=None,
                chosen_format=None,
                action="kept",
                reason="layer_error",
                detail=self.fault or "the layer could not decide this load",
                model=self.model,
                revision=None,
                where=self.where,
                **self.occasion,
            )
        model, target = request.model, request.target
        draft, route = self.draft, self.route
        selection: Mapping[str, int] = (
            draft.selection
            if draft is not None and not isinstance(draft.selection, records.Absent)
            else {}
        )
        return records.Decision(
            role=request.role,
            mode=str(current.mode.value),
            mode_source=current.mode.source,
            method=request.method,
            requested_format=decision.requested_format,
            chosen_format=decision.chosen_format,
            action=decision.action,
            reason=decision.reason,
            detail=decision.detail or ABSENT,
            fallback=decision.fallback or ABSENT,
            model=model.shown if model is not None else None,
            revision=model.revision if model is not None else None,
            target_model=target.shown if target is not None else ABSENT,
            target_revision=target.revision if target is not None else ABSENT,
            **self.occasion,
            one_pass=self.target.report if self.target is not None else ABSENT,
            pruning_rule=draft.pruning_rule if draft is not None else ABSENT,
            rule_error=draft.rule_error if draft is not None else ABSENT,
            settings_changed=draft.settings_changed if draft is not None else ABSENT,
            plan_error=draft.plan_error if draft is not None else ABSENT,
            warnings=draft.warnings if draft is not None else ABSENT,
            planned_shards=selection.get("planned_shards", ABSENT),
            planned_tensors=selection.get("planned_tensors", ABSENT),
            planned_bytes=selection.get("planned_bytes", ABSENT),
            tensor_filter=draft.read is not None if draft is not None else ABSENT,
            sources=draft.sources if draft is not None else ABSENT,
            sources_detail=draft.sources_detail if draft is not None else ABSENT,
            pipeline_parallel_size=route.pipeline_parallel_size if route else ABSENT,
            process_group=route.process_group if route else ABSENT,
            where=self.where,
        )

    def loaded_record(
        self,
        cost: records.Cost,
        exc: BaseException | None,
        failed_read: records.FailedRead | None = None,
        calls: tuple[int, float] | None = None,
        watched: Mapping[str, Any] | None = None,
    ) -> records.Loaded:
        """``hybrid_draft.loaded``, or ``load_failed`` for a load that raised ``exc``; the
        model of an update that spans calls (a session's chunks, a direct update's calls)
        with its ``calls`` (how many, and the seconds its loads took in them)."""
        read, tap = self.read, self.tap
        held: records.HoldFigures | records.Absent = ABSENT
        fed: int | records.Absent = ABSENT
        if tap is not None and not isinstance(tap, hold.Pass):
            held = tap.summary()
        if read is not None and read.hold is not None and not isinstance(read.hold, hold.Pass):
            held = read.hold.summary()
        scope = loadscope.current()
        step = scope.step if scope is not None else None
        carried = self.trigger is not None and self.trigger.carries
        if self.role == "draft" and carried and step is not None:  # what its step took
            calls, fed = (step.calls, step.seconds), step.fed
        count = calls[0] if calls is not None else ABSENT
        seconds = round(calls[1], 6) if calls is not None else ABSENT
        session = self.trigger is not None and self.trigger.source == "weight_update"
        direct = self.trigger is not None and self.trigger.source == "direct"
        return records.Loaded(
            role=self.role,
            model=self.model,
            load_format=self.load_format,
            tensor_filter=read is not None,
            **self.occasion,
            cost=cost,
            where=self.where,
            sources=read.sources if read is not None and read.sources else ABSENT,
            one_pass=held,
            chunks=count if session else ABSENT,
            chunk_seconds=seconds if session else ABSENT,
            calls=count if direct else ABSENT,
            call_seconds=seconds if direct else ABSENT,
            draft_calls=fed if direct else ABSENT,
            stalls=(watched or {}).get("stalls", ABSENT),
            longest_stall_seconds=(watched or {}).get("longest_stall_seconds", ABSENT),
            slowest=(watched or {}).get("slowest", ABSENT),
            reason="stalled" if isinstance(exc, watch.LoadStalled) else ABSENT,
            error_type=type(exc).__name__ if exc is not None else ABSENT,
            error=str(exc) if exc is not None else ABSENT,
            failed_read=failed_read or ABSENT,
        )


def read_settings() -> settings.Settings:
    """The load's one settings snapshot; an invalid setting is reported and stops it."""
    try:
        return settings.load()
    except settings.ConfigError as exc:
        emit(
            "hybrid_draft.config_error",
            "error",
            sink=settings.event_sink(),
            source=exc.source,
            detail=exc.detail,
        )
        raise


def decide(call: calls.Call, request: policy.Request, current: settings.Settings) -> Load:
    """Decide one load with its settings snapshot."""
    decision = policy.decide(
        request,
        str(current.mode.value),
        loaders.handled_formats(current),
        loaders.unfiltered(current),
        reload_setting=str(current.reload.value),
    )
    scope = loadscope.current()
    target = draft = None
    if request.role == "target":
        try:
            target = onepass.tap(call, current, scope)
        except Exception as exc:  # no one pass then; the target loads as asked
            target = onepass.Tap(
                None,
                records.OnePass(
                    enabled=False, reason="layer_error", detail=f"{type(exc).__name__}: {exc}"
                ),
            )
    else:
        draft = drafting.draft(
            call, request, decision, current, scope, parts.part_off("draft_loaders")
        )
        decision = draft.decision
    fmt = decision.chosen_format if decision.switched else request.requested_format
    load_config = draft.load_config if draft is not None else None
    return Load(
        request=request,
        snapshot=current,
        where=where_of(current),
        decision=decision,
        target=target,
        draft=draft,
        route=drafting.route(
            call, request.role, fmt, load_config, parts.part_off("ungrouped_draft")
        ),
        trigger=request.trigger,
    )


# --- where a load happens ---------------------------------------------------------------
# Every decision and loaded/load_failed event carries one records.Where, made once per load,
# so that ``hybrid-draft report`` can tell the ranks of one server apart and say which
# decided differently. The rank is read from what is already initialised (vLLM's world
# group, else torch.distributed); nothing is initialised or imported for it: a process
# outside a distributed group has rank null. The load's settings are passed in.


def node() -> str:
    """This host's name."""
    return settings.this_node()


def rank() -> int | None:
    """This process's global rank, or None outside an initialised distributed group."""
    value = internals.world_rank()
    if value is not None:
        return value
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # a half-torn-down group: no rank rather than no event
        pass
    return None


def where_of(current: settings.Settings | None) -> records.Where:
    """This process's place, with the load's settings (None: they are invalid)."""
    return records.Where(
        node=node(),
        rank=rank(),
        settings_fingerprint=current.fingerprint() if current is not None else None,
        settings_from=(
            current.carried_from
            if current is not None and current.carried_from is not None
            else records.ABSENT
        ),
    )


@functools.cache
def unready() -> str | None:
    """Why the layer cannot decide loads in this process (None: it can), found at its first
    load: the hook left the parts' installation (the probe of vLLM's private names, the load
    figures) and structlog's import to it. A layer that cannot work says so once, with
    ``hybrid_draft.patch_skipped``, and leaves every load of the process to vLLM."""
    why = events.unavailable()
    if why is None:
        try:
            parts.installed()
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
    if why is not None:
        emit(
            "hybrid_draft.patch_skipped",
            "warning",
            sink=settings.process_sink(),
            vllm_version=internals.vllm_version(),
            reason=f"the layer cannot work in this process ({why}): its loads are vLLM's own",
        )
    return why


@dataclass
class Active:
    """One load between its decision and its outcome: what was decided, and its figures so
    far (the model of an update that spans calls: ``calls`` and ``call_seconds``, a
    session's chunks or a direct update's ``load_weights`` calls, as the update counts
    them)."""

    load: Load
    cost: figures.LoadStats
    calls: int = 0
    call_seconds: float = 0.0
    #: The load as the watcher sees it (None: its settings are invalid).
    watched: watch.Watched | None = None


def begin(resolve: Callable[[], calls.Call], trigger: policy.Reload | None = None) -> Active | None:
    """Decide one load and emit its decision (None: the layer cannot work in this process,
    :func:`unready`). An invalid setting is reported (``config_error``, ``load_failed``) and
    raised: it stops the load. The process's first load installs the layer's parts first,
    outside the load's figures."""
    if unready() is not None:
        return None
    cost = figures.LoadStats()
    with figures.measuring(cost):
        request: policy.Request | None = None
        fault: BaseException | None = None
        try:
            call = resolve()
            request = call.request()
        except Exception as exc:
            fault = exc
        try:
            current = read_settings()
        except settings.ConfigError as exc:
            failed = Load(request=request, snapshot=None, where=where_of(None), trigger=trigger)
            _finish(failed, cost, exc)
            raise  # an invalid setting stops the load
        try:
            if fault is not None:
                raise fault
            assert request is not None
            load = decide(call, request, current)
        except Exception as exc:
            # A fault of the layer's own must not fail a load vLLM would have done:
            # report it and let vLLM load exactly as asked.
            load = Load(
                request=request,
                snapshot=current,
                where=where_of(current),
                fault=f"{type(exc).__name__}: {exc}",
                trigger=trigger,
            )
            emit(
                "hybrid_draft.decision",
                "error",
                sink=load.sink,
                **records.render(load.decision_record()),
            )
        else:
            _emit_decision(load)
    tap = load.tap
    cost.observe = tap.offer if tap is not None else None
    return Active(load, cost, watched=_watch(load, cost, call if fault is None else None))


#: The load formats whose library reads in C++ (InstantTensor, fastsafetensors, the Run:ai
#: Model Streamer): a stop lands in the loading thread only when the library's call returns.
_RUNAI = (
    "the Run:ai Model Streamer waits in its C++ library (runai_response) until its client "
    "answers or gives up: a stop would land only then, so none is made"
)
_INSTANTTENSOR = (
    "InstantTensor reads in its C++ library: a stop would land only once its read returned, "
    "so none is made"
)
_FASTSAFETENSORS = (
    "fastsafetensors reads in its C++ library: a stop would land only once its read returned, "
    "so none is made"
)
_LIBRARY_READS = {
    policy.RUNAI_STREAMER: _RUNAI,
    policy.RUNAI_FILTERED: _RUNAI,
    policy.INSTANTTENSOR: _INSTANTTENSOR,
    policy.SELECTIVE: _INSTANTTENSOR,
    policy.UNGROUPED: _INSTANTTENSOR,
    policy.FASTSAFETENSORS: _FASTSAFETENSORS,
    policy.FASTSAFETENSORS_FILTERED: _FASTSAFETENSORS,
}


def _watch(load: Load, cost: figures.LoadStats, call: calls.Call | None) -> watch.Watched | None:
    """The load, watched while it runs (``core/watch.py``): a load that spans calls (a
    session's, a direct update's) only inside them."""
    current = load.snapshot
    if current is None:
        return None
    trigger = load.trigger
    read = load.read
    tap = load.tap
    # The checkpoint's tensors this rank's target load is given: with expert parallelism,
    # vLLM's loader skips the other ranks' experts (its own filter), counted once, when the
    # watcher first asks.
    skip = _expert_skip(call) if tap is not None and call is not None else None

    @functools.cache
    def checkpoint_tensors() -> int | None:
        return rank_tensors(tap.plan.shards, skip) if tap is not None else None

    def planned() -> tuple[int | None, int | None]:
        """The bytes and tensors the load will take, where known now."""
        sources = load.draft.sources if load.draft is not None else records.ABSENT
        if read is not None and not isinstance(sources, records.Absent):
            taken = [sources.get(k, {}) for k in ("storage", "stream")]
            return sum(s.get("bytes", 0) for s in taken), sum(s.get("tensors", 0) for s in taken)
        if trigger is not None and trigger.carries:
            return None, None  # the caller's tensors, whatever they are
        sizes = [cost.resolved[f] for f in cost.resolved if f not in cost.dropped]
        return (None if not sizes or None in sizes else sum(s or 0 for s in sizes)), (
            checkpoint_tensors()
        )

    if trigger is not None:
        note: str | None = (
            "a reload or an update of weights already served is not stopped part way: the "
            "model would be left part one step's"
        )
    else:
        note = _LIBRARY_READS.get(str(load.load_format))
    timeout = current.load_timeout.value
    return watch.start(
        watch.Watched(
            role=load.role,
            model=load.model,
            load_format=load.load_format,
            trigger=str(load.occasion["trigger"]),
            cost=cost,
            sink=load.sink,
            progress=float(current.progress_seconds.value),
            stall=float(current.stall_seconds.value),
            timeout=float(timeout) if timeout is not None else None,
            access=objectstore.Access.of(current),
            planned=planned,
            stop_note=note,
            stoppable=note is None,
            spans_calls=trigger is not None and trigger.carries,
        )
    )


def rank_tensors(shards: Iterable[checkpoint.Shard], skip: Callable[[str], bool] | None) -> int:
    """The tensors of ``shards`` a load on this rank is given: all but those ``skip`` says
    another rank's (vLLM's expert-parallel filter)."""
    names = (t.name for s in shards for t in s.tensors)
    return sum(1 for n in names if skip is None or not skip(n))


def _expert_skip(call: calls.Call) -> Callable[[str], bool] | None:
    """Whether the target's load on this rank skips a name (another rank's expert), by
    vLLM's own filter (None: it cannot be asked here; every tensor counts)."""
    try:
        return internals.local_expert_filter(
            calls.lazy_load_config(call.load_config), call.model_config
        )
    except Exception:  # a figure of a progress event, never a load's failure
        return None


def end(active: Active, exc: BaseException | None) -> None:
    """Emit what a load decided by :func:`begin` cost: ``loaded``, or ``load_failed`` for a
    load that raised ``exc`` (a target's hold checked first, :func:`_settle`). The watch of
    the load ends first: nothing it asked of the load's thread lands after this."""
    watched = active.watched
    late: watch.LoadStalled | None = None
    if watched is not None:
        try:
            watch.stop(watched)
        except watch.LoadStalled as landed:  # just before the stop could take it back
            late = landed
    failure = exc if exc is not None else late
    if failure is None:
        _settle(active.load)
    trigger = active.load.trigger
    calls = (active.calls, active.call_seconds) if trigger is not None and trigger.carries else None
    _finish(active.load, active.cost, failure, calls, watched.figures() if watched else None)
    if exc is None and late is not None:
        raise late  # the load failed as its event says


def unread(trigger: policy.Reload | None) -> Load:
    """A load whose settings are invalid: nothing decided."""
    return Load(request=None, snapshot=None, where=where_of(None), trigger=trigger)


def refused(
    resolve: Callable[[], calls.Call],
    trigger: policy.Reload | None,
    exc: settings.ConfigError,
) -> None:
    """A load that an invalid setting refused, reported as :func:`begin` reports one (its
    ``load_failed``) without being raised: the draft of an update whose calls ran as the
    caller's own."""
    request: policy.Request | None
    try:
        request = resolve().request()
    except Exception:  # the load is still reported, without what could not be read
        request = None
    failed = Load(request=request, snapshot=None, where=where_of(None), trigger=trigger)
    _finish(failed, figures.LoadStats(), exc)


def run(
    resolve: Callable[[], calls.Call],
    proceed: Callable[[LoadConfig | None], Any],
    trigger: policy.Reload | None = None,
) -> Any:
    """One load (a reload in place with its ``trigger``): decide, emit the decision,
    load, emit what it cost."""
    active = begin(resolve, trigger)
    if active is None:
        return proceed(None)
    load = active.load
    if load.reloads_nothing:
        if active.watched is not None:
            watch.stop(active.watched)
        return None
    try:
        with figures.measuring(active.cost), draftread.reading(load.read):
            if load.draft is not None and load.draft.failure is not None:
                raise load.draft.failure  # its plan's reads were refused: failed once, here
            model = proceed(load.load_config)
            if active.watched is not None:  # a stop asked of this thread lands here or never
                watch.stop(active.watched)
    except BaseException as exc:
        end(active, exc)
        raise
    end(active, None)
    return model


def _settle(load: Load) -> None:
    """A target whose stream filled a hold: what it held is checked against the versions
    the draft's plan read, now that the stream is done (``hold.Hold.settle``)."""
    tap = load.tap
    if tap is None:
        return
    try:
        tap.settle()
    except Exception as fault:  # the draft then checks again, before it takes anything
        layer_error("the one-pass hold's version check", fault, load.sink)


def _emit_decision(load: Load) -> None:
    decision = load.decision
    # A draft left with weights that no longer match its target's: a warning (unless the
    # user turned the reload off).
    stale = load.reloads_nothing and decision is not None and decision.reason != "reload_off"
    emit(
        "hybrid_draft.decision",
        "warning" if stale else "info",
        sink=load.sink,
        **records.render(load.decision_record()),
    )
    if decision is not None and decision.switched:
        from vllm.logger import init_logger

        init_logger("vllm.hybrid_draft").info(SWITCH_MESSAGE[decision.chosen_format])


def _finish(
    load: Load,
    cost: figures.LoadStats,
    exc: BaseException | None,
    calls: tuple[int, float] | None = None,
    watched: Mapping[str, Any] | None = None,
) -> None:
    """``hybrid_draft.loaded``, or ``load_failed`` for a load that raised; a fault here is
    reported as ``hybrid_draft.layer_error``, never raised over the load's own outcome."""
    try:
        record = load.loaded_record(
            cost.cost(), exc, _failed_read(load, cost, exc), calls, watched or {}
        )
        if exc is None:
            emit("hybrid_draft.loaded", sink=load.sink, **records.render(record))
        else:
            emit("hybrid_draft.load_failed", "error", sink=load.sink, **records.render(record))
    except Exception as fault:
        layer_error("the load's event", fault, load.sink)
    finally:
        tap = load.tap
        if tap is not None and exc is not None:
            tap.release("the target's load failed")
        scope = loadscope.current()
        if load.role == "draft" and scope is not None:
            scope.release("the draft's load ended" if exc is None else "the draft's load failed")


def _failed_read(
    load: Load, cost: figures.LoadStats, exc: BaseException | None
) -> records.FailedRead | None:
    """For a load that failed in its loader's words (an error of the layer's own names its
    file already), the shard the layer finds refused when it asks again, and why."""
    if not isinstance(exc, Exception) or isinstance(
        exc, (checkpoint.CheckpointError, watch.LoadStalled)
    ):
        return None  # it names its shard already
    opened = [f for f in cost.resolved if f not in cost.dropped]
    return objectstore.failed_read(opened, objectstore.Access.of(load.snapshot))


def layer_error(what: str, exc: BaseException, sink: Sink) -> None:
    """Report a fault of the layer's own that it worked around (never raises)."""
    with contextlib.suppress(Exception):
        emit(
            "hybrid_draft.layer_error",
            "error",
            sink=sink,
            where=what,
            error_type=type(exc).__name__,
            error=str(exc),
        )
