"""The wrap of vLLM's model loading: policy in, load config out, one event per decision.

:func:`on_model_loader` runs right after vLLM's model-loader package executes (the
bootstrap's post-import hook), inside vLLM's import, in every process that imports it: it
does only what cannot wait, and imports nothing heavy (no structlog, no settings file, no
plan, no reader). If ``get_model`` has a shape this layer understands it is replaced by a
wrapper with the same signature and metadata, loaders' ``load_model`` likewise, and the
layer's load formats are registered (``loaders.register_all``: stand-ins, cheap); otherwise
nothing is touched and a ``hybrid_draft.patch_skipped`` event says why. Its events
(``activated``, ``patched``) are stamped now and written with the process's first load, or
at its exit (``events.defer``).

The first load (``adapter.load.run``) takes ``parts.installed``: ``internals``' probe of
every private vLLM name the layer's parts rely on (a part whose names are missing or of
another shape is switched off with a ``hybrid_draft.part_skipped`` event naming them, and
its drafts load on vLLM's own path) and the load figures' instrumentation. Every model load
is one ``load.run``. Loads arrive through ``get_model`` (vLLM's proposers, the CPU runner)
or straight through a loader's ``load_model`` (vLLM's GPU runners load the target that way);
both are wrapped and both go there, once per load.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from hybrid_draft import __version__
from hybrid_draft.adapter import internals
from hybrid_draft.events import Sink, defer, flush

if TYPE_CHECKING:
    from vllm.config import LoadConfig, ModelConfig, VllmConfig
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

_WRAPPED = "__hybrid_draft_wrapped__"


def _sink_as_now() -> Callable[[], Sink]:
    """Where an event of the hook goes: the process's sink under the environment as it is
    now, worked out (the settings file read) when the event is written."""
    environ = dict(os.environ)

    def sink() -> Sink:
        from hybrid_draft import settings

        return settings.process_sink(environ)

    return sink


def _patched() -> Mapping[str, Any]:
    """``patched``'s fields, asked when it is written: a process that loads has its figures
    instrumented by then anyway."""
    from hybrid_draft.adapter import parts

    fields: dict[str, Any] = {"vllm_version": internals.vllm_version(), "target": internals.TARGET}
    unmeasured = parts.measured()
    if unmeasured:
        fields["load_stats"] = "unavailable: " + unmeasured
    return fields


def on_model_loader(module: ModuleType) -> None:
    """The post-import hook: wrap ``module.get_model`` once, or leave vLLM untouched."""
    if getattr(getattr(module, "get_model", None), _WRAPPED, False):
        return
    sink = _sink_as_now()
    defer("hybrid_draft.activated", sink=sink, fields=lambda: {"version": __version__})
    problem = internals.shape_problem(module)
    if problem:
        version = internals.vllm_version()
        defer(
            "hybrid_draft.patch_skipped",
            "warning",
            sink=sink,
            fields=lambda: {"vllm_version": version, "reason": problem},
        )
        flush()  # vLLM is left as it is: no load of this process will write them
        return
    module.get_model = wrap(module.get_model)  # type: ignore[attr-defined]
    base_loader = sys.modules.get(f"{internals.MODULE}.base_loader")
    if base_loader is not None:
        loader_cls = base_loader.BaseModelLoader
        loader_cls.load_model = wrap_load_model(loader_cls.load_model)
    from hybrid_draft.adapter import loaders

    loaders.register_all()
    defer("hybrid_draft.patched", sink=sink, fields=_patched)


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """``get_model`` with the layer's decision around it."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_model(*args: Any, **kwargs: Any) -> Any:
        def resolve() -> Any:
            from hybrid_draft.adapter import calls

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

        from hybrid_draft.adapter import load

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
        from hybrid_draft.adapter import calls, load, parts
        from hybrid_draft.core import figures

        if figures.current() is not None:  # inside a load this layer decided
            return original(self, vllm_config, model_config, *args, **kwargs)
        if parts.installed().capabilities.reason("direct_loads") is not None:
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
