"""The load scope: the model runner's ``load_model``, inside which the target and then its
draft are loaded. Imports nothing of the layer until a scope has something to settle: the
hook that wraps the runners runs inside vLLM's import.

A one-pass :class:`~hybrid_draft.core.hold.Hold` lives at most as long as the scope it was
made in: held tensors are released when the draft's load ends or fails, and at the latest
when the scope closes (no draft load followed), with a ``hybrid_draft.hold_released``
event. The scope also settles the draft's skipped parameters (``sharing.settle``) once the
proposer has had its chance to replace them. The bootstrap hooks vLLM's GPU, CPU and v2
model runners (:func:`on_runner`).

A model runner's ``reload_weights`` (vLLM reloads the target's weights in place, and only
the target's) is a scope as well, in which ``adapter.reload`` reloads the draft after its
target: the same hold carries the draft's tensors from the target's reload stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import ModelConfig

    from hybrid_draft.adapter import sharing
    from hybrid_draft.core import hold


@dataclass
class Scope:
    """One model runner's ``load_model``: the holds made in it and the skips to settle."""

    holds: list[hold.Hold] = field(default_factory=list)
    skipped: list[sharing.Skipped] = field(default_factory=list)

    def hold_for(self, draft_model_config: ModelConfig) -> hold.Hold | None:
        return next(
            (
                h
                for h in self.holds
                if h.draft_model_config is draft_model_config and not h.released
            ),
            None,
        )

    def release(self, reason: str) -> None:
        for held in self.holds:
            held.release(reason)

    def close(self) -> None:
        if not self.skipped and not self.holds:  # no load of the layer's happened here
            return
        from hybrid_draft.adapter import sharing

        try:
            for skipped in self.skipped:
                sharing.settle(skipped)
        finally:
            self.release("no draft load followed the target's in this load scope")


_SCOPE: ContextVar[Scope | None] = ContextVar("hybrid_draft_load_scope", default=None)


def current() -> Scope | None:
    return _SCOPE.get()


@contextlib.contextmanager
def scope() -> Iterator[Scope]:
    """A load scope (nested scopes are the outer one): holds live at most this long."""
    outer = _SCOPE.get()
    if outer is not None:
        yield outer
        return
    inner = Scope()
    token = _SCOPE.set(inner)
    try:
        yield inner
    finally:
        _SCOPE.reset(token)
        inner.close()


def on_runner(module: Any) -> None:
    """Post-import hook for vLLM's model runner modules: their ``load_model`` is a scope,
    their ``reload_weights`` reloads the draft with the target."""
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


_WRAPPED = "__hybrid_draft_scope__"


def wrap_runner(cls: type) -> None:
    import functools

    original = cls.load_model  # type: ignore[attr-defined]
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        with scope():
            return original(self, *args, **kwargs)

    setattr(load_model, _WRAPPED, True)
    cls.load_model = load_model  # type: ignore[attr-defined]


def wrap_reload(cls: type, runner: str) -> None:
    """``cls.reload_weights`` (``runner`` names the class, ``module:Class``) reloads the
    draft too (``adapter.reload.run``). The wrapper takes the arguments as vLLM's does."""
    import functools
    import inspect

    original = cls.reload_weights  # type: ignore[attr-defined]
    if getattr(original, _WRAPPED, False):
        return
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):  # not a shape to bind: left as it is (the probe says so)
        return

    @functools.wraps(original)
    def reload_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        from hybrid_draft.adapter import reload

        return reload.run(self, runner, original, signature, args, kwargs)

    setattr(reload_weights, _WRAPPED, True)
    cls.reload_weights = reload_weights  # type: ignore[attr-defined]
