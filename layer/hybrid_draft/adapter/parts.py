"""The layer's parts in this process: which are on, once per process (:func:`installed`).

``internals`` probes every private vLLM name the layer's parts rely on, by shape; here a part
whose names are missing or of another shape is switched off with a
``hybrid_draft.part_skipped`` event naming them (and the shapes found), the loads are
instrumented (``stats``) and the layer's load formats registered. Its drafts then load on
vLLM's own path. Everything that asks whether a part is on asks :func:`part_off`.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

from hybrid_draft import settings
from hybrid_draft.adapter import internals, stats
from hybrid_draft.adapter.internals import MODULE
from hybrid_draft.events import emit


@dataclasses.dataclass(frozen=True)
class Installed:
    """What the hook installed in this process: the parts on (those whose private vLLM names
    have the shapes the layer uses and which installed cleanly), and why load figures are
    not collected (None: they are)."""

    capabilities: internals.Capabilities
    unmeasured: str | None = None


def _part_skipped(caps: internals.Capabilities, part: str) -> None:
    _say_off(part, caps.off[part])


def _say_off(part: str, off: internals.Off) -> None:
    shapes: dict[str, Any] = {"shapes": dict(off.shapes)} if off.shapes else {}
    emit(
        "hybrid_draft.part_skipped",
        "warning",
        sink=settings.process_sink(),
        vllm_version=internals.vllm_version(),
        part=part,
        missing=list(off.missing),
        reason=off.reason,
        **shapes,
    )


@functools.cache
def measured() -> str | None:
    """Instrument vLLM's default loader for the load figures, once per process; None, or
    why the figures are not collected. Emits nothing (a deferred ``patched`` asks it)."""
    unshaped = [
        why
        for why in map(internals.problem, (internals.GET_ALL_WEIGHTS, internals.PREPARE_WEIGHTS))
        if why is not None
    ]
    if unshaped:
        return "; ".join(unshaped)
    try:
        return stats.instrument(sys.modules[f"{MODULE}.default_loader"])
    except Exception as exc:  # load figures are a report, never a reason to stop
        return f"{type(exc).__name__}: {exc}"


@functools.cache
def installed() -> Installed:
    """Switch off each part whose private vLLM names this vLLM lacks or has in another
    shape, saying which; instrument the loads; take what registering the layer's load
    formats at the hook left. Once per process, at its first load (or when ``doctor``
    asks): the hook itself only wraps and registers, so importing vLLM stays cheap."""
    caps = internals.capabilities()
    for part in caps.off:
        _part_skipped(caps, part)
    unmeasured = measured()
    if unmeasured:
        caps = caps.without("one_pass", unmeasured)
    if caps.reason("runai_stream") is None:
        try:
            stats.instrument_runai(sys.modules[internals.RUNAI_ITERATOR.path.partition(":")[0]])
        except Exception as exc:  # its targets load as vLLM loads them, unmeasured
            caps = caps.without("runai_stream", f"{type(exc).__name__}: {exc}")
            _part_skipped(caps, "runai_stream")
    from hybrid_draft.adapter import loaders

    for part, failure in loaders.register_all().items():
        if caps.reason(part) is None:
            caps = caps.without(part, failure)
            _part_skipped(caps, part)
    return Installed(caps, unmeasured)


#: The late parts found off in this process, with why (each said once per reason).
_LATE_SAID: dict[str, str] = {}


def part_off(part: str) -> str | None:
    """Why ``part`` is off in this process (None: it is on). A part probed at each use
    (``internals.LATE``) is probed now, and said off once per process and reason."""
    if part not in internals.LATE:
        return installed().capabilities.reason(part)
    off, _ = internals.late_part(part)
    return _said(part, off)


def reload_off(runner: str) -> tuple[str | None, str]:
    """Why the ``reload`` part is off for the model runner class ``runner`` (None: on),
    probed now and said off once per process and reason; and the label of the layout a
    reload takes there."""
    off, label = internals.reload_layout(runner)
    return _said("reload", off), label


def late_off(part: str) -> tuple[str | None, str]:
    """Why the late ``part`` is off (None: on), probed now and said off once per process and
    reason; and the label of the layout it is on by (``weight_update``: a session's draft
    update; ``direct_update``: a direct update's)."""
    off, label = internals.late_part(part)
    return _said(part, off), label


def _said(part: str, off: internals.Off | None) -> str | None:
    if off is None:
        return None
    if _LATE_SAID.get(part) != off.reason:
        _LATE_SAID[part] = off.reason
        _say_off(part, off)
    return off.reason


@dataclasses.dataclass(frozen=True)
class State:
    """One part as ``hybrid-draft doctor`` lists it: on (by which layout, when it has
    several) or off, and why."""

    part: str
    on: bool
    detail: str


def states() -> list[State]:
    """Every part of the layer, on or off here and why, probing this vLLM as it is now
    (nothing is installed, no event is emitted)."""
    caps = installed().capabilities if installed.cache_info().currsize else None
    caps = caps or internals.capabilities()
    out = []
    for part, layouts in internals.PARTS.items():
        if part in internals.LATE:
            off, label = internals.late_part(part)
            why = off.reason if off is not None else None
        else:
            why, label = caps.reason(part), caps.layouts.get(part, "")
        if why is not None:
            out.append(State(part, False, why))
            continue
        detail = [f"by {label}" if label else "every name in the shape the layer uses"]
        detail += [
            f"{n.path.rpartition(':')[2]}({', '.join(caps.params[n.path])})"
            for lay in layouts
            for n in lay.names
            if n.path in caps.params
        ]
        out.append(State(part, True, "; ".join(detail)))
    return out


def check_parts() -> Installed:
    """Probe this vLLM anew and install again (for a process whose vLLM changed)."""
    internals.capabilities.cache_clear()
    measured.cache_clear()
    installed.cache_clear()
    return installed()
