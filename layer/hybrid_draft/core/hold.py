"""One pass: the draft's tensors kept from the target's stream (a :class:`Hold`).

With ``--load-format instanttensor`` the target's pass streams every tensor of every shard
to the device, the draft's own tensors included, and the target's ``load_weights`` drops
those; fastsafetensors and the Run:ai Model Streamer stream every tensor of the shards they
open too. When a same-checkpoint draft will follow in this process, the layer keeps them as
the stream yields them (:meth:`Hold.offer`: references to the very tensors the stream made,
or a copy of a tensor that is a view into a larger buffer, :func:`own`) and the draft's load
takes them (:meth:`Hold.take`) instead of reading storage. What is held is capped by the
``hold_budget`` setting and by a quarter of the memory the target leaves free
(:func:`effective_budget`); what does not fit is read by the filtered path.

A trainer's weight-transfer session taps the target's chunks the same way, but keeps
nothing (:class:`Pass`): each chunk's draft tensors are handed on to the draft's own load
while the chunk is still the engine's, and the pass only counts what went by, so that the
session's end can tell whether the draft got all of its tensors.

No vLLM import: a hold needs only its plan and the tensors offered to it, so the one-pass
tap runs on any stream (``tools/bench``, ``scripts/gpu-check.sh``). Where a hold lives (the
model runner's load scope) is the adapter's (``adapter/loadscope.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

from hybrid_draft import records
from hybrid_draft.core import objectstore, update
from hybrid_draft.core.planning import DraftPlan
from hybrid_draft.events import Sink, emit
from hybrid_draft.settings import Settings

#: The share of the memory left after the target's weights that a hold may take.
FREE_SHARE = 4


def nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def own(tensor: Any, copy: bool = False) -> Any:
    """``tensor`` where it owns its memory, else a copy that does: a view into a larger
    buffer (a fastsafetensors shard's, a Run:ai ring slot's) would keep all of it alive for
    as long as it is held. With ``copy``, always a copy: a tensor of someone else's stream
    (a reload's weights iterator) may be a buffer its producer fills again."""
    if copy:
        return tensor.detach().clone()
    try:
        shared = int(tensor.untyped_storage().nbytes()) > nbytes(tensor)
    except Exception:  # not a torch tensor's storage: held as it is
        return tensor
    return tensor.clone() if shared else tensor


@dataclass
class Hold:
    """The draft's tensors kept from the target's stream, for one draft load."""

    plan: DraftPlan
    #: The draft this hold is for: vLLM's ``speculative_config.draft_model_config``.
    draft_model_config: Any
    #: The names to keep as the stream yields them (the plan's, this rank's, in budget).
    wanted: frozenset[str]
    budget: int
    #: Where its events go: the target's settings', then the draft's once it takes it.
    sink: Sink
    #: The settings the target's load made this hold (and its plan) with; the draft's load
    #: compares its own (``drafting.held``).
    settings: Settings
    #: Every tensor this rank's draft reads from it or storage: their names, and (the
    #: ``one_pass`` report's ``draft_tensors``/``draft_bytes``) how many and their bytes.
    needed: frozenset[str] = frozenset()
    draft_tensors: int = 0
    draft_bytes: int = 0
    tensors: dict[str, Any] = field(default_factory=dict)
    held_bytes: int = 0
    peak_bytes: int = 0
    taken: int = 0
    taken_bytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    released: bool = False
    #: Whether every held tensor is a copy (:func:`own`): a reload's weights iterator.
    copy: bool = False
    #: Whether the held tensors were checked against the versions the plan read.
    settled: bool = False
    #: The objects whose held tensors that check dropped, each with why.
    changed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        plan: DraftPlan,
        draft_model_config: Any,
        budget: int,
        skip: Callable[[str], bool],
        current: Settings,
        copy: bool = False,
    ) -> Self:
        """The hold for ``plan`` within ``budget``: what this rank's draft reads (not the
        replaced tensors, not what ``skip`` says no to), in file order, while it fits;
        ``copy``: every held tensor copied (:func:`own`)."""
        wanted = plan.reads(skip)
        return cls(
            plan=plan,
            draft_model_config=draft_model_config,
            wanted=frozenset(t.name for t in plan.holdable(budget, skip)),
            budget=budget,
            sink=current.sink,
            settings=current,
            needed=frozenset(t.name for t in wanted),
            draft_tensors=len(wanted),
            draft_bytes=sum(t.nbytes for t in wanted),
            copy=copy,
        )

    def report(self) -> records.OnePass:
        """The target decision's ``one_pass``: what this hold plans to keep."""
        by_name = {t.name: t for t in self.plan.kept}
        return records.OnePass(
            enabled=True,
            budget=self.budget,
            planned_tensors=len(self.wanted),
            planned_bytes=sum(by_name[n].nbytes for n in self.wanted),
            draft_tensors=self.draft_tensors,
            draft_bytes=self.draft_bytes,
        )

    def offer(self, name: str, tensor: Any) -> None:
        """Called for every tensor the target's stream yields: keep the draft's. A name the
        stream yields again (a reload's weights iterator may) is the later value, as the
        target's ``load_weights`` takes it: that one is kept, or none where it does not fit."""
        if name not in self.wanted or self.released:
            return
        earlier = self.tensors.pop(name, None)
        if earlier is not None:
            self.held_bytes -= nbytes(earlier)
        size = nbytes(tensor)
        if self.held_bytes + size > self.budget:
            return
        self.tensors[name] = own(tensor, self.copy)
        self.held_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def take(self, name: str) -> Any:
        """The held tensor ``name`` (None if it was not held); it is no longer held."""
        tensor = self.tensors.pop(name, None)
        if tensor is not None:
            size = nbytes(tensor)
            self.held_bytes -= size
            self.taken += 1
            self.taken_bytes += size
        return tensor

    def settle(self) -> None:
        """Once the target's stream is done: keep only the tensors it read from objects
        that are still the version the plan read (``objectstore.changed``); those of an
        object replaced, rewritten or truncated meanwhile (the stream may have read
        another version, or a mix) are dropped, and the draft reads them by its plan, which
        refuses a changed object. Once; local files are not checked here."""
        if self.settled:
            return
        self.settled = True
        if not self.tensors:  # nothing held (a session's pass holds nothing): nothing to check
            return
        where = {t.name: s for s in self.plan.shards for t in s.tensors}
        shards = {where[n].location: where[n] for n in self.tensors if n in where}
        self.changed = objectstore.changed(shards.values(), objectstore.Access.of(self.settings))
        for name in [n for n in self.tensors if n in where and where[n].location in self.changed]:
            self.held_bytes -= nbytes(self.tensors.pop(name))

    def summary(self) -> records.HoldFigures:
        """The ``one_pass`` figures of the events."""
        return records.HoldFigures(
            held_tensors=self.taken + len(self.tensors),
            held_bytes=self.taken_bytes + self.held_bytes,
            peak_bytes=self.peak_bytes,
            budget=self.budget,
            held_seconds=round(time.perf_counter() - self.started, 6),
        )

    def release(self, reason: str) -> None:
        """Drop every tensor still held (once), saying why."""
        if self.released:
            return
        self.released = True
        left, left_bytes = len(self.tensors), self.held_bytes
        self.tensors.clear()
        self.held_bytes = 0
        emit(
            "hybrid_draft.hold_released",
            sink=self.sink,
            reason=reason,
            released_tensors=left,
            released_bytes=left_bytes,
            **records.render(self.summary()),
        )


@dataclass
class Pass(Hold):
    """The draft's tensors as an update of its target passes them (a trainer's
    weight-transfer session, its direct ``load_weights`` calls): nothing is held. Each
    tensor of the draft's that the target's ``load_weights`` is given goes to the update's
    open step (``update.Step.take``), where it waits only until that call returns (the
    caller may free or refill its memory then), when the adapter stages it in the draft's
    own load."""

    #: The update's open step (None: none yet, or the update only reports).
    step: update.Step | None = None
    #: Every tensor the target's ``load_weights`` was given in the update (0: the engine
    #: wrote the target's parameters without it).
    offered: int = 0

    @classmethod
    def passing(
        cls,
        plan: DraftPlan,
        draft_model_config: Any,
        skip: Callable[[str], bool],
        current: Settings,
    ) -> Self:
        """The pass for ``plan``: every tensor this rank's draft reads (not the replaced
        ones, not what ``skip`` says no to), with no budget: nothing is kept."""
        made = cls.of(plan, draft_model_config, 0, skip, current)
        made.wanted = made.needed
        return made

    def report(self) -> records.OnePass:
        """The target decision's ``one_pass``: the draft's tensors the session may bring."""
        return records.OnePass(
            enabled=True, draft_tensors=self.draft_tensors, draft_bytes=self.draft_bytes
        )

    def offer(self, name: str, tensor: Any) -> None:
        """Called for every tensor the target's ``load_weights`` is given: the draft's go to
        the open step."""
        self.offered += 1
        step = self.step
        if step is not None and name in self.wanted and not step.ended:
            step.take(name, tensor, "target")

    def release(self, reason: str) -> None:
        """Nothing is held, and nothing to stop: the update's steps take what passes until
        its end (a step's own end, at a repeat, is a draft load's end too)."""


def free_memory(device: Any) -> int | None:
    """Bytes free on ``device`` now: the CUDA allocator's view, else the host's."""
    try:
        import torch

        if getattr(device, "type", str(device)).startswith("cuda") and torch.cuda.is_available():
            return int(torch.cuda.mem_get_info(device)[0])
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # unknown: the budget alone applies
        return None


def effective_budget(setting: int, free: int | None, target_bytes: int) -> int:
    """The budget for one hold: the setting, capped at a quarter of what the target's
    weights will leave free (safe on unified-memory hosts, where device memory is RAM)."""
    if free is None:
        return setting
    return max(0, min(setting, (free - target_bytes) // FREE_SHARE))
