"""The load scope: the model runner's ``load_model``, inside which the target and then its
draft are loaded. Imports nothing of the layer until a scope has something to settle: the
hook that wraps the runners runs inside vLLM's import.

A one-pass :class:`~hybrid_draft.core.hold.Hold` lives at most as long as the scope it was
made in: held tensors are released when the draft's load ends or fails, and at the latest
when the scope closes (no draft load followed), with a ``hybrid_draft.hold_released``
event. The scope also settles the draft's skipped parameters (``sharing.settle``) once the
proposer has had its chance to replace them. A model runner's ``load_model`` and
``reload_weights`` each open one (``adapter/runners.py``); a weight-transfer session, which
spans several calls into the worker, holds one for its life and enters it in each call
(:func:`use`, ``adapter/sessions.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import ModelConfig

    from hybrid_draft.adapter import sharing
    from hybrid_draft.core import hold, update
    from hybrid_draft.core.planning import DraftPlan


@dataclass
class Scope:
    """One model runner's ``load_model``: the holds made in it and the skips to settle."""

    holds: list[hold.Hold] = field(default_factory=list)
    skipped: list[sharing.Skipped] = field(default_factory=list)
    #: A draft plan its owner made for an earlier update of the same checkpoint, which an
    #: update that carries the draft takes its names from again (``direct``).
    planned: DraftPlan | None = None
    #: The draft's open step of an update that carries it (``carry.Carry``), which the
    #: draft's load at the step's end follows.
    step: update.Step | None = None

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


class use:
    """``held`` as the current scope while open, without closing it on the way out: a scope
    that lives across calls (its owner closes it; a class, cheaper than a generator, as it is
    opened once per call of a session or a direct update)."""

    __slots__ = ("_held", "_token")

    def __init__(self, held: Scope) -> None:
        self._held = held

    def __enter__(self) -> Scope:
        self._token = _SCOPE.set(self._held)
        return self._held

    def __exit__(self, *exc: object) -> None:
        _SCOPE.reset(self._token)


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
