"""One step of an update that carries the draft: the model every trigger drives (:class:`Step`).

Two triggers update a served target's weights in calls the layer does not make, a trainer's
weight-transfer session and a trainer's direct ``load_weights`` calls, and both hand the
draft its own tensors as the calls pass them (``adapter/carry.py``). What may happen, and
what the draft is left with, is decided here, on names alone (no vLLM, no tensor):

- a step is **begun** by the update's first call, and **fed** by each of the draft's tensors
  a call brings (:meth:`Step.take`): a call on the target, or a caller's own call on the
  draft (verl, skyrl and NeMo RL feed it what they fed the target);
- **a name brought again** ends the step there, and the next begins with it
  (:attr:`Given.REPEAT`, ``ended_by: next_sync``), whatever the calls' shapes (a list, a
  tuple, a stream): the caller is syncing its next step with no end between. A call on the
  draft bringing a tensor that a call on the target brought in this step is that same
  step's (:attr:`Given.ALREADY`), taken once;
- a failure of the draft's part (its feed, its commit, vLLM's finalize of its layers) makes
  the step **failed**: nothing more is taken, and the draft keeps the previous step whole;
- **an end** (:data:`ENDS`, by trigger) decides the step once (:meth:`Step.end`):
  **committed** when it took every tensor the draft needs (its plan's; without a plan,
  vLLM's own check of the draft's parameters), else **kept**, with a reason code of
  ``policy.NOT_RELOADED`` and a detail naming what it lacked, or **failed**.

The draft is never left part one step's and part another's: a step's tensors are staged in
the draft's own layers and become the draft's weights only at its commit, all at once.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

Role = Literal["target", "draft"]


class State(enum.Enum):
    """Where a step is: ``BEGUN``, ``FED`` or ``FAILED`` while open; ``COMMITTED``, ``KEPT``
    or ``FAILED`` once ended."""

    BEGUN = "begun"
    FED = "fed"
    FAILED = "failed"
    COMMITTED = "committed"
    KEPT = "kept"


class Given(enum.Enum):
    """What one tensor a call brings is to the step (:meth:`Step.take`)."""

    TAKEN = "taken"  #: one of the draft's, new in this step: staged
    ALREADY = "already"  #: a draft call's repeat of what a target call brought: taken once
    NOT_DRAFTS = "not_drafts"  #: not one the draft reads (the target's alone)
    IGNORED = "ignored"  #: the step has failed: nothing more is staged
    REPEAT = "repeat"  #: brought again: this step ends, the next begins with it


#: What may happen to an open step in each state, and to an ended one.
MAY: Mapping[State, frozenset[str]] = MappingProxyType(
    {
        State.BEGUN: frozenset({"take", "fail", "end"}),
        State.FED: frozenset({"take", "fail", "end"}),
        State.FAILED: frozenset({"take", "fail", "end"}),
    }
)
MAY_ENDED: Mapping[State, frozenset[str]] = MappingProxyType(
    {
        State.COMMITTED: frozenset({"fail"}),  # its commit failed after all
        State.KEPT: frozenset(),
        State.FAILED: frozenset({"fail"}),
    }
)

#: What ends a step, by the events' ``trigger`` (docs/contract.md: when a step ends).
ENDS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "direct_update": (
            "process_weights_after_loading",  # the caller's own, on the target or the draft
            "next_step",  # the runner's next execute_model, before the draft's proposal
            "dummy_batch",  # an idle data-parallel rank's dummy forward (the draft's too)
            "reload",  # vLLM's reload_weights of the runner
            "weight_update",  # a weight-transfer session of the worker
            "next_sync",  # a tensor brought again (Given.REPEAT)
            "failed_call",  # a call on the target that raised
        ),
        "weight_update": (
            "finish_weight_update",  # vLLM's own end of the session
            "failed_chunk",  # an update_weights (or vLLM's finish) that raised
            "next_sync",  # a tensor brought again (Given.REPEAT)
        ),
    }
)


@dataclass(frozen=True)
class Outcome:
    """How a step ended for the draft: ``state`` (committed, kept or failed) and, for a kept
    one, its reason code and detail."""

    state: State
    reason: str | None = None
    detail: str | None = None


def names(shown: Iterable[str], most: int = 8) -> str:
    """Up to ``most`` names, and how many more."""
    listed = list(shown)
    out = ", ".join(listed[:most])
    return out + (f" and {len(listed) - most} more" if len(listed) > most else "")


@dataclass
class Step:
    """One step of an update, as names: the draft's tensors it took, and from which model."""

    #: Every tensor the draft reads on this rank (its plan's), in file order; None: no plan
    #: to check by (the caller's own feed of the draft is checked by vLLM at the end).
    needed: tuple[str, ...] | None
    #: How the update is named in a detail ("the direct update", "the nccl session").
    called: str = "the update"
    state: State = State.BEGUN
    ended: bool = False
    by_target: set[str] = field(default_factory=set)
    by_draft: set[str] = field(default_factory=set)
    #: What made the step failed (the first failure).
    failure: BaseException | None = None
    #: The call in progress's tensors this step took, each with its name, until the
    #: adapter stages them (:meth:`drain`); from the first repeat on, what the call brings
    #: is the next step's (``spill``, with the model each was given to).
    pending: list[tuple[str, Any]] = field(default_factory=list)
    spill: list[tuple[str, Any, Role]] = field(default_factory=list)
    #: How the step ended (None: open).
    outcome: Outcome | None = None
    # What it took, for its events: the bytes of its tensors; the calls that brought any
    # and the seconds the draft's loads of them took; the caller's own calls on the draft;
    # of its tensors, those read from storage where the calls lacked them, and their bytes.
    bytes: int = 0
    calls: int = 0
    seconds: float = 0.0
    fed: int = 0
    read_tensors: int = 0
    read_bytes: int = 0
    #: ``needed`` as a set, asked once per tensor a call brings.
    _needed: frozenset[str] | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        self._needed = frozenset(self.needed) if self.needed is not None else None

    @property
    def taken(self) -> set[str]:
        return self.by_target | self.by_draft

    def may(self, what: str) -> bool:
        return what in (MAY_ENDED if self.ended else MAY).get(self.state, frozenset())

    def _must(self, what: str) -> None:
        if not self.may(what):
            ended = "ended " if self.ended else ""
            raise RuntimeError(f"an {ended}{self.state.value} step cannot {what}")

    def take(self, name: str, tensor: Any, role: Role) -> Given:
        """``name`` (``tensor``) brought by a call on the ``role`` model: what it is to this
        step. A failed step still notes it, so that the next sync's repeat ends it all the
        same; once a call has brought a repeat, the rest of its tensors are the next step's."""
        self._must("take")
        if self._needed is not None and name not in self._needed:
            return Given.NOT_DRAFTS
        if self.spill:
            self.spill.append((name, tensor, role))
            return Given.REPEAT
        if role == "draft" and name in self.by_target:
            return Given.ALREADY
        if name in self.by_target or name in self.by_draft:
            self.spill.append((name, tensor, role))
            return Given.REPEAT
        (self.by_target if role == "target" else self.by_draft).add(name)
        if self.state is State.FAILED:
            return Given.IGNORED
        self.state = State.FED
        self.pending.append((name, tensor))
        return Given.TAKEN

    def drain(self) -> list[tuple[str, Any]]:
        """The tensors the call in progress brought this step, no longer referenced here."""
        out, self.pending = self.pending, []
        return out

    def next(self) -> Step:
        """The step a repeat began (this one ended): what the call brought from the repeat
        on, taken by it (it may end there too, at a further repeat)."""
        if not self.ended:
            raise RuntimeError("a step that has not ended has no next")
        step = Step(self.needed, self.called)
        spill, self.spill = self.spill, []
        for name, tensor, role in spill:
            step.take(name, tensor, role)
        return step

    def fail(self, exc: BaseException) -> None:
        """The draft's part failed (its feed, its commit): the draft keeps the previous step."""
        self._must("fail")
        if self.failure is None:
            self.failure = exc
        self.state = State.FAILED
        self.pending.clear()
        if self.ended:
            self.outcome = Outcome(State.FAILED)

    def end(
        self,
        complete: bool | None = None,
        target_failed: bool = False,
        unseen: bool = False,
    ) -> Outcome:
        """The step's end (once): whether the draft takes it. ``complete``: vLLM's answer for
        a step without a plan (whether every parameter of the draft's own was loaded);
        ``target_failed``: the target's own call raised; ``unseen``: the calls wrote the
        target's parameters without its ``load_weights`` (an engine patching in place)."""
        self._must("end")
        self.ended = True
        self.pending.clear()
        if self.state is State.FAILED:
            outcome = Outcome(State.FAILED)
        else:
            outcome = self._decide(complete, target_failed, unseen)
        self.state, self.outcome = outcome.state, outcome
        return outcome

    def lacking(self) -> list[str]:
        """The draft's tensors this step has not taken, in file order (none without a plan)."""
        return [] if self.needed is None else [n for n in self.needed if n not in self.taken]

    def _decide(self, complete: bool | None, target_failed: bool, unseen: bool) -> Outcome:
        called = self.called
        if target_failed:
            return _kept(
                "target_failed",
                f"{called}'s call on the target raised: the draft keeps its weights",
            )
        if not self.taken and self.needed is None:
            return _kept(
                "incomplete_stream",
                f"the draft has no plan to take its tensors from {called} by, and no call "
                "fed it (the target decision's one_pass says why): the draft keeps its weights",
            )
        if not self.taken:
            count = f" {len(self.needed)}" if self.needed else ""
            how = (
                " (its engine loaded the target without the model's load_weights, writing "
                "the parameters itself)"
                if unseen
                else ""
            )
            return _kept(
                "no_draft_tensors",
                f"{called} brought none of the draft's{count} tensors{how}: the draft keeps "
                "its weights",
            )
        if self.needed is None:
            if complete:
                return Outcome(State.COMMITTED)
            return _kept(
                "incomplete_stream",
                f"{called} fed the draft {len(self.taken)} tensors, which left some of its "
                "own parameters unloaded (vLLM's check: the draft has no plan here): the "
                "draft keeps its weights",
            )
        lacking = self.lacking()
        if lacking:
            return _kept(
                "incomplete_stream",
                f"{called} brought {len(self.taken)} of the draft's {len(self.needed)} "
                f"tensors; it lacked {len(lacking)}: {names(lacking)}: the draft keeps its "
                "weights",
            )
        return Outcome(State.COMMITTED)


def _kept(reason: str, detail: str) -> Outcome:
    return Outcome(State.KEPT, reason, detail)
