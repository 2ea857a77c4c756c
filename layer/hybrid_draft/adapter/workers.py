"""vLLM's worker, hooked as its module is imported (:func:`on_worker`): a trainer's
weight-transfer session (``start_weight_update``, ``update_weights`` once per chunk,
``finish_weight_update``; vLLM's own ``start_draft_weight_update``), which loads into the
target alone, updates the draft too (``adapter.sessions``). Whatever route drives the
session (``LLM.collective_rpc``, the engine client, the server's routes), it runs these
methods in each worker. Imports nothing of the layer's load path until a session starts:
the hook runs inside vLLM's import.
"""

from __future__ import annotations

import functools
from typing import Any

_WRAPPED = "__hybrid_draft_session__"

#: Each of the worker's session methods, and the step of ``adapter.sessions`` it runs
#: through (with its further arguments).
ROUTES: dict[str, tuple[str, tuple[Any, ...]]] = {
    "start_weight_update": ("start", (False,)),
    "start_draft_weight_update": ("start", (True,)),
    "update_weights": ("chunk", ()),
    "finish_weight_update": ("finish", ()),
}


def on_worker(module: Any) -> None:
    """Post-import hook for vLLM's GPU worker module (which the CPU worker subclasses)."""
    cls = getattr(module, "Worker", None)
    if not isinstance(cls, type) or cls.__module__ != module.__name__:
        return
    for name, (step, extra) in ROUTES.items():
        original = vars(cls).get(name)
        if original is not None and not getattr(original, _WRAPPED, False):
            setattr(cls, name, _through(original, step, extra))


def _through(original: Any, step: str, extra: tuple[Any, ...]) -> Any:
    """``original`` run by ``adapter.sessions``'s ``step`` (the worker, vLLM's own call, then
    ``extra``)."""

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        from hybrid_draft.adapter import direct, loadscope, sessions

        if step == "start":  # a caller's direct update of the target ends first
            direct.settle(getattr(self, "model_runner", None), "weight_update")
        run = getattr(sessions, step)
        with loadscope.scope():  # vLLM's own loads, whatever the layer makes of the call
            return run(self, lambda: original(self, *args, **kwargs), *extra)

    setattr(method, _WRAPPED, True)
    return method
