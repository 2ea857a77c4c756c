"""The wrap of ``vllm.model_executor.model_loader.get_model``: policy in, load config out.

:func:`on_model_loader` runs right after vLLM's model-loader package executes (the
bootstrap's post-import hook). If ``get_model`` has a shape this layer understands it is
replaced by a wrapper with the same signature and metadata; otherwise nothing is touched
and a ``hybrid_draft.patch_skipped`` event says why. Each wrapped call reads the settings,
asks the policy, emits exactly one ``hybrid_draft.decision`` event, and calls vLLM's
``get_model`` with the draft's switched load config, or with its arguments unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

from hybrid_draft import __version__, policy, settings
from hybrid_draft.adapter import configs
from hybrid_draft.events import emit

MODULE = "vllm.model_executor.model_loader"
TARGET = f"{MODULE}.get_model"
REQUIRED = ("vllm_config", "model_config", "load_config")
_WRAPPED = "__hybrid_draft_wrapped__"
#: The keys every hybrid_draft.decision event carries (null where a call leaves one unknown).
DECISION_FIELDS = ("role", "mode", "mode_source", "method", "requested_format",
                   "chosen_format", "action", "reason", "model", "revision")

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
        emit("hybrid_draft.patch_skipped", "warning", vllm_version=vllm_version(),
             reason=problem)
        return
    module.get_model = wrap(module.get_model)
    emit("hybrid_draft.patched", vllm_version=vllm_version(), target=TARGET)


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_model(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            new_load_config = decide(bound.arguments["vllm_config"],
                                     bound.arguments.get("model_config"),
                                     bound.arguments.get("load_config"))
        except settings.ConfigError:
            raise  # an invalid setting stops the load (CONTRACT.md)
        except Exception as exc:
            # A fault of the layer's own must not fail a load vLLM would have done:
            # report it and let vLLM load exactly as asked.
            unknown = dict.fromkeys(DECISION_FIELDS)
            emit("hybrid_draft.decision", "error", **{
                **unknown, "action": "kept", "reason": "layer_error",
                "detail": f"{type(exc).__name__}: {exc}"})
            new_load_config = None
        if new_load_config is not None:
            kwargs = {**kwargs, "load_config": new_load_config}
        return original(*args, **kwargs)

    setattr(get_model, _WRAPPED, True)
    return get_model


def _current_settings() -> settings.Settings:
    try:
        return settings.load()
    except settings.ConfigError as exc:
        emit("hybrid_draft.config_error", "error", sink=settings.event_sink(),
             source=exc.source, detail=exc.detail)
        raise


def decide(vllm_config: Any, model_config: Any, load_config: Any) -> Any:
    """Emit this call's decision; return the draft's new load config, or None to keep it."""
    current = _current_settings()
    call = configs.Call.resolve(vllm_config, model_config, load_config)
    request = call.request()
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
            blocker, plan = f"planning failed: {type(exc).__name__}: {exc}", None
        if blocker:
            decision = policy.fall_back(decision, blocker)
        else:
            assert plan is not None
            selective.register()
            extra.update(plan.summary())
    new_load_config = None
    if decision.switched:
        build = (configs.selective_load_config if decision.chosen_format ==
                 policy.SELECTIVE_FORMAT else configs.lazy_load_config)
        new_load_config = build(call.load_config)
    _report(current, request, decision, extra)
    return new_load_config


def _install_rule(call: configs.Call) -> str | None:
    """Give the draft's class our pruning rule if it lacks one; say whose rule applies."""
    try:
        from hybrid_draft.adapter import rules
        from hybrid_draft.adapter.selective import draft_class

        return rules.install(draft_class(call.model_config))
    except Exception:  # vLLM's own load will report a class it cannot resolve
        return None


def _report(current: settings.Settings, request: policy.Request, decision: policy.Decision,
            extra: dict[str, Any]) -> None:
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
    if request.model is not None:
        fields.update(model=request.model.model, revision=request.model.revision)
    if request.target is not None:
        fields.update(target_model=request.target.model, target_revision=request.target.revision)
    fields.update(extra)
    sink = (current.level.value, current.events_file.value)
    emit("hybrid_draft.decision", sink=sink, **fields)
    if decision.switched:
        from vllm.logger import init_logger

        init_logger("vllm.hybrid_draft").info(SWITCH_MESSAGE[decision.chosen_format])
