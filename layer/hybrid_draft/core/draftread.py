"""What one draft load reads, handed from the layer's decision to its registered loader.

No vLLM import: the decision (``drafting``) makes a :class:`DraftRead`, the load opens
:func:`reading` around vLLM's ``get_model``, and the loader (``model_loader/``) takes it
with :func:`current` when vLLM calls its ``load_weights``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

from hybrid_draft.core import hold, objectstore, planning
from hybrid_draft.events import Sink


@dataclass(kw_only=True)
class DraftRead:
    """What one draft load takes from where: its plan, the hold it draws on, what it skips.

    Made by the layer when it decides the load (``patch``), handed to the loader through
    :func:`reading`; the loader fills ``sources``.
    """

    plan: planning.DraftPlan
    #: Where its events go (the load's settings').
    sink: Sink
    hold: hold.Hold | None = None
    #: The draft's pipeline-parallel size and speculative method (what vLLM's
    #: replacement depends on), from the configs the load was decided with.
    pipeline_parallel_size: int = 1
    method: str | None = "mtp"
    #: How its requests to object storage are bounded (the load's settings').
    access: objectstore.Access = field(default_factory=objectstore.Access)
    #: Filled by the load: ``planning.DraftPlan.sources`` keys, as read.
    sources: dict[str, dict[str, int]] = field(default_factory=dict)
    #: The replaced tensors skipped, by name -> kind (after the built model was checked).
    skipped: dict[str, str] = field(default_factory=dict)

    def skip(self, kinds: Iterable[str]) -> None:
        """Skip the plan's replaced tensors of ``kinds`` (the built model's modules that are
        the target's), counting them as ``replaced_by_target``."""
        present = set(kinds)
        if not self.sources:
            self.sources = empty_sources()
        self.skipped = {n: k for n, k in self.plan.replaced.items() if k in present}
        sizes = {t.name: t.nbytes for t in self.plan.kept}
        self.sources["replaced_by_target"] = {
            "tensors": len(self.skipped),
            "bytes": sum(sizes[n] for n in self.skipped),
        }


def empty_sources() -> dict[str, dict[str, int]]:
    """``sources`` before a load: nothing from anywhere yet."""
    return {k: {"tensors": 0, "bytes": 0} for k in ("storage", "stream", "replaced_by_target")}


_READ: ContextVar[DraftRead | None] = ContextVar("hybrid_draft_draft_read", default=None)


@contextlib.contextmanager
def reading(read: DraftRead | None) -> Iterator[None]:
    """While open, this layer's loaders read the draft by ``read``."""
    token = _READ.set(read)
    try:
        yield
    finally:
        _READ.reset(token)


def current() -> DraftRead | None:
    """The read :func:`reading` opened in this context, if any."""
    return _READ.get()
