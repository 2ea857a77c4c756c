"""The wrap of vLLM's model loading: policy in, load config out, one event per decision.

:func:`on_model_loader` runs right after vLLM's model-loader package executes (the
bootstrap's post-import hook). If ``get_model`` has a shape this layer understands it is
replaced by a wrapper with the same signature and metadata; otherwise nothing is touched
and a ``hybrid_draft.patch_skipped`` event says why. Then :func:`installed` takes
``internals``' probe of every private vLLM name the layer's parts rely on: a part whose
names are missing or of another shape is switched off with a ``hybrid_draft.part_skipped``
event naming them (and the shapes found), and its drafts load on vLLM's own path.

Every model load is one :func:`run`: read the settings, ask the policy, emit exactly one
``hybrid_draft.decision``, load (the draft with its switched load config, the target as
asked), then say what it cost: ``hybrid_draft.loaded``, or ``hybrid_draft.load_failed``
before the exception propagates unchanged. Loads arrive through ``get_model`` (vLLM's
proposers, the CPU runner) or straight through a loader's ``load_model`` (vLLM's GPU
runners load the target that way); both are wrapped and both come here, once per load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from types import ModuleType
from typing import Any

from hybrid_draft import __version__, policy, settings
from hybrid_draft.adapter import calls, hold, internals, pipeline, stats, where
from hybrid_draft.adapter.internals import MODULE, TARGET, shape_problem, vllm_version
from hybrid_draft.events import emit
from hybrid_draft.planning import DraftPlan

_WRAPPED = "__hybrid_draft_wrapped__"
#: The keys every hybrid_draft.decision event carries (null where a call leaves one unknown).
DECISION_FIELDS = (
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
)

SWITCH_MESSAGE = {
    policy.SAFETENSORS: "Hybrid draft loading: using lazy safetensors for speculative draft "
    "weights while preserving InstantTensor for the target model",
    policy.SELECTIVE_FORMAT: "Hybrid draft loading: streaming only the speculative draft's "
    "tensors with InstantTensor while preserving InstantTensor for "
    "the target model",
}


@dataclasses.dataclass(frozen=True)
class Installed:
    """What the hook installed in this process: the parts on (those whose private vLLM names
    have the shapes the layer uses and which installed cleanly), and why load figures are
    not collected (None: they are)."""

    capabilities: internals.Capabilities
    unmeasured: str | None = None


def _part_skipped(caps: internals.Capabilities, part: str) -> None:
    off = caps.off[part]
    shapes: dict[str, Any] = {"shapes": dict(off.shapes)} if off.shapes else {}
    emit(
        "hybrid_draft.part_skipped",
        "warning",
        vllm_version=caps.vllm_version,
        part=part,
        missing=list(off.missing),
        reason=off.reason,
        **shapes,
    )


@functools.cache
def installed() -> Installed:
    """Switch off each part whose private vLLM names this vLLM lacks or has in another
    shape, saying which; instrument the loads; register the layer's load formats. Once per
    process (the first call is the hook's, once ``get_model`` is wrapped)."""
    caps = internals.capabilities()
    for part in caps.off:
        _part_skipped(caps, part)
    unshaped = [
        why
        for why in map(internals.problem, (internals.GET_ALL_WEIGHTS, internals.PREPARE_WEIGHTS))
        if why is not None
    ]
    unmeasured: str | None = "; ".join(unshaped) or None
    if unmeasured is None:
        try:
            unmeasured = stats.instrument(sys.modules[f"{MODULE}.default_loader"], _observe)
        except Exception as exc:  # load figures are a report, never a reason to stop
            unmeasured = f"{type(exc).__name__}: {exc}"
    if unmeasured:
        caps = caps.without("one_pass", unmeasured)
    for part, failure in _register_loaders(caps):
        caps = caps.without(part, failure)
        _part_skipped(caps, part)
    return Installed(caps, unmeasured)


def part_off(part: str) -> str | None:
    """Why ``part`` is off in this process (None: it is on)."""
    return installed().capabilities.reason(part)


def check_parts() -> Installed:
    """Probe this vLLM anew and install again (for a process whose vLLM changed)."""
    internals.capabilities.cache_clear()
    installed.cache_clear()
    return installed()


def on_model_loader(module: ModuleType) -> None:
    """The post-import hook: wrap ``module.get_model`` once, or leave vLLM untouched."""
    if getattr(getattr(module, "get_model", None), _WRAPPED, False):
        return
    emit("hybrid_draft.activated", version=__version__)
    problem = shape_problem(module)
    if problem:
        emit("hybrid_draft.patch_skipped", "warning", vllm_version=vllm_version(), reason=problem)
        return
    module.get_model = wrap(module.get_model)  # type: ignore[attr-defined]
    done = installed()
    extra: dict[str, Any] = {}
    if done.unmeasured:
        extra["load_stats"] = "unavailable: " + done.unmeasured
    if done.capabilities.reason("direct_loads") is None:
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader

        BaseModelLoader.load_model = wrap_load_model(BaseModelLoader.load_model)  # type: ignore[method-assign]
    emit("hybrid_draft.patched", vllm_version=vllm_version(), target=TARGET, **extra)


def _register_loaders(caps: internals.Capabilities) -> list[tuple[str, str]]:
    """Register the layer's load formats with vLLM as soon as it can load: a user's own
    ``draft_load_config`` may name one before any draft is decided. The parts that failed
    to, with why."""
    from hybrid_draft.adapter import loaders

    failed = []
    for part, formats in (
        ("draft_loaders", (loaders.FILTERED, loaders.SELECTIVE)),
        ("ungrouped_draft", (loaders.UNGROUPED,)),
    ):
        if caps.reason(part) is not None:
            continue
        try:
            for fmt in formats:
                loaders.register(fmt)
        except Exception as exc:  # vLLM without them is vLLM as it was
            failed.append(
                (part, f"registering its load formats failed: {type(exc).__name__}: {exc}")
            )
    return failed


# --- one load ----------------------------------------------------------------------------


@dataclasses.dataclass
class Load:
    """One load as decided: who loads what, with which loader, and where events go."""

    role: str | None = None
    model: str | None = None
    load_format: str | None = None
    tensor_filter: bool = False
    #: The draft's replacement load config; None keeps the call's arguments.
    load_config: Any = None
    sink: tuple[str, str | None] | None = None
    #: A draft read by this layer's loaders: its plan, hold and sources.
    draft: Any = None
    #: A target load whose InstantTensor stream keeps the draft's tensors.
    tap: hold.Hold | None = None
    #: The settings the load was decided with: its one snapshot, which its decision, its
    #: loaded/load_failed event and what it reads all follow (None until read).
    snapshot: settings.Settings | None = None


_LOAD: ContextVar[Load | None] = ContextVar("hybrid_draft_load", default=None)


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """``get_model`` with the layer's decision around it."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_model(*args: Any, **kwargs: Any) -> Any:
        def resolve() -> calls.Call:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return calls.Call.resolve(
                bound.arguments["vllm_config"],
                bound.arguments.get("model_config"),
                bound.arguments.get("load_config"),
            )

        def proceed(load_config: Any) -> Any:
            extra = {} if load_config is None else {"load_config": load_config}
            return original(*args, **{**kwargs, **extra})

        return run(resolve, proceed)

    setattr(get_model, _WRAPPED, True)
    return get_model


def wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """A loader's ``load_model``: a load that did not come through ``get_model`` (vLLM's GPU
    runners load the target this way) is decided here; one that did passes through."""
    if getattr(original, _WRAPPED, False):
        return original

    @functools.wraps(original)
    def load_model(
        self: Any, vllm_config: Any, model_config: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if _LOAD.get() is not None:
            return original(self, vllm_config, model_config, *args, **kwargs)

        def proceed(load_config: Any) -> Any:
            if load_config is None:
                return original(self, vllm_config, model_config, *args, **kwargs)
            from vllm.model_executor.model_loader import get_model_loader

            return get_model_loader(load_config).load_model(
                vllm_config, model_config, *args, **kwargs
            )

        return run(lambda: calls.Call.resolve(vllm_config, model_config, self.load_config), proceed)

    setattr(load_model, _WRAPPED, True)
    return load_model


def run(resolve: Callable[[], calls.Call], proceed: Callable[[Any], Any]) -> Any:
    """One load: decide, emit the decision, load, emit what it cost."""
    load = Load()
    with stats.measuring() as cost:
        try:
            decide(resolve(), load)
        except settings.ConfigError as exc:
            _finish(load, cost, exc)
            raise  # an invalid setting stops the load
        except Exception as exc:
            # A fault of the layer's own must not fail a load vLLM would have done:
            # report it and let vLLM load exactly as asked.
            emit(
                "hybrid_draft.decision",
                "error",
                sink=load.sink,
                **{
                    **dict.fromkeys(DECISION_FIELDS),
                    "role": load.role,
                    "model": load.model,
                    "action": "kept",
                    "reason": "layer_error",
                    "detail": f"{type(exc).__name__}: {exc}",
                    **where.fields(load.snapshot),
                },
            )
            load = Load(role=load.role, model=load.model, sink=load.sink, snapshot=load.snapshot)
        token = _LOAD.set(load)
        try:
            with _reading(load):
                model = proceed(load.load_config)
        except BaseException as exc:
            _finish(load, cost, exc)
            raise
        finally:
            _LOAD.reset(token)
        _finish(load, cost, None)
    return model


@contextlib.contextmanager
def _reading(load: Load) -> Iterator[None]:
    if load.draft is None:
        yield
        return
    from hybrid_draft.adapter import loaders

    with loaders.reading(load.draft):
        yield


def _observe() -> Callable[[str, Any], None] | None:
    """For the tensors a ``DefaultModelLoader`` is about to yield to a model: the target's
    tap (it keeps the draft's), or None."""
    load = _LOAD.get()
    return load.tap.offer if load is not None and load.tap is not None else None


def _finish(load: Load, cost: stats.LoadStats, exc: BaseException | None) -> None:
    """``hybrid_draft.loaded``, or ``load_failed`` for a load that raised; a fault here is
    reported as ``hybrid_draft.layer_error``, never raised over the load's own outcome."""
    try:
        fields: dict[str, Any] = {
            "role": load.role,
            "model": load.model,
            "load_format": load.load_format,
            "tensor_filter": load.tensor_filter,
            **cost.fields(),
            **where.fields(load.snapshot),
        }
        if load.draft is not None and load.draft.sources:
            fields["sources"] = load.draft.sources
        if load.tap is not None:
            fields["one_pass"] = load.tap.summary()
        if load.draft is not None and load.draft.hold is not None:
            fields["one_pass"] = load.draft.hold.summary()
        if exc is None:
            emit("hybrid_draft.loaded", sink=load.sink, **fields)
        else:
            emit(
                "hybrid_draft.load_failed",
                "error",
                sink=load.sink,
                **fields,
                error_type=type(exc).__name__,
                error=str(exc),
            )
    except Exception as fault:
        layer_error("the load's event", fault, load.sink)
    finally:
        if load.tap is not None and exc is not None:
            load.tap.release("the target's load failed")
        scope = hold.current()
        if load.role == "draft" and scope is not None:
            scope.release("the draft's load ended" if exc is None else "the draft's load failed")


def layer_error(what: str, exc: BaseException, sink: tuple[str, str | None] | None) -> None:
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


def _current_settings() -> settings.Settings:
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


def decide(call: calls.Call, load: Load) -> None:
    """Decide this load, emit its decision, and fill ``load``."""
    request = call.request()
    load.role = request.role
    load.model = request.model.model if request.model else None
    load.load_format = request.requested_format
    current = _current_settings()
    load.snapshot = current
    load.sink = (current.level.value, current.events_file.value)
    decision = policy.decide(request, current.mode.value)
    extra: dict[str, Any] = {}
    if request.role == "target":
        try:
            load.tap, extra["one_pass"] = _tap(call, current, request)
        except Exception as exc:  # no one pass then; the target loads as asked
            extra["one_pass"] = {
                "enabled": False,
                "reason": "layer_error",
                "detail": f"{type(exc).__name__}: {exc}",
            }
    else:
        decision = _decide_draft(call, request, decision, current, load, extra)
        changed = extra.get("settings_changed")
        if changed is not None and changed["stream"] == "taken" and load.draft is None:
            changed["stream"] = "unused"  # the new settings do not read the draft by its plan
    if decision.switched:
        load.load_format = decision.chosen_format
    pipeline.guard(call, load, extra, part_off("ungrouped_draft"))
    _emit_decision(current, request, decision, extra, load.sink)


def _same_checkpoint(request: policy.Request) -> bool:
    return (
        request.model is not None
        and request.target is not None
        and policy.same_checkpoint(request.model, request.target)
    )


def _plan(
    call: calls.Call, extra: dict[str, Any], skip_replaced: bool, held_plan: DraftPlan | None
) -> DraftPlan | None:
    """The draft's plan: the one its target's load made (``held_plan``), else made now
    (None on a fault, which the decision then reports as ``plan_error``)."""
    if held_plan is not None:
        return held_plan
    from hybrid_draft.adapter import draftplan

    try:
        return draftplan.for_call(call, skip_replaced)
    except internals.Unsupported:  # a part is off: the decision says part_skipped
        return None
    except Exception as exc:  # reported, and the draft loads on vLLM's own lazy path
        extra["plan_error"] = f"{type(exc).__name__}: {exc}"
        return None


def _held(
    call: calls.Call, current: settings.Settings, extra: dict[str, Any]
) -> tuple[hold.Hold | None, DraftPlan | None]:
    """The hold the target's load made for this draft and the plan it holds, as far as the
    draft's own settings allow them: settings that changed between the two loads (a config
    file replaced) are followed, never the target's. A changed ``skip_replaced`` makes the
    held plan another draft's: the draft plans anew (``plan: "replanned"``). A changed
    ``hold_budget`` sized the hold by other settings: it is released and the draft reads
    from storage (``stream: "released"``). The decision's ``settings_changed`` says which."""
    scope = hold.current()
    held = scope.hold_for(call.model_config) if scope is not None else None
    if held is None:
        return None, None
    held.sink = (current.level.value, current.events_file.value)  # the draft's from here on
    if held.settings is None:
        return held, held.plan
    changed = [
        name
        for name in settings.DECISION_SETTINGS
        if getattr(held.settings, name).value != getattr(current, name).value
    ]
    if not changed:
        return held, held.plan
    plan: DraftPlan | None = held.plan
    report = {
        "target_settings_fingerprint": held.settings.fingerprint(),
        "changed": changed,
        "plan": "held",
        "stream": "taken",
    }
    if "skip_replaced" in changed:
        plan, report["plan"] = None, "replanned"
    if "hold_budget" in changed:
        held.release(
            "the settings changed between the target's load and the draft's (hold_budget): "
            "the draft reads from storage"
        )
        held, report["stream"] = None, "released"
    extra["settings_changed"] = report
    return held, plan


def _decide_draft(
    call: calls.Call,
    request: policy.Request,
    decision: policy.Decision,
    current: settings.Settings,
    load: Load,
    extra: dict[str, Any],
) -> policy.Decision:
    from hybrid_draft.adapter import drafts, loaders, rules

    try:
        extra["pruning_rule"] = rules.install(drafts.draft_class(call.model_config))
    except Exception as exc:  # vLLM's own load will report a class it cannot resolve
        extra["pruning_rule"] = None
        extra["rule_error"] = f"{type(exc).__name__}: {exc}"
    same = _same_checkpoint(request)
    skip = bool(current.skip_replaced.value)
    held, held_plan = _held(call, current, extra)
    loaders_off = part_off("draft_loaders")
    plan = _plan(call, extra, skip, held_plan) if same or decision.switched else None
    if same:  # null when planning failed or could not run: unknown, not "nothing to say"
        unknown = "plan_error" in extra or loaders_off is not None
        extra["warnings"] = plan.warnings() if plan is not None else (None if unknown else [])
    if decision.reason == "selective":
        blocker = (
            (
                ("part_skipped", loaders_off)
                if loaders_off is not None
                else ("planning_failed", extra.get("plan_error", "no safetensors shards to plan"))
            )
            if plan is None
            else plan.selective_blocker
        )
        if blocker:
            decision = policy.fall_back(decision, *blocker)
        else:
            assert plan is not None
            extra.update(plan.selection().summary())
    extra["tensor_filter"] = False
    ours = plan is not None and plan.is_unused is not None and loaders_off is None
    if decision.switched:
        if not ours:  # vLLM's own lazy path (a selective draft too: its loader is ours)
            load.load_config = calls.lazy_load_config(call.load_config)
            if decision.chosen_format != policy.SAFETENSORS:
                decision = policy.fall_back(
                    decision,
                    "part_skipped" if loaders_off is not None else "planning_failed",
                    loaders_off or "the draft has no plan to load by",
                )
            return decision
        fmt = (
            loaders.FILTERED
            if decision.chosen_format == policy.SAFETENSORS
            else decision.chosen_format
        )
        load.load_config = calls.loader_load_config(call.load_config, fmt)
    elif request.requested_format in (loaders.FILTERED, loaders.SELECTIVE):
        # The user's own draft_load_config names one of ours.
        if not ours:
            return decision  # the loader reads a plan-less draft by vLLM's own lazy path
    else:
        return decision
    assert plan is not None  # (its load format was registered when get_model was wrapped)
    load.tensor_filter = True
    load.draft = loaders.DraftRead(
        plan=plan,
        hold=held,
        sink=load.sink,
        pipeline_parallel_size=call.vllm_config.parallel_config.pipeline_parallel_size,
        method=request.method,
    )
    extra["sources"] = plan.sources(set(held.tensors) if held is not None else ())
    extra["tensor_filter"] = True
    return decision


def _tap(
    call: calls.Call, current: settings.Settings, request: policy.Request
) -> tuple[hold.Hold | None, dict[str, Any]]:
    """The target's one pass: whether its stream keeps the draft's tensors, and why not."""

    def off(reason: str, detail: str | None = None) -> tuple[None, dict[str, Any]]:
        return None, {"enabled": False, "reason": reason, **({"detail": detail} if detail else {})}

    budget = int(current.hold_budget.value)
    if budget <= 0:
        return off("hold_budget_zero")
    for part in ("one_pass", "draft_loaders"):
        why = part_off(part)
        if why is not None:
            return off("part_skipped", why)
    if request.requested_format != policy.INSTANTTENSOR:
        return off("not_instanttensor")
    scope = hold.current()
    if scope is None:
        return off("no_load_scope", "the target was not loaded by a model runner's load_model")
    spec = call.speculative_config
    draft_config = getattr(spec, "draft_model_config", None)
    if draft_config is None or draft_config is getattr(spec, "target_model_config", None):
        return off("no_draft_model")
    if not internals.pp_group().is_last_rank:
        return off("not_last_pp_rank", "the draft is built on the last pipeline stage only")
    draft_call = calls.Call.resolve(
        call.vllm_config, draft_config, internals.draft_load_config(call.vllm_config)
    )
    draft_request = draft_call.request()
    draft_decision = policy.decide(draft_request, current.mode.value)
    if not draft_decision.switched or not _same_checkpoint(draft_request):
        return off("draft_not_switched", f"the draft's decision: {draft_decision.reason}")
    from hybrid_draft.adapter import draftplan

    plan = draftplan.for_call(draft_call, bool(current.skip_replaced.value))
    if plan is None or plan.is_unused is None or not plan.kept:
        return off("no_plan", "the draft has no checkpoint-weight rule or keeps nothing")
    local = _draft_expert_filter(draft_call)
    wanted = [t for t in plan.kept if t.name not in plan.replaced and not local(t.name)]
    target_bytes = plan.all_bytes // max(1, call.vllm_config.parallel_config.tensor_parallel_size)
    budget = hold.effective_budget(
        budget, hold.free_memory(draftplan.device_of(call)), target_bytes
    )
    chosen, total = [], 0
    for t in wanted:
        if total + t.nbytes <= budget:
            chosen.append(t.name)
            total += t.nbytes
    tap = hold.Hold(
        plan=plan,
        draft_model_config=draft_config,
        wanted=frozenset(chosen),
        budget=budget,
        sink=(current.level.value, current.events_file.value),
        settings=current,
    )
    scope.holds.append(tap)
    return tap, {
        "enabled": True,
        "budget": budget,
        "planned_tensors": len(chosen),
        "planned_bytes": total,
        "draft_tensors": len(wanted),
        "draft_bytes": sum(t.nbytes for t in wanted),
    }


def _draft_expert_filter(draft_call: calls.Call) -> Callable[[str], bool]:
    """Whether the draft's load on this rank skips a name (another rank's expert), by the
    very vLLM code its loader will run."""
    return internals.local_expert_filter(
        calls.lazy_load_config(draft_call.load_config), draft_call.model_config
    )


def _emit_decision(
    current: settings.Settings,
    request: policy.Request,
    decision: policy.Decision,
    extra: dict[str, Any],
    sink: tuple[str, str | None] | None,
) -> None:
    fields: dict[str, Any] = {
        "role": request.role,
        "mode": current.mode.value,
        "mode_source": current.mode.source,
        "method": request.method,
        "requested_format": decision.requested_format,
        "chosen_format": decision.chosen_format,
        "action": decision.action,
        "reason": decision.reason,
    }
    if decision.detail:
        fields["detail"] = decision.detail
    if decision.fallback:
        fields["fallback"] = decision.fallback
    if request.model is not None:
        fields.update(model=request.model.model, revision=request.model.revision)
    if request.target is not None:
        fields.update(target_model=request.target.model, target_revision=request.target.revision)
    fields.update(extra)
    fields.update(where.fields(current))
    emit("hybrid_draft.decision", sink=sink, **fields)
    if decision.switched:
        from vllm.logger import init_logger

        init_logger("vllm.hybrid_draft").info(SWITCH_MESSAGE[decision.chosen_format])
