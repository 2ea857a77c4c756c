"""vLLM's model runners, hooked as their modules are imported (:func:`on_runner`): each
runner's ``load_model`` is a load scope (``loadscope``), in which a one-pass hold lives,
and once it returns a caller's direct ``load_weights`` calls on its target carry the draft
(``adapter.direct``); its ``reload_weights``, which vLLM makes reload the target alone,
reloads the draft too (``adapter.reload``). Imports nothing of the layer's load path until
a runner's method is called: the hook runs inside vLLM's import.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from hybrid_draft.adapter import loadscope

_WRAPPED = "__hybrid_draft_scope__"


def on_runner(module: Any) -> None:
    """Post-import hook for vLLM's model runner modules."""
    for cls in list(vars(module).values()):
        if (
            isinstance(cls, type)
            and cls.__module__ == module.__name__
            and cls.__name__.endswith("ModelRunner")
        ):
            if "load_model" in vars(cls):
                wrap_runner(cls)
            if "reload_weights" in vars(cls):
                wrap_reload(cls, f"{module.__name__}:{cls.__qualname__}")


def wrap_runner(cls: type) -> None:
    """``cls.load_model`` opens a load scope."""
    original = cls.load_model  # type: ignore[attr-defined]
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        with loadscope.scope():
            result = original(self, *args, **kwargs)
        from hybrid_draft.adapter import direct

        direct.install(self)
        return result

    setattr(load_model, _WRAPPED, True)
    cls.load_model = load_model  # type: ignore[attr-defined]


def wrap_reload(cls: type, runner: str) -> None:
    """``cls.reload_weights`` (``runner`` names the class, ``module:Class``) reloads the
    draft too (``adapter.reload.run``). The wrapper takes the arguments as vLLM's does."""
    original = cls.reload_weights  # type: ignore[attr-defined]
    if getattr(original, _WRAPPED, False):
        return
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):  # not a shape to bind: left as it is (the probe says so)
        return

    @functools.wraps(original)
    def reload_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        from hybrid_draft.adapter import direct, reload

        direct.settle(self, "reload")  # a caller's direct update of the target ends first
        with loadscope.scope():  # vLLM's own loads, whatever the layer makes of the call
            return reload.run(self, runner, original, signature, args, kwargs)

    setattr(reload_weights, _WRAPPED, True)
    cls.reload_weights = reload_weights  # type: ignore[attr-defined]
