"""The wrap of vLLM's model loading: policy in, load config out, one event per decision.

:func:`on_model_loader` runs right after vLLM's model-loader package executes (the
bootstrap's post-import hook). If ``get_model`` has a shape this layer understands it is
replaced by a wrapper with the same signature and metadata; otherwise nothing is touched
and a ``hybrid_draft.patch_skipped`` event says why. Then ``parts.installed`` takes
``internals``' probe of every private vLLM name the layer's parts rely on: a part whose
names are missing or of another shape is switched off with a ``hybrid_draft.part_skipped``
event naming them (and the shapes found), and its drafts load on vLLM's own path.

Every model load is one ``adapter.load.run`` (its decision and events: ``adapter.load``).
Loads arrive through ``get_model`` (vLLM's proposers, the CPU runner) or straight through
a loader's ``load_model`` (vLLM's GPU runners load the target that way); both are wrapped
and both go there, once per load.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from hybrid_draft import __version__, settings
from hybrid_draft.adapter import calls, load, parts
from hybrid_draft.adapter.internals import TARGET, shape_problem, vllm_version
from hybrid_draft.core import figures
from hybrid_draft.events import emit

if TYPE_CHECKING:
    from vllm.config import LoadConfig, ModelConfig, VllmConfig
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

_WRAPPED = "__hybrid_draft_wrapped__"


def on_model_loader(module: ModuleType) -> None:
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
    module.get_model = wrap(module.get_model)  # type: ignore[attr-defined]
    done = parts.installed()
    extra: dict[str, Any] = {}
    if done.unmeasured:
        extra["load_stats"] = "unavailable: " + done.unmeasured
    if done.capabilities.reason("direct_loads") is None:
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader

        BaseModelLoader.load_model = wrap_load_model(BaseModelLoader.load_model)  # type: ignore[method-assign]
    emit("hybrid_draft.patched", sink=sink, vllm_version=vllm_version(), target=TARGET, **extra)


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

        def proceed(load_config: LoadConfig | None) -> Any:
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
        self: BaseModelLoader,
        vllm_config: VllmConfig,
        model_config: ModelConfig,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if figures.current() is not None:  # inside a load this layer decided
            return original(self, vllm_config, model_config, *args, **kwargs)

        def proceed(load_config: LoadConfig | None) -> Any:
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
