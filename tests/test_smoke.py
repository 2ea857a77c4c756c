"""The compose smoke test's checks, fed real inputs: events the layer wrote while real vLLM
loaded a target and its draft on the CPU, Prometheus text from vLLM's own spec-decode
metrics, and response bodies built with vLLM's own OpenAI protocol models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from conftest import Events, Recorder, engine_config, load_target_and_draft
from hybrid_draft.tools import smoke

pytestmark = pytest.mark.vllm


def events_of_a_real_load(
    qwen35: Path, events: Events, mode: str, monkeypatch: pytest.MonkeyPatch
) -> list[dict[str, Any]]:
    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", mode)
    load_target_and_draft(engine_config(qwen35))
    return smoke.read_events(events.path.read_text().splitlines())


@pytest.mark.parametrize("mode", ["auto", "safetensors", "instanttensor"])
def test_events_checks_pass_for_the_configured_mode(
    mode: str,
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    records = events_of_a_real_load(qwen35, events, mode, monkeypatch)
    results = smoke.check_events(records, mode)
    assert [r.ok for r in results] == [True, True], [r.line() for r in results]
    other = "instanttensor" if mode != "instanttensor" else "auto"
    assert [r.ok for r in smoke.check_events(records, other)] == [True, False]


def test_a_selective_fallback_for_want_of_cuda_passes_with_a_warning(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    records = events_of_a_real_load(deepseek, events, "selective", monkeypatch)
    target, draft = smoke.check_events(records, "selective")
    assert target.ok and draft.ok and draft.warning
    assert draft.line().startswith(
        "WARN draft decision: 1 draft decision(s) fell back to lazy "
        "safetensors (no_cuda: CUDA is not available"
    )
    # The same events in another mode are no fallback at all: that mode's format is missing.
    assert not smoke.check_events(records, "instanttensor")[1].ok


def test_a_selective_fallback_for_another_cause_fails_naming_it(
    qwen3_pair: tuple[Path, Path],
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real ``no_rule`` fallback: a standalone draft whose class has no weight rule."""
    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", "selective")
    target, _ = qwen3_pair
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 1}
    load_target_and_draft(engine_config(target, speculative_config=spec), route="draft_model")
    records = smoke.read_events(events.path.read_text().splitlines())
    _, draft = smoke.check_events(records, "selective")
    assert not draft.ok and not draft.warning
    assert draft.detail == (
        "mode selective fell back to lazy safetensors for another cause than a host without "
        "CUDA: no_rule: Qwen3ForCausalLM has no checkpoint-weight rule to plan its tensors with"
    )


def test_no_events_fail_every_events_check() -> None:
    assert [r.ok for r in smoke.check_events([], "auto")] == [False, False]
    assert not smoke.check_loads([]).ok


def test_loads_check_wants_a_loaded_event_for_target_and_draft(
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    records = events_of_a_real_load(qwen35, events, "auto", monkeypatch)
    result = smoke.check_loads(records)
    assert result.ok and result.detail.startswith("2 load(s) reported: target instanttensor in ")
    no_draft = [
        e for e in records if not (e["event"] == "hybrid_draft.loaded" and e["role"] == "draft")
    ]
    missing = smoke.check_loads(no_draft)
    assert not missing.ok
    assert missing.detail == "no hybrid_draft.loaded event for the draft in the events file"


def test_loads_check_fails_on_a_failed_load(
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybrid_draft.settings import ConfigError

    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", "fastest")
    with pytest.raises(ConfigError):
        load_target_and_draft(engine_config(qwen35))
    result = smoke.check_loads(smoke.read_events(events.path.read_text().splitlines()))
    assert not result.ok
    assert result.detail.startswith(
        "1 load(s) failed, e.g. the target: ConfigError: INSTANTTENSOR_DRAFT_LOADER: 'fastest'"
    )


def vllm_metrics_text(draft_tokens: int | None, server_pid: int | None = None) -> str:
    """Prometheus text as vLLM's own SpecDecodingProm renders it (a private registry), with
    prometheus_client's process metrics of ``server_pid`` (this process by default) as a
    vLLM API server's /metrics has them."""
    import prometheus_client
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    registry = prometheus_client.CollectorRegistry()
    pid = server_pid or os.getpid()
    prometheus_client.ProcessCollector(pid=lambda: pid, registry=registry)

    class Counter(prometheus_client.Counter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, registry=registry, **kwargs)

    class Prom(SpecDecodingProm):
        _counter_cls = Counter

    if draft_tokens is None:  # a server without speculative decoding
        Prom(None, ["model_name", "engine"], {0: ["m", "0"]})
        return prometheus_client.generate_latest(registry).decode()
    spec = type("Spec", (), {"num_speculative_tokens": 2})()  # all SpecDecodingProm reads
    prom = Prom(spec, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    if draft_tokens:
        stats = SpecDecodingStats.new(2)
        for _ in range(draft_tokens // 2):  # drafts of num_speculative_tokens each
            stats.observe_draft(num_draft_tokens=2, num_accepted_tokens=1)
        prom.observe(stats, engine_idx=1)
    return prometheus_client.generate_latest(registry).decode()


def test_metrics_check_reads_vllms_draft_token_counter(vllm_runtime: Any) -> None:
    text = vllm_metrics_text(4)
    assert "vllm:spec_decode_num_draft_tokens_total" in text
    assert smoke.draft_tokens(text) == 4.0
    assert smoke.check_metrics(text).ok
    assert not smoke.check_metrics(vllm_metrics_text(0)).ok
    missing = smoke.check_metrics(vllm_metrics_text(None))
    assert not missing.ok and "is speculative decoding on?" in missing.detail


def protocol_bodies(model: str, texts: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionResponse,
        CompletionResponseChoice,
    )
    from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList, UsageInfo

    models = ModelList(data=[ModelCard(id=model)]).model_dump(mode="json")
    completions = [
        CompletionResponse(
            model=model,
            usage=UsageInfo(prompt_tokens=1),
            choices=[CompletionResponseChoice(index=0, text=t)],
        ).model_dump(mode="json")
        for t in texts
    ]
    return models, completions


def test_models_and_completions_checks(vllm_runtime: Any) -> None:
    models, completions = protocol_bodies("m", ["a b", "c"])
    assert smoke.check_models(models, "m").ok and smoke.check_models(models, None).ok
    assert not smoke.check_models(models, "other").ok
    assert not smoke.check_models({"object": "list", "data": []}, None).ok
    assert smoke.check_completions(completions).ok
    _, empty = protocol_bodies("m", ["x", ""])
    assert not smoke.check_completions(empty).ok
    assert not smoke.check_completions([{"error": "refused"}]).ok


class FakeServer(BaseHTTPRequestHandler):
    """Serves vLLM-shaped bodies (built with vLLM's protocol models) to the smoke command."""

    bodies: ClassVar[dict[str, str]] = {}

    def do_GET(self) -> None:
        self._send(self.bodies.get(self.path))

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(self.bodies.get(self.path))

    def _send(self, body: str | None) -> None:
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write((body or "").encode())

    def log_message(self, *args: Any) -> None:
        pass


def run_smoke(
    events: Events, metrics: str, mode: str = "", *extra: str
) -> subprocess.CompletedProcess[str]:
    """``hybrid-draft smoke`` against a server that answers with vLLM's own bodies and the
    given /metrics text; ``mode`` as compose's smoke service passes it (empty: the default)."""
    models, completions = protocol_bodies("served", ["hello"])
    FakeServer.bodies = {
        "/health": "",
        "/v1/models": json.dumps(models),
        "/v1/completions": json.dumps(completions[0]),
        "/metrics": metrics,
    }
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "INSTANTTENSOR_DRAFT_LOADER": mode, "SMOKE_MODEL": "served"}
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "hybrid_draft",
                "smoke",
                "--url",
                f"http://127.0.0.1:{server.server_port}",
                "--events-file",
                str(events.path),
                "--wait",
                "5",
                *extra,
            ],
            capture_output=True,
            text=True,
            env=env,
        )
    finally:
        server.shutdown()


@pytest.mark.parametrize(("draft_tokens", "code"), [(4, 0), (0, 1)])
def test_smoke_command_end_to_end(
    draft_tokens: int,
    code: int,
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events_of_a_real_load(qwen35, events, "auto", monkeypatch)
    out = run_smoke(events, vllm_metrics_text(draft_tokens))
    lines = out.stdout.splitlines()
    assert out.returncode == code, out.stdout + out.stderr
    assert [ln.split(":")[0] for ln in lines[:6]] == [
        "PASS models",
        "PASS completions",
        f"{'PASS' if draft_tokens else 'FAIL'} speculative metrics",
        "PASS target decision",
        "PASS draft decision",
        "PASS loads",
    ]
    # Then the events file's load report, as `hybrid-draft report` prints it, and the verdict.
    from hybrid_draft.tools import report

    summary = report.text(smoke.read_events(events.path.read_text().splitlines()))
    header = lines[7]
    assert header.startswith(f"load report ({events.path}, since the server started (")
    assert header.endswith("; 0 earlier event(s) not judged)):")
    assert "\n".join(lines[8:-1]).strip() == summary
    assert lines[-1] == f"smoke: {6 - code} passed, {code} failed"


@contextmanager
def next_server() -> Iterator[int]:
    """The pid of a process started now: the server of the next ``compose up``, whose
    process start /metrics reports. The kernel's boot time, from which prometheus_client
    computes a start, is whole seconds, so the process starts over a second after the
    events written before it."""
    time.sleep(1.2)
    proc = subprocess.Popen(["sleep", "600"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_smoke_fails_a_server_that_wrote_no_events_after_an_earlier_one_did(
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """compose keeps the events volume: a second server, run with the layer disabled, wrote
    nothing; the first server's events must not pass it."""
    events_of_a_real_load(qwen35, events, "auto", monkeypatch)
    earlier = len(events.all())
    assert run_smoke(events, vllm_metrics_text(4)).returncode == 0  # the first server's run
    with next_server() as pid:
        out = run_smoke(events, vllm_metrics_text(4, pid))
    assert out.returncode == 1, out.stdout
    lines = out.stdout.splitlines()
    scope = f"; {earlier} earlier event(s) not judged)"
    assert lines[3].startswith("FAIL target decision: no target decision since the server ")
    assert lines[3].endswith(scope)
    assert lines[4].startswith("FAIL draft decision: no draft decision since the server")
    assert lines[5].startswith("FAIL loads: no hybrid_draft.loaded event for the target and ")
    assert lines[-1] == "smoke: 3 passed, 3 failed"


def test_smoke_passes_a_server_whose_mode_differs_from_an_earlier_ones(
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mode change between two ``compose up``s: the events file holds the first server's
    decisions (mode auto) before the second's (instanttensor); smoke judges the second's."""
    events_of_a_real_load(qwen35, events, "auto", monkeypatch)
    earlier = len(events.all())
    with next_server() as pid:
        events_of_a_real_load(qwen35, events, "instanttensor", monkeypatch)
        metrics = vllm_metrics_text(4, pid)
    modes = {e["mode"] for e in events.decisions("draft")}
    assert modes == {"auto", "instanttensor"}
    out = run_smoke(events, metrics, "instanttensor")
    assert out.returncode == 0, out.stdout
    lines = out.stdout.splitlines()
    assert lines[4].startswith("PASS draft decision: 1 draft decision(s) chose instanttensor")
    assert f"; {earlier} earlier event(s) not judged)):" in lines[7]
    # Judged on the whole file, as without a server start, the first server's decision fails it.
    whole = run_smoke(
        events, vllm_metrics_text(4).replace("process_start", "other_start"), "instanttensor"
    )
    assert whole.returncode == 1
    assert whole.stdout.splitlines()[3].startswith(
        "WARN events: the server's /metrics reports no process_start_time_seconds"
    )
