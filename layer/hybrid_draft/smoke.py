"""``hybrid-draft smoke``: the compose smoke test against a running vLLM server.

Checks, each printed as one ``PASS``/``FAIL`` line: ``/v1/models`` lists the model; a few
completions return text; vLLM's Prometheus metrics count proposed draft tokens (> 0); the
layer's events file holds a target decision that kept ``instanttensor`` and a draft
decision whose ``chosen_format`` is the configured mode's. Exits 1 if any check fails.
The checks are plain functions of what the server returned, so tests feed them real vLLM
output without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hybrid_draft import policy

DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
PROMPTS = ("The quick brown fox", "Speculative decoding is", "In a hybrid loader,")


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def check_models(payload: dict[str, Any], model: str | None) -> Result:
    ids = [m.get("id") for m in payload.get("data", [])]
    if not ids:
        return Result("models", False, "/v1/models lists no model")
    if model is not None and model not in ids:
        return Result("models", False, f"/v1/models lists {ids}, not {model!r}")
    return Result("models", True, f"/v1/models lists {ids}")


def check_completions(responses: list[dict[str, Any]]) -> Result:
    texts = []
    for r in responses:
        choices = r.get("choices") or [{}]
        texts.append(choices[0].get("text"))
    empty = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t]
    if not texts or empty:
        return Result("completions", False, f"{len(empty)} of {len(texts)} returned no text")
    return Result("completions", True, f"{len(texts)} completions returned text, e.g. "
                                       f"{texts[0][:40]!r}")


def draft_tokens(metrics_text: str) -> float | None:
    """Total draft tokens proposed, from Prometheus text (None when the metric is absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = None
    for family in text_string_to_metric_families(metrics_text):
        if family.name != DRAFT_TOKENS:
            continue
        for sample in family.samples:
            if sample.name == f"{DRAFT_TOKENS}_total":
                total = (total or 0.0) + sample.value
    return total


def check_metrics(metrics_text: str) -> Result:
    total = draft_tokens(metrics_text)
    if total is None:
        return Result("speculative metrics", False, f"no {DRAFT_TOKENS}_total in /metrics "
                                                    "(is speculative decoding on?)")
    if total <= 0:
        return Result("speculative metrics", False, f"{DRAFT_TOKENS}_total is {total:g}")
    return Result("speculative metrics", True, f"{DRAFT_TOKENS}_total = {total:g}")


def read_events(lines: Iterable[str]) -> list[dict[str, Any]]:
    events = []
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


def check_events(events: list[dict[str, Any]], mode: str) -> list[Result]:
    decisions = [e for e in events if e.get("event") == "hybrid_draft.decision"]
    targets = [e for e in decisions if e.get("role") == "target"]
    drafts = [e for e in decisions if e.get("role") == "draft"]
    expected = policy.DRAFT_FORMAT_BY_MODE[mode]
    kept = [e for e in targets if e.get("chosen_format") == policy.INSTANTTENSOR
            and e.get("action") == "kept"]
    out = [Result(
        "target decision", bool(kept),
        f"{len(kept)} of {len(targets)} target decisions kept instanttensor"
        if targets else "no target decision in the events file")]
    matching = [e for e in drafts if e.get("chosen_format") == expected]
    if matching:
        d = matching[0]
        out.append(Result("draft decision", True, f"{len(matching)} draft decision(s) chose "
                                                  f"{expected} ({d.get('reason')}) in mode {mode}"))
    else:
        seen = sorted({f"{e.get('chosen_format')} ({e.get('reason')}"
                       f"{': ' + e['detail'] if e.get('detail') else ''})" for e in drafts})
        out.append(Result("draft decision", False,
                          f"mode {mode} expects {expected}; draft decisions chose "
                          f"{', '.join(seen) or 'nothing (no draft decision)'}"))
    return out


def _get(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def wait_healthy(base: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        try:
            _get(f"{base}/health", timeout=5)
            return True
        except (urllib.error.URLError, OSError):
            if time.monotonic() >= deadline:
                return False
            time.sleep(2)


def run_checks(base: str, model: str | None, events_file: str, mode: str,
               count: int) -> list[Result]:
    results: list[Result] = []
    try:
        models = json.loads(_get(f"{base}/v1/models"))
        results.append(check_models(models, model))
        model = model or models["data"][0]["id"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as exc:
        return [Result("models", False, f"GET {base}/v1/models failed: {exc}")]
    responses = []
    for prompt in (PROMPTS * count)[:count]:
        try:
            responses.append(_post(f"{base}/v1/completions", {
                "model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            responses.append({"error": str(exc)})
    results.append(check_completions(responses))
    try:
        results.append(check_metrics(_get(f"{base}/metrics")))
    except (urllib.error.URLError, OSError) as exc:
        results.append(Result("speculative metrics", False, f"GET /metrics failed: {exc}"))
    try:
        with open(events_file, encoding="utf-8") as f:
            results.extend(check_events(read_events(f), mode))
    except OSError as exc:
        results.append(Result("events", False, f"cannot read {events_file}: {exc}"))
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("SMOKE_URL", "http://localhost:8000"))
    p.add_argument("--model", default=os.environ.get("SMOKE_MODEL") or None,
                   help="served model name (default: the first /v1/models lists)")
    p.add_argument("--events-file", default=os.environ.get("HYBRID_DRAFT_EVENTS_FILE"),
                   help="the layer's JSONL events file the server writes")
    p.add_argument("--mode", default=None,
                   help="the draft mode the server runs (default: read the settings)")
    p.add_argument("--completions", type=int, default=3)
    p.add_argument("--wait", type=float, default=0.0,
                   help="seconds to wait for /health before checking")


def main(args: argparse.Namespace) -> int:
    from hybrid_draft import settings

    base = args.url.rstrip("/")
    mode = args.mode
    if mode is None:
        try:
            mode = settings.load().mode.value
        except settings.ConfigError as exc:
            print(f"FAIL settings: {exc}", flush=True)
            return 1
    if mode not in policy.DRAFT_FORMAT_BY_MODE:
        print(f"FAIL settings: mode {mode!r} is not one of "
              f"{', '.join(policy.DRAFT_FORMAT_BY_MODE)}", flush=True)
        return 1
    if not args.events_file:
        print("FAIL events: no events file (--events-file or HYBRID_DRAFT_EVENTS_FILE)")
        return 1
    if args.wait and not wait_healthy(base, args.wait):
        print(f"FAIL health: {base}/health did not answer within {args.wait:g} s", flush=True)
        return 1
    results = run_checks(base, args.model, args.events_file, mode, args.completions)
    for r in results:
        print(r.line(), flush=True)
    failed = [r for r in results if not r.ok]
    print(f"smoke: {len(results) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0
