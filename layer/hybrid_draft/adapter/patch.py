"""The wrap of ``vllm.model_executor.model_loader.get_model``: policy in, load config out.

:func:`on_model_loader` runs right after vLLM's model-loader package executes (the
bootstrap's post-import hook). If ``get_model`` has a shape this layer understands it is
replaced by a wrapper with the same signature and metadata; otherwise nothing is touched
and a ``hybrid_draft.patch_skipped`` event says why. Each wrapped call reads the settings,
asks the policy, emits exactly one ``hybrid_draft.decision`` event, calls vLLM's
``get_model`` with the draft's switched load config (or its arguments unchanged), and then
says what the load cost: ``hybrid_draft.loaded``, or ``hybrid_draft.load_failed`` before
the exception propagates unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

from hybrid_draft import __version__, policy, settings
from hybrid_draft.adapter import calls, pipeline, stats, where
from hybrid_draft.events import emit

MODULE = "vllm.model_executor.model_loader"
TARGET = f"{MODULE}.get_model"
REQUIRED = ("vllm_config", "model_config", "load_config")
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


def vllm_version() -> str | None:
    return getattr(sys.modules.get("vllm"), "__version__", None)


def shape_problem(module: Any) -> str | None:
    """Why this vLLM's ``get_model`` cannot be wrapped safely (None when it can)."""
    get_model = getattr(module, "get_model", None)
    if not callable(get_model):
        return f"{MODULE} has no callable get_model"
    try:
        params = inspect.signature(get_model).parameters
    except (TypeError, ValueError) as exc:
        return f"get_model has no readable signature: {exc}"
    missing = [p for p in REQUIRED if p not in params]
    if missing:
        return f"get_model has no parameter {', '.join(missing)}"
    try:
        from vllm.config.load import LoadConfig

        fields = {f.name for f in dataclasses.fields(LoadConfig)}
    except Exception as exc:  # any failure means "not a shape we know"
        return f"vllm.config.load.LoadConfig is not a dataclass: {exc!r}"
    if "load_format" not in fields:
        return "LoadConfig has no load_format field"
    return None


def on_model_loader(module: Any) -> None:
    """The post-import hook: wrap ``module.get_model`` once, or leave vLLM untouched."""
    if getattr(getattr(module, "get_model", None), _WRAPPED, False):
        return
    emit("hybrid_draft.activated", version=__version__)
    problem = shape_problem(module)
    if problem:
        emit("hybrid_draft.patch_skipped", "warning", vllm_version=vllm_version(), reason=problem)
        return
    module.get_model = wrap(module.get_model)
    try:
        unmeasured = stats.instrument(sys.modules[f"{MODULE}.default_loader"])
    except Exception as exc:  # load figures are a report, never a reason to stop
        unmeasured = f"{type(exc).__name__}: {exc}"
    extra = {"load_stats": "unavailable: " + unmeasured} if unmeasured else {}
    emit("hybrid_draft.patched", vllm_version=vllm_version(), target=TARGET, **extra)


@dataclasses.dataclass
class Outcome:
    """One call as decided: who loads what, with which loader, and where events go."""

    role: str | None = None
    model: str | None = None
    load_format: str | None = None
    tensor_filter: bool = False
    #: The draft's replacement load config; None keeps the call's arguments.
    load_config: Any = None
    sink: tuple[str, str | None] | None = None


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_model(*args: Any, **kwargs: Any) -> Any:
        with stats.measuring() as cost:
            outcome = Outcome()
            try:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                call = calls.Call.resolve(
                    bound.arguments["vllm_config"],
                    bound.arguments.get("model_config"),
                    bound.arguments.get("load_config"),
                )
                decide(call, outcome)
            except settings.ConfigError as exc:
                _finish(outcome, cost, exc)
                raise  # an invalid setting stops the load (CONTRACT.md)
            except Exception as exc:
                # A fault of the layer's own must not fail a load vLLM would have done:
                # report it and let vLLM load exactly as asked.
                unknown = dict.fromkeys(DECISION_FIELDS)
                emit(
                    "hybrid_draft.decision",
                    "error",
                    **{
                        **unknown,
                        "role": outcome.role,
                        "model": outcome.model,
                        "action": "kept",
                        "reason": "layer_error",
                        "detail": f"{type(exc).__name__}: {exc}",
                        **where.fields(),
                    },
                )
                outcome.load_config = None
            if outcome.load_config is not None:
                kwargs = {**kwargs, "load_config": outcome.load_config}
            try:
                model = original(*args, **kwargs)
            except BaseException as exc:
                _finish(outcome, cost, exc)
                raise
            _finish(outcome, cost, None)
        return model

    setattr(get_model, _WRAPPED, True)
    return get_model


def _finish(outcome: Outcome, cost: stats.LoadStats, exc: BaseException | None) -> None:
    """``hybrid_draft.loaded``, or ``load_failed`` for a call that raised; never raises."""
    try:
        fields: dict[str, Any] = {
            "role": outcome.role,
            "model": outcome.model,
            "load_format": outcome.load_format,
            "tensor_filter": outcome.tensor_filter,
            **cost.fields(),
            **where.fields(),
        }
        sink = outcome.sink or settings.event_sink()
        if exc is None:
            emit("hybrid_draft.loaded", sink=sink, **fields)
        else:
            emit(
                "hybrid_draft.load_failed",
                "error",
                sink=sink,
                **fields,
                error_type=type(exc).__name__,
                error=str(exc),
            )
    except Exception:  # the load's own outcome (model or exception) is what matters
        pass


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


def decide(call: calls.Call, outcome: Outcome) -> None:
    """Decide this call, emit its decision, and fill ``outcome`` for the load."""
    request = call.request()
    outcome.role = request.role
    outcome.model = request.model.model if request.model else None
    outcome.load_format = request.requested_format
    current = _current_settings()
    outcome.sink = (current.level.value, current.events_file.value)
    decision = policy.decide(request, current.mode.value)
    extra: dict[str, Any] = {}
    if request.role == "draft":
        extra["pruning_rule"] = _install_rule(call)
        from hybrid_draft.adapter import checks

        extra["warnings"] = checks.draft_warnings(call)  # never raises
    if decision.reason == "selective":
        from hybrid_draft.adapter import selective

        try:
            blocker, plan = selective.preflight(call)
        except Exception as exc:  # planning reads the checkpoint: never fail the load on it
            blocker, plan = ("planning_failed", f"{type(exc).__name__}: {exc}"), None
        if blocker:
            decision = policy.fall_back(decision, *blocker)
        else:
            assert plan is not None
            extra.update(plan.summary())
    if decision.switched:
        outcome.load_config, outcome.tensor_filter = _switched_load_config(
            call, decision.chosen_format, extra.get("pruning_rule")
        )
        outcome.load_format = decision.chosen_format
    pipeline.guard(call, outcome, extra)
    if request.role == "draft":
        extra["tensor_filter"] = outcome.tensor_filter
    _report(current, request, decision, extra)


def _switched_load_config(call: calls.Call, chosen: str, rule: str | None) -> tuple[Any, bool]:
    """The draft's load config for ``chosen``, and whether its tensors are filtered.

    A switch to lazy safetensors for a class with a checkpoint-weight rule goes to the
    ``safetensors_filtered`` loader: the same lazy reads, minus every rejected tensor.
    """
    from hybrid_draft.adapter import loaders

    if chosen == policy.SAFETENSORS and rule in (None, "none"):
        return calls.lazy_load_config(call.load_config), False
    load_format = loaders.FILTERED if chosen == policy.SAFETENSORS else chosen
    loaders.register(load_format)
    return calls.loader_load_config(call.load_config, load_format), True


def _install_rule(call: calls.Call) -> str | None:
    """Give the draft's class our pruning rule if it lacks one; say whose rule applies."""
    try:
        from hybrid_draft.adapter import rules
        from hybrid_draft.adapter.selective import draft_class

        return rules.install(draft_class(call.model_config))
    except Exception:  # vLLM's own load will report a class it cannot resolve
        return None


def _report(
    current: settings.Settings,
    request: policy.Request,
    decision: policy.Decision,
    extra: dict[str, Any],
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
    sink = (current.level.value, current.events_file.value)
    emit("hybrid_draft.decision", sink=sink, **fields)
    if decision.switched:
        from vllm.logger import init_logger

        init_logger("vllm.hybrid_draft").info(SWITCH_MESSAGE[decision.chosen_format])
