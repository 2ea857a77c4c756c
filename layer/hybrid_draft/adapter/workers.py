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


def on_worker(module: Any) -> None:
    """Post-import hook for vLLM's GPU worker module (which the CPU worker subclasses)."""
    cls = getattr(module, "Worker", None)
    if not isinstance(cls, type) or cls.__module__ != module.__name__:
        return
    for name, is_draft in (("start_weight_update", False), ("start_draft_weight_update", True)):
        if name in vars(cls):
            _wrap(cls, name, _start(is_draft))
    if "update_weights" in vars(cls):
        _wrap(cls, "update_weights", _chunk)
    if "finish_weight_update" in vars(cls):
        _wrap(cls, "finish_weight_update", _finish)


def _wrap(cls: type, name: str, make: Any) -> None:
    original = getattr(cls, name)
    if getattr(original, _WRAPPED, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _WRAPPED, True)
    setattr(cls, name, wrapper)


def _start(is_draft: bool) -> Any:
    def make(original: Any) -> Any:
        def start(self: Any, *args: Any, **kwargs: Any) -> Any:
            from hybrid_draft.adapter import sessions

            return sessions.start(self, lambda: original(self, *args, **kwargs), is_draft)

        return start

    return make


def _chunk(original: Any) -> Any:
    def update_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        from hybrid_draft.adapter import sessions

        return sessions.chunk(self, lambda: original(self, *args, **kwargs))

    return update_weights


def _finish(original: Any) -> Any:
    def finish_weight_update(self: Any, *args: Any, **kwargs: Any) -> Any:
        from hybrid_draft.adapter import sessions

        return sessions.finish(self, lambda: original(self, *args, **kwargs))

    return finish_weight_update
