"""``hybrid-draft smoke``: the compose smoke test against a running vLLM server.

Checks, each printed as one ``PASS``/``FAIL`` line: ``/v1/models`` lists the model; a few
completions return text; vLLM's Prometheus metrics count proposed draft tokens (> 0); the
draft's acceptance rate over the smoke's own completions (vLLM's accepted and drafted
counters, read before and after them) reaches a floor: near 1 on a checkpoint that says its
draft agrees with its target (``--model-dir``, make-checkpoint's claim), else the user's
(``--min-acceptance``, ``SMOKE_MIN_ACCEPTANCE``) or one only a draft loaded wrong misses,
since a draft of garbage is served without an error and proposes tokens all the same; the
layer's events file holds a target decision that kept ``instanttensor``, a draft decision
whose ``chosen_format`` is the configured mode's, and a ``loaded`` event for the target and
the draft with no ``load_failed``. Only the events of the server it tested are judged: those
written since that server's process started (``process_start_time_seconds`` in its
``/metrics``), so a file that earlier servers also wrote to (compose keeps the events volume
from one ``up`` to the next) neither passes a server that wrote nothing nor fails one that
decided otherwise than its predecessor. In mode ``selective``, a draft that fell back to lazy
safetensors because the host has no CUDA passes with a ``WARN`` line (that fallback is by
design); a fallback for any other cause fails, naming it. Then it prints the load report of
the judged events (``hybrid-draft report``) and a last line with the verdict. Exits 1 if any
check fails, 2 on bad arguments. The checks are plain functions of what the server returned, so
tests feed them real vLLM output without a GPU.

Bounded in time and size: the whole run, waiting for ``/health`` included, ends within
``--deadline`` seconds (each request also has its own timeout, cut to what is left); a
request runs in a worker thread the command stops waiting for at its limit, so a server
that sends its headers and then trickles bytes cannot hold it; an answer over
:data:`BODY_LIMIT` bytes is a failure. Every answer that is not what vLLM sends (a
``/v1/models`` that is a list, ``{"data": "x"}``, a ``/metrics`` that is not Prometheus text)
is a ``FAIL`` line naming the endpoint and what it returned.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hybrid_draft import files
from hybrid_draft.core import policy
from hybrid_draft.tools import args as types
from hybrid_draft.tools import report

DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
#: vLLM's counter of the draft tokens the target accepted.
ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
#: The acceptance floor on a checkpoint that says its draft agrees with its target
#: (``make-checkpoint``'s default; hybrid_draft.tools.agree): every proposal should be
#: accepted, and each one rejected shows. 1.0 measured in float32 and bfloat16
#: (docs/testing.md); the margin leaves room for a GPU's other kernels.
AGREEING_FLOOR = 0.9
#: The floor on any other checkpoint, unless the user sets one: what a draft loaded wrong
#: gets (about 0: every proposal rejected) misses it, what MTP heads are published to get
#: (0.5 to 0.9) passes it.
DEFAULT_FLOOR = 0.2
#: The environment variable that sets the floor (compose's smoke service passes it).
FLOOR_ENV = "SMOKE_MIN_ACCEPTANCE"
#: prometheus_client's process collector: when the server's (API server) process started,
#: in seconds since the epoch. Every load the server makes comes after it.
SERVER_START = "process_start_time_seconds"
PROMPTS = ("The quick brown fox", "Speculative decoding is", "In a hybrid loader,")
#: The one ``selective_fallback`` cause that is not a fault: a host without CUDA.
NO_CUDA = "no_cuda"
#: The default overall deadline (s): compose's smoke service waits up to 120 s for
#: ``/health``; the rest is for the checks (seconds each on a served model).
DEFAULT_DEADLINE = 300.0
#: The largest answer read from one endpoint (vLLM's /metrics is well under 1 MB).
BODY_LIMIT = 32 << 20
CONNECT_TIMEOUT = 5.0


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


def excerpt(value: object, limit: int = 80) -> str:
    """A short, one-line rendering of what an endpoint returned."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if isinstance(value, str):
        return files.show(value[: limit * 2], limit)
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = files.show(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_models(payload: Any, model: str | None, where: str = "/v1/models") -> Result:
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return Result(
            "models",
            False,
            f"{where} returned {excerpt(payload)}, not an object with a data list of models",
        )
    ids = [m.get("id") for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    if not ids:
        return Result("models", False, f"{where} lists no model: {excerpt(payload)}")
    if model is not None and model not in ids:
        return Result("models", False, f"{where} lists {ids}, not {model!r}")
    return Result("models", True, f"{where} lists {ids}")


def _completion_text(response: Any) -> str | None:
    choices = response.get("choices") if isinstance(response, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else None
    text = first.get("text") if isinstance(first, dict) else None
    return text if isinstance(text, str) and text else None


def check_completions(responses: list[Any]) -> Result:
    texts = [_completion_text(r) for r in responses]
    empty = [i for i, t in enumerate(texts) if t is None]
    if not texts or empty:
        first = responses[empty[0]] if empty else None
        why = ""
        if isinstance(first, dict) and isinstance(first.get("error"), str):
            why = f"; the first: {first['error']}"
        elif empty:
            why = f"; the first returned {excerpt(first)}"
        return Result("completions", False, f"{len(empty)} of {len(texts)} returned no text{why}")
    first_text = texts[0] or ""
    return Result(
        "completions", True, f"{len(texts)} completions returned text, e.g. {first_text[:40]!r}"
    )


def draft_tokens(metrics_text: str) -> float | None:
    """Total draft tokens proposed, from Prometheus text (None when the metric is absent).
    Raises ValueError for text that is not Prometheus text."""
    return counter_totals(metrics_text, [DRAFT_TOKENS])[DRAFT_TOKENS]


def check_metrics(metrics_text: str, where: str = "/metrics") -> Result:
    name = "speculative metrics"
    try:
        total = draft_tokens(metrics_text)
    except ValueError as exc:
        return Result(
            name,
            False,
            f"{where} returned {excerpt(metrics_text)}, not Prometheus text ({exc})",
        )
    if total is None:
        return Result(
            name,
            False,
            f"no {DRAFT_TOKENS}_total in {where} (is speculative decoding on?)",
        )
    if total <= 0:
        return Result(name, False, f"{DRAFT_TOKENS}_total is {total:g}")
    return Result(name, True, f"{DRAFT_TOKENS}_total = {total:g}")


def counter_totals(metrics_text: str, names: Iterable[str]) -> dict[str, float | None]:
    """Each counter's ``_total``, summed over its label sets (one per engine), from
    Prometheus text; None for a counter the text lacks. Raises ValueError for text that is
    not Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = list(names)
    out: dict[str, float | None] = dict.fromkeys(wanted)
    families = 0
    try:
        for family in text_string_to_metric_families(metrics_text):
            families += 1
            if family.name not in out:
                continue
            for sample in family.samples:
                if sample.name == f"{family.name}_total":
                    out[family.name] = (out[family.name] or 0.0) + sample.value
    except Exception as exc:  # the parser's errors: ValueError, IndexError, TypeError...
        raise ValueError(f"{type(exc).__name__}: {files.one_line(str(exc), 120)}") from None
    if not families and metrics_text.strip():
        raise ValueError("no metric in it")
    return out


@dataclass(frozen=True)
class Acceptance:
    """The draft tokens proposed and accepted between two reads of ``/metrics``."""

    accepted: float
    drafted: float

    @property
    def rate(self) -> float | None:
        """Accepted over drafted; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted > 0 else None

    def counters(self) -> str:
        return f"{ACCEPTED_TOKENS}_total +{self.accepted:g}, {DRAFT_TOKENS}_total +{self.drafted:g}"


def acceptance(before: str, after: str) -> Acceptance:
    """The accepted and drafted tokens between two ``/metrics`` texts of one server (vLLM's
    ``vllm:spec_decode_num_accepted_tokens_total`` and ``..._num_draft_tokens_total``, summed
    over engines): what the requests made between the two reads proposed and got accepted.

    Raises ValueError, one line, for a text that is not Prometheus text, a counter missing
    from ``after``, a counter missing from ``before`` that ``after`` has (vLLM makes its
    counters when the server starts: the first read was not of this server's counters, and
    what its earlier requests drafted cannot be told from the smoke's own), or a counter
    that went down (another server answered the second read)."""
    names = (ACCEPTED_TOKENS, DRAFT_TOKENS)
    first = counter_totals(before, names)
    second = counter_totals(after, names)
    deltas = []
    for name in names:
        now, then = second[name], first[name]
        if now is None:
            raise ValueError(f"no {name}_total (is speculative decoding on?)")
        if then is None:
            raise ValueError(
                f"the first read had no {name}_total and the second has it: the server's "
                "earlier requests cannot be told from the smoke's own"
            )
        if now < then:
            raise ValueError(
                f"{name}_total went down from {then:g} to {now:g} between the two reads "
                "(did the server restart?)"
            )
        deltas.append(now - then)
    return Acceptance(*deltas)


@dataclass(frozen=True)
class Floor:
    """The acceptance a draft must reach, and why that one."""

    value: float
    source: str


def floor_for(user: float | None, user_source: str, model_dir: str | None) -> Floor:
    """The user's floor where one is set; else, on a checkpoint that says its draft agrees
    with its target, :data:`AGREEING_FLOOR`; else :data:`DEFAULT_FLOOR`.

    Raises OSError or ValueError (one line) for a ``model_dir`` whose index cannot be read."""
    from hybrid_draft.tools import agree

    if user is not None:
        return Floor(user, f"set by {user_source}")
    if model_dir is None:
        return Floor(DEFAULT_FLOOR, "the default; no --model-dir to read a claim from")
    said = agree.claim(model_dir)
    if said.agrees:
        return Floor(
            AGREEING_FLOOR, f"the checkpoint says its draft agrees with its target: {said.where}"
        )
    why = said.where if said.draft == "unknown" else f"its draft is {said.draft}: {said.where}"
    return Floor(DEFAULT_FLOOR, f"the default for a draft not known to agree ({why})")


def check_acceptance(
    before: str | None, after: str | None, floor: Floor, completions: int
) -> Result:
    """The smoke's own requests' acceptance rate against ``floor``; the line names vLLM's
    counters and where the floor comes from."""
    name = "draft acceptance"
    if before is None or after is None:
        return Result(name, False, "no acceptance: /metrics was not read before and after")
    try:
        got = acceptance(before, after)
    except ValueError as exc:
        return Result(name, False, f"no acceptance: {exc}")
    during = f"during smoke's {completions} completion(s)"
    rate = got.rate
    if rate is None:
        return Result(name, False, f"the draft proposed no token {during} ({got.counters()})")
    verdict = "at least" if rate >= floor.value else "below"
    return Result(
        name,
        rate >= floor.value,
        f"{rate:.3f} ({got.accepted:g} of {got.drafted:g} draft tokens accepted {during}: "
        f"{got.counters()}), {verdict} the floor {floor.value:g} ({floor.source})",
    )


def read_events(lines: Iterable[str]) -> list[dict[str, Any]]:
    return report.read(lines)


def server_start(metrics_text: str) -> float | None:
    """When the server's process started (epoch seconds), from its Prometheus text; None
    when the text does not say (not Prometheus text, or no process collector: vLLM with
    several API servers aggregates its processes' metrics without one)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                if sample.name == SERVER_START and math.isfinite(sample.value):
                    return float(sample.value)
    except Exception:  # the parser's errors; check_metrics reports the text itself
        return None
    return None


def event_time(event: dict[str, Any]) -> float | None:
    """An event's ``timestamp`` (ISO 8601, UTC) in epoch seconds; None when it has none."""
    stamp = event.get("timestamp")
    if not isinstance(stamp, str):
        return None
    try:  # the layer writes "...Z", which fromisoformat reads from Python 3.11 only
        when = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()


def since(events: list[dict[str, Any]], start: float) -> list[dict[str, Any]]:
    """The events written at or after ``start``: those of the server that started then (an
    event without a readable timestamp cannot be shown to be its own)."""
    return [e for e in events if (t := event_time(e)) is not None and t >= start]


@dataclass
class Judged:
    """The events smoke judges, and the words that say which they are."""

    events: list[dict[str, Any]]
    #: Where the checks looked, for their "no ..." lines: "in the events file", or "since
    #: the server started (...)".
    scope: str
    #: A ``WARN`` line when every event is judged for want of the server's start.
    warning: Result | None = None


def this_server(events: list[dict[str, Any]], start: float | None) -> Judged:
    """The events of the server that started at ``start``; with no start known, every
    event, and a ``WARN`` line saying so."""
    if start is None:
        return Judged(
            events,
            "in the events file",
            Result(
                "events",
                True,
                f"the server's /metrics reports no {SERVER_START}: every event in the events "
                "file is judged, those of earlier servers included",
                warning=True,
            ),
        )
    own = since(events, start)
    when = datetime.datetime.fromtimestamp(start, datetime.timezone.utc)
    earlier = len(events) - len(own)
    return Judged(
        own,
        f"since the server started ({when.isoformat(timespec='seconds')}; "
        f"{earlier} earlier event(s) not judged)",
    )


def _chose(e: dict[str, Any]) -> str:
    detail = f": {e['detail']}" if e.get("detail") else ""
    return f"{e.get('chosen_format')} ({e.get('reason')}{detail})"


def check_draft_decisions(
    drafts: list[dict[str, Any]], mode: str, scope: str = "in the events file"
) -> Result:
    """Every draft decision chose the mode's format; in mode ``selective`` a fallback to lazy
    safetensors passes (with a warning) only when its ``fallback`` code is ``no_cuda``."""
    name = "draft decision"
    if not drafts:
        return Result(name, False, f"no draft decision {scope}")
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


def check_loads(events: list[dict[str, Any]], scope: str = "in the events file") -> Result:
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
            "loads",
            False,
            f"no hybrid_draft.loaded event for the {' and the '.join(missing)} {scope}",
        )
    shown = ", ".join(
        f"{r} {es[0].get('load_format')} in {es[0].get('seconds')} s" for r, es in roles.items()
    )
    return Result("loads", True, f"{len(loaded)} load(s) reported: {shown}")


def check_events(
    events: list[dict[str, Any]], mode: str, scope: str = "in the events file"
) -> list[Result]:
    # The server's first loads (a reload of its weights in place decides again, by its own
    # trigger: not what the mode's first load is judged by).
    decisions = [
        e
        for e in events
        if e.get("event") == "hybrid_draft.decision" and e.get("trigger") != "reload"
    ]
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
            else f"no target decision {scope}",
        ),
        check_draft_decisions(drafts, mode, scope),
    ]


class Deadline:
    """The time the whole run may take."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class HTTPFailure(Exception):
    """A request that did not get a usable answer; ``str()`` is one line saying why."""


def _exchange(
    method: str, url: str, body: dict[str, Any] | None, timeout: float, stop_at: float
) -> tuple[int, bytes]:
    import requests

    with requests.request(
        method,
        url,
        json=body,
        timeout=(min(CONNECT_TIMEOUT, timeout), timeout),
        stream=True,
        allow_redirects=False,
    ) as r:
        chunks, size = [], 0
        for chunk in r.iter_content(chunk_size=1 << 16):
            size += len(chunk)
            if size > BODY_LIMIT:
                raise HTTPFailure(f"answered more than {BODY_LIMIT:,} bytes")
            if time.monotonic() > stop_at:
                raise HTTPFailure(f"did not finish its answer within {timeout:g} s")
            chunks.append(chunk)
        return r.status_code, b"".join(chunks)


def request(
    method: str,
    url: str,
    deadline: Deadline,
    timeout: float,
    body: dict[str, Any] | None = None,
) -> bytes:
    """The body of a 2xx answer to ``method url``, within ``timeout`` and the deadline;
    :class:`HTTPFailure` (one line naming the request) for anything else."""
    what = f"{method} {url}"
    limit = min(timeout, deadline.left())
    if limit <= 0:
        raise HTTPFailure(
            f"{what}: not sent, the overall deadline ({deadline.seconds:g} s) has passed"
        )
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["answer"] = _exchange(method, url, body, limit, time.monotonic() + limit)
        except BaseException as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=work, name=f"smoke {what}", daemon=True)
    worker.start()
    worker.join(limit + 0.5)
    if worker.is_alive():  # left behind: a daemon thread ends with the command
        raise HTTPFailure(f"{what}: no complete answer within {limit:g} s")
    if "error" in outcome:
        exc = outcome["error"]
        detail = str(exc) if isinstance(exc, HTTPFailure) else f"{type(exc).__name__}: {exc}"
        raise HTTPFailure(f"{what}: {files.one_line(detail, 200)}")
    status, data = outcome["answer"]
    if not 200 <= status < 300:
        raise HTTPFailure(f"{what}: HTTP {status}: {excerpt(data)}")
    return data  # type: ignore[no-any-return]


def _json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError, MemoryError):
        raise HTTPFailure(f"{what} returned {excerpt(data)}, not JSON") from None


def wait_healthy(base: str, seconds: float, deadline: Deadline | None = None) -> bool:
    """Whether ``base``/health answered within ``seconds`` (and the deadline)."""
    deadline = deadline or Deadline(seconds)
    stop = time.monotonic() + min(seconds, max(deadline.left(), 0.0))
    while True:
        try:
            request("GET", f"{base}/health", deadline, min(5.0, stop - time.monotonic()))
            return True
        except HTTPFailure:
            pass
        left = stop - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(2.0, left))


def load_events(events_file: str) -> tuple[list[dict[str, Any]] | None, Result | None]:
    """The events file's events, or why it could not be read."""
    try:
        return report.read_file(events_file), None
    except FileNotFoundError:
        return None, Result("events", False, f"{files.show_path(events_file)}: no such file")
    except files.FileProblem as exc:
        return None, Result("events", False, f"cannot read the events file: {exc}")


def run_checks(
    base: str,
    model: str | None,
    events_file: str,
    mode: str,
    count: int,
    deadline: Deadline | None = None,
    floor: Floor | None = None,
) -> list[Result]:
    return checked(base, model, events_file, mode, count, deadline, floor)[0]


def checked(
    base: str,
    model: str | None,
    events_file: str,
    mode: str,
    count: int,
    deadline: Deadline | None = None,
    floor: Floor | None = None,
) -> tuple[list[Result], Judged | None]:
    """Every check's result, and the events judged (None when none were read)."""
    deadline = deadline or Deadline(DEFAULT_DEADLINE)
    floor = floor or Floor(DEFAULT_FLOOR, "the default")
    results: list[Result] = []
    url = f"{base}/v1/models"
    try:
        models = _json(request("GET", url, deadline, 30.0), f"GET {url}")
    except HTTPFailure as exc:
        return [Result("models", False, str(exc))], None
    listed = check_models(models, model, f"GET {url}")
    results.append(listed)
    if not listed.ok and model is None:
        return results, None
    model = model or next(
        m["id"] for m in models["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)
    )
    # The counters before the smoke's own requests: acceptance is judged on the difference.
    metrics_url = f"{base}/metrics"
    before: str | None = None
    unread: HTTPFailure | None = None
    try:
        before = request("GET", metrics_url, deadline, 30.0).decode("utf-8", errors="replace")
    except HTTPFailure as exc:
        unread = exc
    responses: list[Any] = []
    url = f"{base}/v1/completions"
    for prompt in (PROMPTS * count)[:count]:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
        }
        try:
            responses.append(_json(request("POST", url, deadline, 120.0, body), f"POST {url}"))
        except HTTPFailure as exc:
            responses.append({"error": str(exc)})
    results.append(check_completions(responses))
    start = None
    after: str | None = None
    try:
        if unread is not None:
            raise unread
        after = request("GET", metrics_url, deadline, 30.0).decode("utf-8", errors="replace")
        results.append(check_metrics(after, f"GET {metrics_url}"))
        start = server_start(after)
    except HTTPFailure as exc:
        results.append(Result("speculative metrics", False, str(exc)))
    results.append(check_acceptance(before, after, floor, count))
    events, problem = load_events(events_file)
    if events is None:
        results.append(problem)  # type: ignore[arg-type]
        return results, None
    judged = this_server(events, start)
    if judged.warning is not None:
        results.append(judged.warning)
    results.extend(check_events(judged.events, mode, judged.scope))
    results.append(check_loads(judged.events, judged.scope))
    return results, judged


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")) or len(text) <= len("https://"):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL")
    return text


def _mode(text: str) -> str:
    mode = text.strip().lower()
    if mode not in policy.DRAFT_FORMAT_BY_MODE:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a mode; accepted: {', '.join(policy.DRAFT_FORMAT_BY_MODE)}"
        )
    return mode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", type=_url, default=os.environ.get("SMOKE_URL", "http://localhost:8000"))
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
        "--mode",
        type=_mode,
        default=None,
        help="the draft mode the server runs (default: read the settings)",
    )
    p.add_argument("--completions", type=types.integer(1, 1000), default=3)
    p.add_argument(
        "--wait",
        type=types.non_negative,
        default=0.0,
        help="seconds to wait for /health before checking (within the deadline)",
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="the served checkpoint's directory, read for its claim that its draft agrees "
        "with its target (make-checkpoint's): the acceptance floor is then "
        f"{AGREEING_FLOOR:g}",
    )
    p.add_argument(
        "--min-acceptance",
        type=types.fraction,
        default=None,
        help=f"the acceptance floor, a number from 0 to 1 (default: {FLOOR_ENV}, else "
        f"{AGREEING_FLOOR:g} on a checkpoint whose draft agrees, else {DEFAULT_FLOOR:g})",
    )
    p.add_argument(
        "--deadline",
        type=types.positive,
        default=DEFAULT_DEADLINE,
        help=f"seconds the whole run may take, the wait included (default {DEFAULT_DEADLINE:g}); "
        "what is not done by then fails",
    )


def main(args: argparse.Namespace) -> int:
    from hybrid_draft import settings

    deadline = Deadline(args.deadline)
    base = args.url.rstrip("/")
    if not args.events_file:
        print(
            "hybrid-draft smoke: no events file: pass --events-file or set "
            "HYBRID_DRAFT_EVENTS_FILE",
            file=sys.stderr,
        )
        return 2
    user, source = args.min_acceptance, "--min-acceptance"
    if user is None and os.environ.get(FLOOR_ENV, "").strip():
        source = FLOOR_ENV
        try:
            user = types.fraction(os.environ[FLOOR_ENV].strip())
        except argparse.ArgumentTypeError as exc:
            print(f"hybrid-draft smoke: {FLOOR_ENV}: {exc}", file=sys.stderr)
            return 2
    if args.model_dir is not None and not os.path.isdir(args.model_dir):
        print(
            f"hybrid-draft smoke: --model-dir {files.show_path(args.model_dir)}: not a directory",
            file=sys.stderr,
        )
        return 2
    try:
        floor = floor_for(user, source, args.model_dir)
    except (OSError, ValueError) as exc:
        print(f"hybrid-draft smoke: --model-dir: {files.error_line(exc)}", file=sys.stderr)
        return 2
    mode = args.mode
    if mode is None:
        try:
            mode = settings.load().mode.value
        except settings.ConfigError as exc:
            print(f"FAIL settings: {exc}", flush=True)
            return 1
    if args.wait and not wait_healthy(base, args.wait, deadline):
        limit = min(args.wait, deadline.seconds)
        print(f"FAIL health: {base}/health did not answer within {limit:g} s", flush=True)
        return 1
    results, judged = checked(
        base, args.model, args.events_file, mode, args.completions, deadline, floor
    )
    for r in results:
        print(r.line(), flush=True)
    if judged is not None:
        print(
            f"\nload report ({args.events_file}, {judged.scope}):\n{report.text(judged.events)}\n",
            flush=True,
        )
    failed = [r for r in results if not r.ok]
    warned = sum(r.ok and r.warning for r in results)
    print(
        f"smoke: {len(results) - len(failed)} passed"
        f"{f' ({warned} with a warning)' if warned else ''}, {len(failed)} failed",
        flush=True,
    )
    return 1 if failed else 0
