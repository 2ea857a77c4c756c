"""One draft load's tensors: the held ones from memory, the rest from storage, counted.

No vLLM import. Given the draft's :class:`~hybrid_draft.core.draftread.DraftRead` (its
plan, the one-pass hold it draws on, the replaced tensors it skips) and a reader of the
target's format (``core/readers.py``), :func:`weights` yields every tensor the draft needs,
each counted in ``read.sources`` where it came from. The adapter's loader classes hand the
result to vLLM's ``load_weights``; ``tools/bench`` and ``scripts/gpu-check.sh`` drive the
same function on their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hybrid_draft.core import checkpoint, planning
from hybrid_draft.core.draftread import DraftRead
from hybrid_draft.core.draftread import empty_sources as empty_sources
from hybrid_draft.core.hold import nbytes
from hybrid_draft.core.readers import Weights

#: A reader of the target's format: a selection in, its tensors out.
Reader = Callable[[checkpoint.Selection], Weights]


@dataclass(frozen=True)
class Reads:
    """What one draft load takes from the hold, and what storage must give."""

    #: The names taken from the hold, in the plan's (file) order.
    taking: tuple[str, ...]
    #: The rest: the kept tensors less the held, the replaced and the ``skip``\\ ped ones.
    selection: checkpoint.Selection


def reads(read: DraftRead, skip: Callable[[str], bool] = lambda _name: False) -> Reads:
    """Split the draft's read between its hold and storage; ``skip`` says no to a tensor
    this rank never loads (another rank's experts, by vLLM's own filter)."""
    held = read.hold
    if held is not None:
        held.settle()  # only what the target read of the planned versions is taken
    taking = tuple(
        t.name
        for t in read.plan.kept
        if held is not None
        and t.name in held.tensors
        and t.name not in read.skipped
        and not skip(t.name)
    )
    from_hold = set(taking)
    selection = read.plan.selection(skip=lambda n: n in from_hold or skip(n), replaced=read.skipped)
    return Reads(taking, selection)


def weights(read: DraftRead, planned: Reads, reader: Reader) -> Weights:
    """The held tensors first (each released from the hold as it is taken), then what
    storage gives; a tensor released from the hold meanwhile is read from storage after
    all. Each is counted in ``read.sources``."""
    sources = read.sources or empty_sources()
    read.sources = sources
    missed = []
    for name in planned.taking:
        tensor = read.hold.take(name) if read.hold is not None else None
        if tensor is None:
            missed.append(name)
            continue
        _add(sources["stream"], tensor)
        yield name, tensor
    if missed:
        yield from counted(read, reader(by_name(read.plan, missed)))
    if planned.selection.files:
        yield from counted(read, reader(planned.selection))


def by_name(plan: planning.DraftPlan, names: Iterable[str]) -> checkpoint.Selection:
    """The selection of the named checkpoint tensors (a skipped tensor's fallback, a
    released held one)."""
    wanted = set(names)
    return checkpoint.selection(plan.shards, lambda t: t.name in wanted)


def counted(read: DraftRead, weights: Iterable[tuple[str, Any]]) -> Weights:
    """``weights``, each counted as read from storage."""
    sources = read.sources or empty_sources()
    read.sources = sources
    for name, tensor in weights:
        _add(sources["storage"], tensor)
        yield name, tensor


def _add(counts: dict[str, int], tensor: Any) -> None:
    counts["tensors"] += 1
    counts["bytes"] += nbytes(tensor)
