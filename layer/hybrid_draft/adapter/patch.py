"""The wrap of vLLM's model loading: policy in, load config out, one event per decision.

:func:`on_model_loader` runs right after vLLM's model-loader package executes (the
bootstrap's post-import hook). If ``get_model`` has a shape this layer understands it is
replaced by a wrapper with the same signature and metadata; otherwise nothing is touched
and a ``hybrid_draft.patch_skipped`` event says why. Every private vLLM name the layer's
parts rely on is checked there too (:data:`PARTS`): a part whose names are missing is
switched off with a ``hybrid_draft.part_skipped`` event naming them, and its drafts load
on vLLM's own path.

Every model load is one ``adapter.load.run`` (its decision and events: ``adapter.load``).
Loads arrive through ``get_model`` (vLLM's proposers, the CPU runner) or straight through
a loader's ``load_model`` (vLLM's GPU runners load the target that way); both are wrapped
and both go there, once per load.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

from hybrid_draft import __version__, settings
from hybrid_draft.adapter import calls, load, stats
from hybrid_draft.events import Sink, emit

MODULE = "vllm.model_executor.model_loader"
TARGET = f"{MODULE}.get_model"
REQUIRED = ("vllm_config", "model_config", "load_config")
_WRAPPED = "__hybrid_draft_wrapped__"
#: The original instanttensor-hybrid-draft-loader mod's marker in the file it rewrites.
TEXT_PATCH_MARKER = "# spark-vllm mod: instanttensor-hybrid-draft-loader"
#: The private vLLM names each part of the layer relies on (``module:attr`` or
#: ``module:Class.attr``; instance attributes of a fresh ``DefaultModelLoader`` as
#: ``loader.attr``). A part whose names are missing is switched off.
_DL = "vllm.model_executor.model_loader.default_loader:DefaultModelLoader"
PARTS: dict[str, tuple[str, ...]] = {
    "draft_loaders": (
        f"{_DL}._prepare_weights",
        f"{_DL}._get_weights_iterator",
        f"{_DL}.get_all_weights",
        f"{_DL}.load_weights",
        f"{_DL}.track_weights_loading",
        f"{_DL}.counter_before_loading_weights",
        f"{_DL}.Source",
        "loader.local_expert_ids",
        "loader._encoder_only_lm_prefixes",
        "vllm.model_executor.model_loader.ep_weight_filter:should_skip_weight",
        "vllm.model_executor.model_loader:register_model_loader",
        "vllm.model_executor.model_loader.utils:get_model_architecture",
        "vllm.model_executor.model_loader.weight_utils:enable_tqdm",
    ),
    "one_pass": (
        f"{_DL}.get_all_weights",
        f"{_DL}._init_ep_weight_filter",
        "vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",
        "vllm.model_executor.model_loader.utils:get_draft_load_config",
        "vllm.distributed.parallel_state:get_pp_group",
    ),
    "direct_loads": ("vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",),
    # The pipeline-parallel guard's InstantTensor read without vLLM's world group.
    "ungrouped_draft": (
        f"{_DL}._prepare_weights",
        f"{_DL}._get_weights_iterator",
        f"{_DL}.counter_before_loading_weights",
        "loader.local_expert_ids",
        "loader._encoder_only_lm_prefixes",
        "loader._encoder_only_weights_mapper",
        "vllm.model_executor.model_loader.default_loader:filter_mm_encoder_only_safetensors_files",
        "vllm.model_executor.model_loader.default_loader:filter_safetensors_files_by_weight_name",
        "vllm.model_executor.model_loader.ep_weight_filter:should_skip_weight",
        "vllm.config:get_current_vllm_config_or_none",
    ),
}
#: Parts switched off in this process, with why.
OFF: dict[str, str] = {}


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
    return text_patch(module)


def text_patch(module: Any) -> str | None:
    """The original text-patch mod rewrote this vLLM's loader: say so (None if not)."""
    path = getattr(module, "__file__", None)
    try:
        with open(path or "", encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return None
    if TEXT_PATCH_MARKER not in text:
        return None
    return (
        f"the instanttensor-hybrid-draft-loader mod has rewritten {path}; hybrid-draft does "
        "its job and will not stack a second wrapper on it: reinstall vLLM (or recreate the "
        "container without that mod), then hybrid-draft wraps get_model"
    )


def _resolve(name: str, loader: Any) -> bool:
    if name.startswith("loader."):
        return loader is not None and hasattr(loader, name.partition(".")[2])
    module, _, path = name.partition(":")
    try:
        obj: Any = __import__(module, fromlist=["_"])
        for part in path.split("."):
            obj = getattr(obj, part)
    except Exception:  # missing or failing: either way not a shape we know
        return False
    return True


def missing_names(names: tuple[str, ...]) -> list[str]:
    """The names of ``names`` this vLLM lacks."""
    loader = None
    try:
        from vllm.config.load import LoadConfig
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        loader = DefaultModelLoader(LoadConfig(load_format="safetensors"))
    except Exception:  # reported below as the missing instance attributes
        loader = None
    return [n for n in names if not _resolve(n, loader)]


def check_parts(sink: Sink | None = None) -> None:
    """Switch off each part whose private vLLM names this vLLM lacks, saying which."""
    if sink is None:
        sink = settings.process_sink()
    OFF.clear()
    for part, names in PARTS.items():
        missing = missing_names(names)
        if missing:
            OFF[part] = f"this vLLM has no {', '.join(missing)}"
            emit(
                "hybrid_draft.part_skipped",
                "warning",
                sink=sink,
                vllm_version=vllm_version(),
                part=part,
                missing=missing,
                reason=OFF[part],
            )


def on_model_loader(module: Any) -> None:
    """The post-import hook: wrap ``module.get_model`` once, or leave vLLM untouched."""
    if getattr(getattr(module, "get_model", None), _WRAPPED, False):
        return
    sink = settings.process_sink()
    emit("hybrid_draft.activated", sink=sink, version=__version__)
    problem = shape_problem(module)
    if problem:
        emit(
            "hybrid_draft.patch_skipped",
            "warning",
            sink=sink,
            vllm_version=vllm_version(),
            reason=problem,
        )
        return
    module.get_model = wrap(module.get_model)
    extra: dict[str, Any] = {}
    check_parts(sink)
    try:
        unmeasured = stats.instrument(sys.modules[f"{MODULE}.default_loader"], load.observer)
    except Exception as exc:  # load figures are a report, never a reason to stop
        unmeasured = f"{type(exc).__name__}: {exc}"
    if unmeasured:
        extra["load_stats"] = "unavailable: " + unmeasured
        OFF.setdefault("one_pass", unmeasured)
    _register_loaders(sink)
    if "direct_loads" not in OFF:
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader

        BaseModelLoader.load_model = wrap_load_model(BaseModelLoader.load_model)  # type: ignore[method-assign]
    emit("hybrid_draft.patched", sink=sink, vllm_version=vllm_version(), target=TARGET, **extra)


def _register_loaders(sink: Sink) -> None:
    """Register the layer's load formats with vLLM as soon as it can load: a user's own
    ``draft_load_config`` may name one before any draft is decided."""
    from hybrid_draft.adapter import loaders

    for part, formats in (
        ("draft_loaders", (loaders.FILTERED, loaders.SELECTIVE)),
        ("ungrouped_draft", (loaders.UNGROUPED,)),
    ):
        if part in OFF:
            continue
        try:
            for fmt in formats:
                loaders.register(fmt)
        except Exception as exc:  # vLLM without them is vLLM as it was
            OFF[part] = f"registering its load formats failed: {type(exc).__name__}: {exc}"
            emit(
                "hybrid_draft.part_skipped",
                "warning",
                sink=sink,
                vllm_version=vllm_version(),
                part=part,
                missing=[],
                reason=OFF[part],
            )


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

        return load.run(resolve, proceed)

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
        if load.current() is not None:
            return original(self, vllm_config, model_config, *args, **kwargs)

        def proceed(load_config: Any) -> Any:
            if load_config is None:
                return original(self, vllm_config, model_config, *args, **kwargs)
            from vllm.model_executor.model_loader import get_model_loader

            return get_model_loader(load_config).load_model(
                vllm_config, model_config, *args, **kwargs
            )

        return load.run(
            lambda: calls.Call.resolve(vllm_config, model_config, self.load_config), proceed
        )

    setattr(load_model, _WRAPPED, True)
    return load_model
