"""``hybrid-draft report EVENTS_FILE``: what each model load of one server cost, and what the
draft's load saved against the second full pass of the checkpoint stock vLLM would make.

Reads the layer's JSONL events (any number of processes: API server, engine core, one
worker per rank). Each ``get_model`` call left a ``hybrid_draft.decision`` and then a
``hybrid_draft.loaded`` or ``hybrid_draft.load_failed`` event in its process; they are
paired in order per process. A second full pass would read every byte of the checkpoint
(``checkpoint_bytes``) and, being the same read as the target's, take about as long as the
target's load in that process: the savings are measured against those two figures.
Pure and stdlib-only: ``smoke`` prints the same summary.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

LOAD_KEYS = (
    "role",
    "model",
    "load_format",
    "tensor_filter",
    "seconds",
    "bytes_read",
    "tensors",
    "shards",
    "checkpoint_shards",
    "checkpoint_bytes",
    "sources",
    "one_pass",
)


#: Where a draft's tensors came from (``sources`` of its ``loaded`` event), in words.
SOURCES = {
    "storage": "from storage",
    "stream": "from the target's stream",
    "replaced_by_target": "replaced by the target, not read",
}


def read(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON objects among ``lines`` (other output interleaved in a log is skipped)."""
    events = []
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
    return events


def _savings(draft: dict[str, Any], target: dict[str, Any] | None) -> dict[str, Any]:
    full = draft.get("checkpoint_bytes")
    read_bytes = draft.get("bytes_read")
    out: dict[str, Any] = {
        "full_pass_bytes": full,
        "bytes_read": read_bytes,
        "bytes_saved": None,
        "share_read": None,
    }
    if full and read_bytes is not None:
        out["bytes_saved"] = max(full - read_bytes, 0)
        out["share_read"] = read_bytes / full
    same = target is not None and target.get("model") == draft.get("model")
    out["full_pass_seconds"] = target.get("seconds") if same else None
    out["seconds"] = draft.get("seconds")
    out["seconds_saved"] = (
        round(out["full_pass_seconds"] - out["seconds"], 6)
        if same and out["seconds"] is not None and out["full_pass_seconds"] is not None
        else None
    )
    return out


def summarize(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Per process: its loads in order (with the decision that preceded each), failures,
    and for each draft load what it saved against a second full pass."""
    processes: dict[Any, dict[str, Any]] = {}
    pending: dict[Any, dict[str, Any]] = {}
    for e in events:
        kind, pid = e.get("event"), e.get("pid")
        if kind == "hybrid_draft.decision":
            pending[pid] = e
            continue
        if kind not in ("hybrid_draft.loaded", "hybrid_draft.load_failed"):
            continue
        proc = processes.setdefault(pid, {"pid": pid, "loads": [], "failures": []})
        row = {k: e.get(k) for k in LOAD_KEYS}
        decision = pending.pop(pid, None)
        if decision is not None and decision.get("role") == e.get("role"):
            row.update(
                action=decision.get("action"),
                reason=decision.get("reason"),
                mode=decision.get("mode"),
            )
        if kind == "hybrid_draft.loaded":
            proc["loads"].append(row)
        else:
            proc["failures"].append(
                {**row, "error_type": e.get("error_type"), "error": e.get("error")}
            )
    for proc in processes.values():
        target = next((r for r in proc["loads"] if r["role"] == "target"), None)
        for row in proc["loads"]:
            if row["role"] == "draft":
                row["vs_full_pass"] = _savings(row, target)
    return {
        "processes": list(processes.values()),
        "loads": sum(len(p["loads"]) for p in processes.values()),
        "failures": sum(len(p["failures"]) for p in processes.values()),
    }


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= 1e9:
        return f"{n / 1e9:,.2f} GB"
    return f"{n / 1e6:,.2f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} kB"


def _num(v: Any, fmt: str = "{:,}") -> str:
    return "?" if v is None else fmt.format(v)


def render(summary: dict[str, Any]) -> str:
    """The terminal rendering of :func:`summarize`."""
    if not summary["processes"]:
        return "no model loads in these events (no hybrid_draft.loaded or load_failed event)"
    lines = []
    for proc in summary["processes"]:
        lines.append(f"process {proc['pid']}")
        lines.append(
            f"  {'role':<7}{'format':<24}{'seconds':>9}{'read':>13}{'tensors':>9}"
            f"{'shards':>10}  decision"
        )
        for row in proc["loads"]:
            fmt = row["load_format"] or "?"
            if row.get("tensor_filter"):
                fmt += " (filtered)"
            shards = (
                f"{row['shards']}/{row['checkpoint_shards']}" if row["shards"] is not None else "?"
            )
            decision = f"{row.get('action')} ({row.get('reason')})" if row.get("reason") else ""
            lines.append(
                f"  {row['role'] or '?':<7}{fmt:<24}{_num(row['seconds'], '{:.2f}'):>9}"
                f"{_bytes(row['bytes_read']):>13}{_num(row['tensors']):>9}"
                f"{shards:>10}  {decision}"
            )
        for row in proc["loads"]:
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
        for row in proc["loads"]:
            s = row.get("vs_full_pass")
            if not s:
                continue
            text = (
                f"  draft vs a second full pass: read {_bytes(s['bytes_read'])} of "
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
        for row in proc["failures"]:
            lines.append(
                f"  FAILED {row['role'] or '?'} load ({row['load_format']}) after "
                f"{_num(row['seconds'], '{:.2f}')} s: {row['error_type']}: "
                f"{row['error']}"
            )
    lines.append(
        f"{summary['loads']} load(s), {summary['failures']} failed, in "
        f"{len(summary['processes'])} process(es)"
    )
    return "\n".join(lines)


def text(events: Iterable[dict[str, Any]]) -> str:
    """The summary of ``events`` as printed by ``report`` and at the end of ``smoke``."""
    return render(summarize(events))
