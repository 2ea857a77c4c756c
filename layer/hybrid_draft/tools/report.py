"""``hybrid-draft report EVENTS_FILE``: what each model load of one server cost, and what the
draft's load saved against the second full pass of the checkpoint stock vLLM would make.

Reads the layer's JSONL events (any number of processes: API server, engine core, one
worker per rank). Each ``get_model`` call left a ``hybrid_draft.decision`` and then a
``hybrid_draft.loaded`` or ``hybrid_draft.load_failed`` event in its process; they are
paired in order per process. A second full pass would read every byte of the checkpoint
(``checkpoint_bytes``) and, being the same read as the target's, take about as long as the
target's load in that process: the savings are measured against those two figures.
Decisions that carry a ``rank`` are also compared across ranks (:func:`inconsistent`). A
reload of the weights in place (``trigger: "reload"``) is a load like the others, its draft
compared with its own target's reload; a reload's draft decision that reloaded nothing (the
draft kept its weights) is listed with its reason. So is a trainer's weight-transfer session
(``trigger: "weight_update"``): each session's model, with the chunks it took, and the draft
that took its tensors from its target's session (nothing read, nothing sent twice), or kept
its weights, saying why; and a trainer's direct ``load_weights`` calls on the target
(``trigger: "direct_update"``): each update's target with its calls and what ended it, and
the draft's share of those calls.
``smoke`` prints the same summary. A field of the wrong type (a list ``pid``, a string
``seconds``, a byte count that is not a number) reads as unknown (``?``, or null in
``--json``) rather than failing; the file is read as a stream, a regular file of at most
:data:`EVENTS_LIMIT` bytes whose lines over :data:`LINE_LIMIT` are skipped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from typing import Any

from hybrid_draft import files
from hybrid_draft.core import policy

#: The largest events file read (a server writes a few dozen lines per start).
EVENTS_LIMIT = 256 << 20
#: The longest line read as an event (the layer's own lines are under 10 kB).
LINE_LIMIT = 1 << 20
#: The most processes, and loads per process, the terminal rendering shows (``--json`` has
#: them all): a server has a handful; an events file of thousands is read, not printed.
SHOWN = 200
#: Fields that hold an object (the draft's ``sources``, the ``one_pass`` figures, a long
#: load's slowest stretch).
OBJECTS = ("sources", "one_pass", "slowest")
NUMBERS = (
    "seconds",
    "bytes_read",
    "network_bytes",
    "tensors",
    "shards",
    "checkpoint_shards",
    "checkpoint_bytes",
    "chunks",
    "chunk_seconds",
    "calls",
    "call_seconds",
    "draft_calls",
    "stalls",
    "longest_stall_seconds",
)

LOAD_KEYS = (
    "role",
    "model",
    "load_format",
    "tensor_filter",
    "trigger",
    "reload_source",
    "backend",
    "session",
    "weights_path",
    "ended_by",
    *NUMBERS,
    *OBJECTS,
)
#: The triggers of a load of weights already loaded: a reload in place, a session, a
#: trainer's direct calls.
RELOADS = ("reload", "weight_update", "direct_update")
#: Those whose draft takes its tensors as its target's update passes them (nothing read).
CARRIED = ("weight_update", "direct_update")


#: Where a draft's tensors came from (``sources`` of its ``loaded`` event), in words.
SOURCES = {
    "storage": "from storage",
    "stream": "from the target's stream",
    "replaced_by_target": "replaced by the target, not read",
}


def read(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON objects among ``lines`` (other output interleaved in a log is skipped, and so
    is a line that nests too deeply or is too large to parse)."""
    events = []
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except (ValueError, RecursionError, MemoryError):
                continue
            if isinstance(event, dict):
                events.append(event)
    return events


def _lines(path: str) -> Iterator[str]:
    for _, line in files.read_lines(path, EVENTS_LIMIT, LINE_LIMIT):
        yield line.decode("utf-8", errors="replace")


def read_file(path: str) -> list[dict[str, Any]]:
    """The events in the file at ``path`` (see the module doc for the limits); raises
    :class:`FileNotFoundError`, or :class:`hybrid_draft.files.FileProblem` naming the file."""
    return read(_lines(path))


def _number(value: Any) -> int | float | None:
    """A finite JSON number, else None (a string, a boolean, NaN...)."""
    if type(value) in (int, float) and math.isfinite(value):
        return value  # type: ignore[no-any-return]
    return None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _pid(value: Any) -> int | str | None:
    """A process key: the pid as written when it is a number or a string, else its JSON."""
    if value is None or (type(value) is int) or isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str)[:80]
    except (ValueError, RecursionError):
        return type(value).__name__


def _row(e: dict[str, Any]) -> dict[str, Any]:
    """The fields of a ``loaded``/``load_failed`` event, each of the type it should be."""
    row: dict[str, Any] = {}
    for key in LOAD_KEYS:
        value = e.get(key)
        if key in NUMBERS:
            row[key] = _number(value)
        elif key == "tensor_filter":
            row[key] = value if isinstance(value, bool) else None
        elif key in OBJECTS:
            row[key] = value if isinstance(value, dict) else None
        else:
            row[key] = _text(value)
    return row


def fetched(row: dict[str, Any]) -> int | float | None:
    """What a load took from where the weights are: storage bytes, plus the bytes it
    received from object storage (None: neither is known)."""
    known = [v for v in (row.get("bytes_read"), row.get("network_bytes")) if v is not None]
    return sum(known) if known else None


def _savings(draft: dict[str, Any], target: dict[str, Any] | None) -> dict[str, Any]:
    full = draft.get("checkpoint_bytes")
    read_bytes = fetched(draft)
    out: dict[str, Any] = {
        "full_pass_bytes": full,
        "bytes_read": read_bytes,
        "network_bytes": draft.get("network_bytes"),
        "bytes_saved": None,
        "share_read": None,
    }
    if full and read_bytes is not None:
        out["bytes_saved"] = max(full - read_bytes, 0)
        out["share_read"] = read_bytes / full
    same = target is not None and target.get("model") == draft.get("model")
    out["full_pass_seconds"] = target.get("seconds") if same and target is not None else None
    out["seconds"] = draft.get("seconds")
    out["seconds_saved"] = (
        round(out["full_pass_seconds"] - out["seconds"], 6)
        if same and out["seconds"] is not None and out["full_pass_seconds"] is not None
        else None
    )
    return out


def _kept_weights(e: dict[str, Any]) -> bool:
    """A reload's draft decision that left the draft's weights as they were (no ``loaded``
    event follows it)."""
    return (
        e.get("trigger") in RELOADS
        and e.get("role") == "draft"
        and e.get("reason") in policy.NOT_RELOADED
    )


#: What ranks of one server must agree on, per model and role.
AGREED = ("chosen_format", "action", "reason", "settings_fingerprint")


def _plain(value: Any) -> Any:
    """A hashable, comparable stand-in for any JSON value (wrong types included)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _rank(e: Any) -> int | None:
    """The integer ``rank`` of a decision event, else None."""
    if not isinstance(e, dict) or e.get("event") != "hybrid_draft.decision":
        return None
    rank = e.get("rank")
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def ranks(events: Iterable[Any]) -> list[int]:
    """Every rank that left a decision."""
    return sorted({r for r in map(_rank, events) if r is not None})


def inconsistent(events: Iterable[Any]) -> list[dict[str, Any]]:
    """Ranks that decided differently from the other ranks, per model and role (and, for a
    reload or a weight-transfer session, per reload of that kind, in order).

    Only ``hybrid_draft.decision`` events with an integer ``rank`` count. For each model and
    role, the decision most ranks took (:data:`AGREED`; a tie goes to the one of the lowest
    rank) is the reference, and every rank with another decision is listed in one entry,
    ``{"model", "role", "ranks", "detail"}``. Empty when all ranks agree.
    """
    seen: dict[tuple[Any, ...], dict[tuple[Any, ...], set[int]]] = {}
    # Each rank's reloads and sessions are compared in order: its n-th reload's decision with
    # every other rank's n-th (a server's ranks reload together).
    counts: dict[tuple[Any, ...], int] = {}
    for e in events:
        rank = _rank(e)
        if rank is None:
            continue
        trigger = _plain(e.get("trigger"))
        again = trigger not in (None, "load")
        base = (_plain(e.get("model")), _plain(e.get("role")), trigger if again else None)
        nth = counts.get((rank, *base), 0) if again else 0
        if again:
            counts[(rank, *base)] = nth + 1
        choice = tuple(_plain(e.get(k)) for k in AGREED)
        seen.setdefault((*base, nth), {}).setdefault(choice, set()).add(rank)
    out = []
    for (model, role, trigger, nth), choices in seen.items():
        if len(choices) < 2:
            continue
        ordered = sorted(choices.items(), key=lambda c: (-len(c[1]), min(c[1])))
        reference = ordered[0][0]
        odd = sorted({r for _, members in ordered[1:] for r in members})
        parts = [
            f"rank(s) {_ranks(sorted(members))}: "
            + ", ".join(f"{k}={v}" for k, v in zip(AGREED, choice, strict=True))
            for choice, members in ordered
        ]
        detail = "; ".join(parts)
        if trigger is not None:
            detail = f"{trigger} {nth + 1}: {detail}"
        if any(r in choices[reference] for r in odd):
            detail += " (a rank decided more than once, differently)"
        out.append({"model": model, "role": role, "ranks": odd, "detail": detail})
    return out


def summarize(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Per process: its loads in order (with the decision that preceded each), failures,
    and for each draft load what it saved against a second full pass; and the ranks whose
    decision differs from the other ranks' (``inconsistent``)."""
    events = list(events)
    processes: dict[Any, dict[str, Any]] = {}
    pending: dict[Any, dict[str, Any]] = {}

    def process(pid: Any) -> dict[str, Any]:
        return processes.setdefault(
            pid, {"pid": pid, "loads": [], "failures": [], "not_reloaded": []}
        )

    for e in events:
        kind, pid = e.get("event"), _pid(e.get("pid"))
        if kind == "hybrid_draft.decision":
            if _kept_weights(e):  # a reload that reloaded nothing: no loaded event follows
                process(pid)["not_reloaded"].append(
                    {
                        "role": _text(e.get("role")),
                        "model": _text(e.get("model")),
                        "trigger": _text(e.get("trigger")),
                        "reload_source": _text(e.get("reload_source")),
                        "backend": _text(e.get("backend")),
                        "reason": _text(e.get("reason")),
                        "detail": _text(e.get("detail")),
                    }
                )
                continue
            pending[pid] = e
            continue
        if kind not in ("hybrid_draft.loaded", "hybrid_draft.load_failed"):
            continue
        proc = process(pid)
        row = _row(e)
        decision = pending.pop(pid, None)
        if decision is not None and _text(decision.get("role")) == row["role"]:
            row.update(
                action=_text(decision.get("action")),
                reason=_text(decision.get("reason")),
                mode=_text(decision.get("mode")),
            )
        if kind == "hybrid_draft.loaded":
            proc["loads"].append(row)
        else:
            proc["failures"].append(
                {
                    **row,
                    "error_type": _text(e.get("error_type")),
                    "error": _text(e.get("error")),
                    "stopped": e.get("reason") == "stalled",  # by the layer: load_timeout
                }
            )
    for proc in processes.values():
        target = None  # each draft against the target load before it (a reload's, its own)
        for row in proc["loads"]:
            if row["role"] == "target":
                target = row
            elif row["role"] == "draft" and row.get("trigger") not in CARRIED:
                row["vs_full_pass"] = _savings(row, target)
    return {
        "processes": list(processes.values()),
        "loads": sum(len(p["loads"]) for p in processes.values()),
        "failures": sum(len(p["failures"]) for p in processes.values()),
        "ranks": ranks(events),
        "inconsistent": inconsistent(events),
    }


def _bytes(value: Any) -> str:
    n = _number(value)
    if n is None:
        return "?"
    if n >= 1e9:
        return f"{n / 1e9:,.2f} GB"
    return f"{n / 1e6:,.2f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} kB"


def _num(value: Any, fmt: str = "{:,}") -> str:
    v = _number(value)
    return "?" if v is None else fmt.format(v)


def _consistency(summary: dict[str, Any]) -> list[str]:
    """One line per model and role whose ranks decided differently, else one line saying
    that the ranks agreed (when there are two or more)."""
    lines = [
        f"INCONSISTENT {entry.get('role')} {entry.get('model')}: rank(s) "
        f"{_ranks(entry.get('ranks') or [])} decided differently ({entry.get('detail')})"
        for entry in summary.get("inconsistent") or []
    ]
    ranks = summary.get("ranks") or []
    if not lines and len(ranks) > 1:
        lines.append(f"ranks {_ranks(ranks)}: every rank decided alike")
    return lines


def render(summary: dict[str, Any]) -> str:
    """The terminal rendering of :func:`summarize`."""
    if not summary["processes"]:
        # Decisions without loads (a load that never returned) still say whether ranks agreed.
        return "\n".join(
            [
                "no model loads in these events (no hybrid_draft.loaded or load_failed event)",
                *_consistency(summary),
            ]
        )
    from hybrid_draft.tools import tables

    columns = [
        ("role", "left"),
        ("format", "left"),
        ("seconds", "right"),
        ("read", "right"),
        ("tensors", "right"),
        ("shards", "right"),
        ("decision", "left"),
    ]
    lines = []
    for proc in summary["processes"][:SHOWN]:
        lines.append(f"process {proc['pid']}")
        rows = []
        for row in proc["loads"][:SHOWN]:
            fmt = row["load_format"] or "?"
            role = row["role"] or "?"
            if row.get("trigger") == "reload":
                role += f" (reload: {row.get('reload_source') or '?'})"
            elif row.get("trigger") == "weight_update":
                role += f" (weight update: {_session(row)})"
            elif row.get("trigger") == "direct_update":
                role += f" (direct update: ended by {row.get('ended_by') or '?'})"
            if row.get("tensor_filter"):
                fmt += " (filtered)"
            shards = (
                f"{_num(row['shards'])}/{_num(row['checkpoint_shards'])}"
                if row["shards"] is not None
                else "?"
            )
            decision = f"{row.get('action')} ({row.get('reason')})" if row.get("reason") else ""
            rows.append(
                [
                    role,
                    fmt,
                    _num(row["seconds"], "{:.2f}"),
                    _bytes(row["bytes_read"])
                    if row["network_bytes"] is None
                    else f"{_bytes(row['network_bytes'])} (network)",
                    _num(row["tensors"]),
                    shards,
                    decision,
                ]
            )
        lines.append(tables.render(columns, rows, indent=2))
        if len(proc["loads"]) > SHOWN:
            lines.append(f"  ... {len(proc['loads']) - SHOWN} more load(s) (--json has them all)")
        for row in proc["loads"][:SHOWN]:
            src = row.get("sources")
            if isinstance(src, dict) and all(isinstance(src.get(k), dict) for k in SOURCES):
                lines.append(
                    "  draft sources: "
                    + ", ".join(
                        f"{_num(src[k].get('tensors'))} tensors ({_bytes(src[k].get('bytes'))}) "
                        f"{what}"
                        for k, what in SOURCES.items()
                    )
                )
        for row in proc["loads"][:SHOWN]:
            s = row.get("vs_full_pass")
            if not s:
                continue
            how = "read" if s["network_bytes"] is None else "fetched, over the network too,"
            text = (
                f"  draft vs a second full pass: {how} {_bytes(s['bytes_read'])} of "
                f"{_bytes(s['full_pass_bytes'])}"
            )
            if s["share_read"] is not None:
                text += f" ({s['share_read']:.1%}), {_bytes(s['bytes_saved'])} not read"
            if s["seconds_saved"] is not None:
                text += (
                    f"; {s['seconds']:.2f} s against the target's "
                    f"{s['full_pass_seconds']:.2f} s ({s['seconds_saved']:+.2f} s saved)"
                )
            lines.append(text)
        for row in proc["loads"][:SHOWN]:
            if row.get("trigger") in CARRIED and row["role"] == "draft":
                lines.append(_carried(row))
        for row in [*proc["loads"][:SHOWN], *proc["failures"][:SHOWN]]:
            said = _watched(row)
            if said:
                lines.append(said)
        for row in proc["not_reloaded"][:SHOWN]:
            if row.get("trigger") == "weight_update":
                what = f"weight update ({row['backend'] or '?'})"
            elif row.get("trigger") == "direct_update":
                what = "direct update"
            else:
                what = f"reload ({row['reload_source'] or '?'})"
            lines.append(
                f"  {what}: the {row['role'] or '?'} kept its "
                f"weights ({row['reason']}): {files.one_line(str(row['detail']), 2000)}"
            )
        for row in proc["failures"][:SHOWN]:
            lines.append(
                f"  FAILED {row['role'] or '?'} load ({row['load_format']}) after "
                f"{_num(row['seconds'], '{:.2f}')} s: {row['error_type']}: "
                f"{files.one_line(str(row['error']), 2000)}"
            )
    if len(summary["processes"]) > SHOWN:
        more = len(summary["processes"]) - SHOWN
        lines.append(f"... {more} more process(es) (--json has them all)")
    lines.extend(_consistency(summary))
    lines.append(
        f"{summary['loads']} load(s), {summary['failures']} failed, in "
        f"{len(summary['processes'])} process(es)"
    )
    return "\n".join(lines)


def _watched(row: dict[str, Any]) -> str | None:
    """A load's stalls and its slowest stretch, where the watcher saw them (None: neither)."""
    parts = []
    if row.get("stalls"):
        parts.append(
            f"{_num(row['stalls'])} stall(s), the longest "
            f"{_num(row.get('longest_stall_seconds'), '{:.1f}')} s"
        )
    slow = row.get("slowest")
    if isinstance(slow, dict) and _number(slow.get("bytes_per_s")) is not None:
        parts.append(
            f"its slowest stretch {_bytes(slow.get('bytes_per_s'))}/s for "
            f"{_num(slow.get('seconds'), '{:.1f}')} s from "
            f"{_num(slow.get('at_seconds'), '{:.1f}')} s"
        )
    if not parts:
        return None
    stopped = " (stopped: load_timeout)" if row.get("stopped") else ""
    return f"  {row['role'] or '?'} ({row.get('trigger') or 'load'}){stopped}: {'; '.join(parts)}"


def _carried(row: dict[str, Any]) -> str:
    """A draft's line for an update of its target that carried its tensors: a session's
    chunks, or a trainer's direct calls."""
    src = row.get("sources") or {}
    stream, stored = src.get("stream"), src.get("storage")
    took: dict[str, Any] = stream if isinstance(stream, dict) else {}
    read: dict[str, Any] = stored if isinstance(stored, dict) else {}
    at_end = f"{_num(row['seconds'], '{:.2f}')} s at the"
    if row.get("trigger") == "weight_update":
        return (
            f"  weight update ({_session(row)}): the draft took "
            f"{_num(took.get('tensors'))} tensors ({_bytes(took.get('bytes'))}) from "
            f"{_num(row.get('chunks'))} chunk(s) of its target's session, nothing sent "
            f"or read twice: {_num(row.get('chunk_seconds'), '{:.2f}')} s in the "
            f"chunks, {at_end} session's end"
        )
    also = (
        f"; {_num(read.get('tensors'))} more read from {row.get('weights_path') or '?'}"
        if read.get("tensors")
        else ""
    )
    return (
        f"  direct update (ended by {row.get('ended_by') or '?'}): the draft took "
        f"{_num(took.get('tensors'))} tensors from {_num(row.get('calls'))} of its target's "
        f"direct load_weights call(s) ({_bytes(took.get('bytes'))}, "
        f"{_num(row.get('draft_calls'))} of the caller's own calls on the draft){also}, "
        f"nothing loaded twice: {_num(row.get('call_seconds'), '{:.2f}')} s in the calls, "
        f"{at_end} update's end"
    )


def _session(row: dict[str, Any]) -> str:
    """A session's backend, and whose session it was (the target's, or vLLM's draft one)."""
    return f"{row.get('backend') or '?'}, {row.get('session') or '?'} session"


def text(events: Iterable[dict[str, Any]]) -> str:
    """The summary of ``events`` as printed by ``report`` and at the end of ``smoke``."""
    return render(summarize(events))
