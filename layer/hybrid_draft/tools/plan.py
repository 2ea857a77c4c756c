"""``hybrid-draft plan MODEL_DIR``: what a same-checkpoint MTP draft of a checkpoint reads under
each mode, from its config and shard headers alone (no weights read), and its rendering."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def run(args: argparse.Namespace) -> int:
    import gc

    # 92,000 header entries in a process holding vLLM: the cyclic GC would rescan the heap
    # many times over (it doubles the plan's time); planning needs none.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan_checkpoint(args)
    finally:
        if enabled:
            gc.enable()


def _plan_checkpoint(args: argparse.Namespace) -> int:
    import os

    from hybrid_draft import checkpoint, files, settings

    if os.path.isdir(args.model_dir):  # a config.json that cannot be read: before vLLM loads
        try:
            checkpoint.read_json(args.model_dir, checkpoint.CONFIG_NAME, checkpoint.CONFIG_LIMIT)
        except FileNotFoundError:
            pass  # said below, as the draft's config
        except checkpoint.CheckpointError as exc:
            print(f"hybrid-draft plan: {files.one_line(str(exc), 2000)}", file=sys.stderr)
            return 2
    from hybrid_draft.tools import draftinfo, modes

    current, _ = settings.load_lenient()  # what the load would do here, else the defaults
    skip = bool(current.skip_replaced.value) if current else True
    budget = int(current.hold_budget.value) if current else settings.DEFAULT_HOLD_BUDGET
    try:  # every shard checked as safetensors checks it, inside the model directory
        plan = draftinfo.for_model_dir(
            args.model_dir, trust_remote_code=args.trust_remote_code, skip_replaced=skip
        )
    except (OSError, checkpoint.CheckpointError, draftinfo.PlanError) as exc:
        print(f"hybrid-draft plan: {files.one_line(str(exc), 2000)}", file=sys.stderr)
        return 2
    result = modes.report(plan, args.model_dir, hold_budget=budget)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


def _gb(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"


def table(result: dict[str, Any]) -> str:
    """The human rendering of :func:`report`."""
    from hybrid_draft.tools import tables

    ck = result["checkpoint"]
    auto = result["auto"]
    filtered = ""
    if "tensor_filter" in auto:
        filtered = f", tensor filter {'on' if auto['tensor_filter'] else 'off'}"
    lines = [
        f"checkpoint   {result['model_dir']}: {ck['shards']} shards, {ck['tensors']:,} "
        f"tensors, {_gb(ck['bytes'])}",
        f"draft class  {result['draft_class']}  (weight rule: {result['rule_source']})",
        f"auto         {auto['action']} ({auto['reason']}) -> {auto['chosen_format']}{filtered}",
    ]
    replaced = result.get("replaced_by_target") or {}
    if replaced.get("tensors"):
        lines.append(
            f"replaced     by the target: {replaced['tensors']} tensors, "
            f"{_gb(replaced['bytes'])} ({', '.join(replaced['modules'])}), never read"
        )
    one_pass = result["modes"].get("one_pass")
    if one_pass:
        stream = one_pass["stream"]
        lines.append(
            f"one pass     {stream['tensors']} tensors, {_gb(stream['bytes'])} taken from "
            f"the target's InstantTensor pass (hold budget {_gb(one_pass['hold_budget'])})"
        )
    for i, w in enumerate(result.get("warnings", [])):
        lines.append(f"{'warning' if i == 0 else '':<13}{w['code']}: {w['detail']}")
    rows = []
    for name, r in result["modes"].items():
        tensors = "?" if r["tensors"] is None else f"{r['tensors']:,}"
        share = (
            "?"
            if r["bytes"] is None
            else (f"{r['bytes'] / ck['bytes']:.2%}" if ck["bytes"] else f"{0:.2%}")
        )
        note = f"fallback: {r['fallback']}" if r.get("fallback") else ""
        touched = f"{r['touched_tensors']:,}"
        rows.append([name, len(r["shards"]), tensors, _gb(r["bytes"]), share, touched, note])
    columns = [
        ("mode", "left"),
        ("shards", "right"),
        ("tensors", "right"),
        ("bytes read", "right"),
        ("of checkpoint", "right"),
        ("touched", "right"),
        ("", "left"),
    ]
    lines += ["", tables.render(columns, rows)]
    for name, r in result["modes"].items():
        if r.get("fallback"):
            lines.append(f"{name} falls back to the auto row here: {r['detail']}")
    lines.append(
        "(a row touching more tensors than it keeps also reads up to ~2 readahead "
        "windows of each one it does not keep; ?: only the class's load_weights "
        "knows)"
    )
    return "\n".join(lines)
