"""The compose smoke test's checks, fed real inputs: events the layer wrote while real vLLM
loaded a target and its draft on the CPU, Prometheus text from vLLM's own spec-decode
metrics, and response bodies built with vLLM's own OpenAI protocol models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
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
    assert not missing.ok and missing.detail == "no hybrid_draft.loaded event for the draft"


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


def vllm_metrics_text(draft_tokens: int | None) -> str:
    """Prometheus text as vLLM's own SpecDecodingProm renders it (a private registry)."""
    import prometheus_client
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    registry = prometheus_client.CollectorRegistry()

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
    models, completions = protocol_bodies("served", ["hello"])
    FakeServer.bodies = {
        "/health": "",
        "/v1/models": json.dumps(models),
        "/v1/completions": json.dumps(completions[0]),
        "/metrics": vllm_metrics_text(draft_tokens),
    }
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "INSTANTTENSOR_DRAFT_LOADER": "", "SMOKE_MODEL": "served"}
        out = subprocess.run(
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
            ],
            capture_output=True,
            text=True,
            env=env,
        )
    finally:
        server.shutdown()
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
    assert "\n".join(lines[6:-1]).strip() == (f"load report ({events.path}):\n{summary}")
    assert lines[-1] == f"smoke: {6 - code} passed, {code} failed"
