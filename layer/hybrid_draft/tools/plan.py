"""``hybrid-draft plan MODEL_DIR``: what a same-checkpoint MTP draft of a checkpoint reads under
each mode, from its config and shard headers alone (no weights read), and its rendering.

``MODEL_DIR`` may be an object-storage address (``s3://``, ``gs://``, ``az://``), planned as a
Run:ai target's draft is: its JSON files copied to a temporary directory, its shard headers
read by ranged requests, within ``--timeout`` seconds."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

#: What names each object store's endpoint, for the line of one that does not answer.
_ENDPOINT_ENV = {
    "s3": "AWS_ENDPOINT_URL",
    "gs": "STORAGE_EMULATOR_HOST (CLOUD_STORAGE_EMULATOR_ENDPOINT)",
    "az": "AZURE_STORAGE_CONNECTION_STRING (AZURE_STORAGE_ACCOUNT_NAME)",
}


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


def _fail(message: str) -> int:
    from hybrid_draft import files

    print(f"hybrid-draft plan: {files.one_line(message, 2000)}", file=sys.stderr)
    return 2


def _plan_checkpoint(args: argparse.Namespace) -> int:
    import os

    from hybrid_draft import settings
    from hybrid_draft.core import checkpoint, figures, policy

    remote = figures.is_object_uri(args.model_dir)
    load_format = args.load_format or (policy.RUNAI_STREAMER if remote else policy.INSTANTTENSOR)
    if remote and load_format != policy.RUNAI_STREAMER:
        return _fail(
            f"{args.model_dir}: only the Run:ai Model Streamer reads object storage "
            f"(--load-format {policy.RUNAI_STREAMER}); --load-format {load_format} reads a "
            "local directory or a hub download"
        )
    if os.path.isdir(args.model_dir):  # a config.json that cannot be read: before vLLM loads
        try:
            checkpoint.read_json(args.model_dir, checkpoint.CONFIG_NAME, checkpoint.CONFIG_LIMIT)
        except FileNotFoundError:
            pass  # said below, as the draft's config
        except checkpoint.CheckpointError as exc:
            return _fail(str(exc))
    from hybrid_draft.tools import draftinfo, modes

    current, _ = settings.load_lenient()  # what the load would do here, else the defaults
    skip = bool(current.skip_replaced.value) if current else True
    budget = int(current.hold_budget.value) if current else settings.DEFAULT_HOLD_BUDGET
    try:  # every shard checked as safetensors checks it, inside the model directory
        if remote:
            plan = _remote(args, skip, current)
        else:
            plan = draftinfo.for_model_dir(
                args.model_dir, trust_remote_code=args.trust_remote_code, skip_replaced=skip
            )
    except (OSError, checkpoint.CheckpointError, draftinfo.PlanError) as exc:
        return _fail(str(exc))
    result = modes.report(plan, args.model_dir, hold_budget=budget, load_format=load_format)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


def _remote(args: argparse.Namespace, skip_replaced: bool, current: Any) -> Any:
    """The plan of an object-storage checkpoint, or exit status 2 once ``--timeout`` passes
    without an answer (the storage client's own retries may take minutes). Each header
    request is bounded as a load's are (the ``object_storage`` settings)."""
    import os
    import shutil
    import tempfile
    import threading

    from hybrid_draft.core import objectstore
    from hybrid_draft.tools import draftinfo

    config_dir = tempfile.mkdtemp(prefix="hybrid-draft-plan-")
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            out["plan"] = draftinfo.for_object_store(
                args.model_dir,
                config_dir,
                args.trust_remote_code,
                skip_replaced,
                objectstore.Access.of(current),
            )
        except BaseException as exc:  # raised again in the caller's thread
            out["error"] = exc

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(args.timeout)
    if worker.is_alive():
        shutil.rmtree(config_dir, ignore_errors=True)
        endpoint = _ENDPOINT_ENV.get(str(args.model_dir).partition("://")[0].lower(), "")
        _fail(
            f"{args.model_dir}: no answer from the object store within {args.timeout:g} s "
            f"(--timeout); check the address, {endpoint or 'the endpoint'} and the credentials"
        )
        sys.stderr.flush()
        os._exit(2)  # the client's thread cannot be stopped
    shutil.rmtree(config_dir, ignore_errors=True)
    if "error" in out:
        raise out["error"]
    return out["plan"]


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
            f"the target's {result['load_format']} pass (hold budget "
            f"{_gb(one_pass['hold_budget'])})"
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
