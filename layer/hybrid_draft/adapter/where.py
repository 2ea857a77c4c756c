"""Where a load happens: the host, the global rank, and the settings it decided with.

Every ``hybrid_draft.decision`` and ``hybrid_draft.loaded``/``load_failed`` event carries
one :class:`~hybrid_draft.records.Where`, made once per load by :func:`of`, so that
``hybrid-draft report`` can tell the ranks of one server apart and say which decided
differently. The rank is read from what is already initialised (vLLM's world group, else
``torch.distributed``) and nothing is ever initialised or imported here: a process outside
a distributed group has rank null. Settings are never read here: the load's are passed in.
"""

from __future__ import annotations

import sys

from hybrid_draft import records, settings
from hybrid_draft.adapter import internals


def node() -> str:
    """This host's name."""
    return settings.this_node()


def rank() -> int | None:
    """This process's global rank, or None outside an initialised distributed group."""
    value = internals.world_rank()
    if value is not None:
        return value
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # a half-torn-down group: no rank rather than no event
        pass
    return None


def of(current: settings.Settings | None) -> records.Where:
    """This process's place, with the load's settings (None: they are invalid)."""
    return records.Where(
        node=node(),
        rank=rank(),
        settings_fingerprint=current.fingerprint() if current is not None else None,
        settings_from=(
            current.carried_from
            if current is not None and current.carried_from is not None
            else records.ABSENT
        ),
    )
