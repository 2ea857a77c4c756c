"""``hybrid-draft smoke``: the compose smoke test against a running vLLM server.

Checks, each printed as one ``PASS``/``FAIL`` line: ``/v1/models`` lists the model; a few
completions return text; vLLM's Prometheus metrics count proposed draft tokens (> 0); the
layer's events file holds a target decision that kept ``instanttensor``, a draft decision
whose ``chosen_format`` is the configured mode's, and a ``loaded`` event for the target and
the draft with no ``load_failed``. In mode ``selective``, a draft that fell back to lazy
safetensors because the host has no CUDA passes with a ``WARN`` line (that fallback is by
design); a fallback for any other cause fails, naming it. Then it prints the events file's
load report (``hybrid-draft report``) and a last line with the verdict. Exits 1 if any check
fails. The checks are plain functions of what the server returned, so tests feed them real
vLLM output without a GPU.
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
from hybrid_draft.tools import report

DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
PROMPTS = ("The quick brown fox", "Speculative decoding is", "In a hybrid loader,")
#: The one ``selective_fallback`` cause that is not a fault: a host without CUDA.
NO_CUDA = "no_cuda"


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    detail: str
    #: A passing check the user should know about (printed ``WARN``, counted as passed).
    warning: bool = False

    def line(self) -> str:
        tag = "FAIL" if not self.ok else "WARN" if self.warning else "PASS"
        return f"{tag} {self.name}: {self.detail}"


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
    return Result(
        "completions", True, f"{len(texts)} completions returned text, e.g. {texts[0][:40]!r}"
    )


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
        return Result(
            "speculative metrics",
            False,
            f"no {DRAFT_TOKENS}_total in /metrics (is speculative decoding on?)",
        )
    if total <= 0:
        return Result("speculative metrics", False, f"{DRAFT_TOKENS}_total is {total:g}")
    return Result("speculative metrics", True, f"{DRAFT_TOKENS}_total = {total:g}")


def read_events(lines: Iterable[str]) -> list[dict[str, Any]]:
    return report.read(lines)


def _chose(e: dict[str, Any]) -> str:
    detail = f": {e['detail']}" if e.get("detail") else ""
    return f"{e.get('chosen_format')} ({e.get('reason')}{detail})"


def check_draft_decisions(drafts: list[dict[str, Any]], mode: str) -> Result:
    """Every draft decision chose the mode's format; in mode ``selective`` a fallback to lazy
    safetensors passes (with a warning) only when its ``fallback`` code is ``no_cuda``."""
    name = "draft decision"
    if not drafts:
        return Result(name, False, "no draft decision in the events file")
    expected = policy.DRAFT_FORMAT_BY_MODE[mode]
    matching = [e for e in drafts if e.get("chosen_format") == expected]
    fallbacks = [
        e
        for e in drafts
        if mode == "selective"
        and e.get("reason") == "selective_fallback"
        and e.get("chosen_format") == policy.SAFETENSORS
    ]
    others = [e for e in drafts if e not in matching and e not in fallbacks]
    if others:
        return Result(
            name,
            False,
            f"mode {mode} expects {expected}; draft decisions chose "
            f"{', '.join(sorted({_chose(e) for e in others}))}",
        )
    faults = [e for e in fallbacks if e.get("fallback") != NO_CUDA]
    if faults:
        causes = sorted(
            {f"{e.get('fallback') or 'no fallback code'}: {e.get('detail')}" for e in faults}
        )
        return Result(
            name,
            False,
            f"mode selective fell back to lazy safetensors for another "
            f"cause than a host without CUDA: {'; '.join(causes)}",
        )
    if fallbacks:
        return Result(
            name,
            True,
            f"{len(fallbacks)} draft decision(s) fell back to lazy "
            f"safetensors (no_cuda: {fallbacks[0].get('detail')}); "
            "selective streams only on a CUDA host",
            warning=True,
        )
    return Result(
        name,
        True,
        f"{len(matching)} draft decision(s) chose {expected} "
        f"({matching[0].get('reason')}) in mode {mode}",
    )


def check_loads(events: list[dict[str, Any]]) -> Result:
    """A ``loaded`` event for the target and for the draft, and no ``load_failed``."""
    loaded = [e for e in events if e.get("event") == "hybrid_draft.loaded"]
    failed = [e for e in events if e.get("event") == "hybrid_draft.load_failed"]
    if failed:
        first = failed[0]
        return Result(
            "loads",
            False,
            f"{len(failed)} load(s) failed, e.g. the "
            f"{first.get('role')}: {first.get('error_type')}: "
            f"{first.get('error')}",
        )
    roles = {r: [e for e in loaded if e.get("role") == r] for r in ("target", "draft")}
    missing = [r for r, es in roles.items() if not es]
    if missing:
        return Result(
            "loads", False, f"no hybrid_draft.loaded event for the {' and the '.join(missing)}"
        )
    shown = ", ".join(
        f"{r} {es[0].get('load_format')} in {es[0].get('seconds')} s" for r, es in roles.items()
    )
    return Result("loads", True, f"{len(loaded)} load(s) reported: {shown}")


def check_events(events: list[dict[str, Any]], mode: str) -> list[Result]:
    decisions = [e for e in events if e.get("event") == "hybrid_draft.decision"]
    targets = [e for e in decisions if e.get("role") == "target"]
    drafts = [e for e in decisions if e.get("role") == "draft"]
    kept = [
        e
        for e in targets
        if e.get("chosen_format") == policy.INSTANTTENSOR and e.get("action") == "kept"
    ]
    return [
        Result(
            "target decision",
            bool(kept),
            f"{len(kept)} of {len(targets)} target decisions kept instanttensor"
            if targets
            else "no target decision in the events file",
        ),
        check_draft_decisions(drafts, mode),
    ]


def _get(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
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


def load_events(events_file: str) -> tuple[list[dict[str, Any]] | None, Result | None]:
    """The events file's events, or why it could not be read."""
    try:
        with open(events_file, encoding="utf-8", errors="replace") as f:
            return read_events(f), None
    except OSError as exc:
        return None, Result("events", False, f"cannot read {events_file}: {exc}")


def run_checks(
    base: str, model: str | None, events_file: str, mode: str, count: int
) -> list[Result]:
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
            responses.append(
                _post(
                    f"{base}/v1/completions",
                    {
                        "model": model,
                        "prompt": prompt,
                        "max_tokens": 24,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
            )
        except (urllib.error.URLError, OSError, ValueError) as exc:
            responses.append({"error": str(exc)})
    results.append(check_completions(responses))
    try:
        results.append(check_metrics(_get(f"{base}/metrics")))
    except (urllib.error.URLError, OSError) as exc:
        results.append(Result("speculative metrics", False, f"GET /metrics failed: {exc}"))
    events, problem = load_events(events_file)
    if events is None:
        results.append(problem)  # type: ignore[arg-type]
    else:
        results.extend(check_events(events, mode))
        results.append(check_loads(events))
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("SMOKE_URL", "http://localhost:8000"))
    p.add_argument(
        "--model",
        default=os.environ.get("SMOKE_MODEL") or None,
        help="served model name (default: the first /v1/models lists)",
    )
    p.add_argument(
        "--events-file",
        default=os.environ.get("HYBRID_DRAFT_EVENTS_FILE"),
        help="the layer's JSONL events file the server writes",
    )
    p.add_argument(
        "--mode", default=None, help="the draft mode the server runs (default: read the settings)"
    )
    p.add_argument("--completions", type=int, default=3)
    p.add_argument(
        "--wait", type=float, default=0.0, help="seconds to wait for /health before checking"
    )


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
        print(
            f"FAIL settings: mode {mode!r} is not one of {', '.join(policy.DRAFT_FORMAT_BY_MODE)}",
            flush=True,
        )
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
    events, _ = load_events(args.events_file)
    if events is not None:
        print(f"\nload report ({args.events_file}):\n{report.text(events)}\n", flush=True)
    failed = [r for r in results if not r.ok]
    warned = sum(r.ok and r.warning for r in results)
    print(
        f"smoke: {len(results) - len(failed)} passed"
        f"{f' ({warned} with a warning)' if warned else ''}, {len(failed)} failed",
        flush=True,
    )
    return 1 if failed else 0
