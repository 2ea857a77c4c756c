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


def vllm_metrics_text(
    draft_tokens: int | None,
    server_pid: int | None = None,
    accepted: int | None = None,
    engines: tuple[int, ...] = (1,),
) -> str:
    """Prometheus text as vLLM's own SpecDecodingProm renders it (a private registry), with
    prometheus_client's process metrics of ``server_pid`` (this process by default) as a
    vLLM API server's /metrics has them: ``draft_tokens`` proposed in drafts of two, of which
    ``accepted`` (default: half) were accepted, by each of ``engines``."""
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
        left = draft_tokens // 2 if accepted is None else accepted
        for _ in range(draft_tokens // 2):  # drafts of num_speculative_tokens each
            stats.observe_draft(num_draft_tokens=2, num_accepted_tokens=min(2, left))
            left -= min(2, left)
        for engine in engines:
            prom.observe(stats, engine_idx=engine)
    return prometheus_client.generate_latest(registry).decode()


def test_metrics_check_reads_vllms_draft_token_counter(vllm_runtime: Any) -> None:
    text = vllm_metrics_text(4)
    assert "vllm:spec_decode_num_draft_tokens_total" in text
    assert smoke.draft_tokens(text) == 4.0
    assert smoke.check_metrics(text).ok
    assert not smoke.check_metrics(vllm_metrics_text(0)).ok
    missing = smoke.check_metrics(vllm_metrics_text(None))
    assert not missing.ok and "is speculative decoding on?" in missing.detail


def test_acceptance_is_the_difference_of_two_reads_of_vllms_counters(vllm_runtime: Any) -> None:
    """Only the requests between the two reads count: what the server did before is not
    the smoke's, and two engines' counters add up."""
    before = vllm_metrics_text(6, accepted=6)
    after = vllm_metrics_text(26, accepted=16)
    got = smoke.acceptance(before, after)
    assert (got.accepted, got.drafted, got.rate) == (10.0, 20.0, 0.5)
    assert got.counters() == (
        "vllm:spec_decode_num_accepted_tokens_total +10, "
        "vllm:spec_decode_num_draft_tokens_total +20"
    )
    # Two engines (data parallelism): each one's counters, summed.
    both = smoke.acceptance(
        vllm_metrics_text(6, accepted=6, engines=(0, 1)),
        vllm_metrics_text(26, accepted=16, engines=(0, 1)),
    )
    assert (both.accepted, both.drafted) == (20.0, 40.0)
    assert smoke.acceptance(after, after).rate is None  # nothing drafted in between
    with pytest.raises(
        ValueError, match=r"accepted_tokens_total went down from 16 to 6 .*did the server restart"
    ):
        smoke.acceptance(after, before)
    with pytest.raises(ValueError, match="is speculative decoding on"):
        smoke.acceptance(before, vllm_metrics_text(None))
    # A first read without the counters (not this server's): the server's history is never
    # counted as the smoke's own.
    with pytest.raises(ValueError, match=r"the first read had no .*_total and the second has it"):
        smoke.acceptance(vllm_metrics_text(None), after)


def test_the_acceptance_floor_comes_from_the_checkpoints_claim_or_the_user(
    tmp_path: Path,
) -> None:
    from hybrid_draft.tools import cli

    agreeing, random = tmp_path / "agrees", tmp_path / "random"
    base = ["--arch", "deepseek_v3", "--preset", "tiny", "--no-tokenizer"]
    assert cli.main(["make-checkpoint", str(agreeing), *base]) == 0
    assert cli.main(["make-checkpoint", str(random), *base, "--random-draft"]) == 0
    index = "model.safetensors.index.json"
    floor = smoke.floor_for(None, "--min-acceptance", str(agreeing))
    assert floor == smoke.Floor(
        smoke.AGREEING_FLOOR,
        f"the checkpoint says its draft agrees with its target: {agreeing / index}",
    )
    assert smoke.floor_for(None, "x", str(random)) == smoke.Floor(
        smoke.DEFAULT_FLOOR,
        f"the default for a draft not known to agree (its draft is random: {random / index})",
    )
    assert smoke.floor_for(None, "x", str(tmp_path)).source == (
        f"the default for a draft not known to agree (no {tmp_path / index})"
    )
    assert smoke.floor_for(0.5, "SMOKE_MIN_ACCEPTANCE", str(agreeing)) == smoke.Floor(
        0.5, "set by SMOKE_MIN_ACCEPTANCE"
    )
    result = smoke.check_acceptance(
        vllm_metrics_text(0), vllm_metrics_text(40, accepted=38), floor, 3
    )
    assert result.ok and result.line() == (
        "PASS draft acceptance: 0.950 (38 of 40 draft tokens accepted during smoke's 3 "
        "completion(s): vllm:spec_decode_num_accepted_tokens_total +38, "
        "vllm:spec_decode_num_draft_tokens_total +40), at least the floor 0.9 (the checkpoint "
        f"says its draft agrees with its target: {agreeing / index})"
    )
    rejected = smoke.check_acceptance(
        vllm_metrics_text(0), vllm_metrics_text(40, accepted=0), floor, 3
    )
    assert not rejected.ok and rejected.detail.startswith("0.000 (0 of 40 draft tokens")
    assert ", below the floor 0.9 (the checkpoint says" in rejected.detail
    none = smoke.check_acceptance(vllm_metrics_text(4), vllm_metrics_text(4), floor, 3)
    assert not none.ok and none.detail.startswith(
        "the draft proposed no token during smoke's 3 completion(s)"
    )


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

    bodies: ClassVar[dict[str, str | list[str]]] = {}

    def do_GET(self) -> None:
        body = self.bodies.get(self.path)
        if isinstance(body, list):  # one answer per request, the last one kept
            body = body.pop(0) if len(body) > 1 else body[0]
        self._send(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(self.bodies.get(self.path))

    def _send(self, body: str | list[str] | None) -> None:
        assert not isinstance(body, list)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write((body or "").encode())

    def log_message(self, *args: Any) -> None:
        pass


def run_smoke(
    events: Events,
    metrics: str | list[str],
    mode: str = "",
    *extra: str,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``hybrid-draft smoke`` against a server that answers with vLLM's own bodies and the
    given /metrics texts, one per read (the last for any further read; a text alone: what
    the read after the completions gets, the one before them counting nothing yet);
    ``mode`` as compose's smoke service passes it (empty: the default)."""
    models, completions = protocol_bodies("served", ["hello"])
    if isinstance(metrics, str):
        metrics = [vllm_metrics_text(0), metrics]
    FakeServer.bodies = {
        "/health": "",
        "/v1/models": json.dumps(models),
        "/v1/completions": json.dumps(completions[0]),
        "/metrics": list(metrics),
    }
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {
            **os.environ,
            "INSTANTTENSOR_DRAFT_LOADER": mode,
            "SMOKE_MODEL": "served",
            **(env or {}),
        }
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
    verdict = "PASS" if draft_tokens else "FAIL"
    assert [ln.split(":")[0] for ln in lines[:7]] == [
        "PASS models",
        "PASS completions",
        f"{verdict} speculative metrics",
        f"{verdict} draft acceptance",
        "PASS target decision",
        "PASS draft decision",
        "PASS loads",
    ]
    if draft_tokens:  # half of them accepted, against the default floor: no --model-dir
        assert lines[3] == (
            "PASS draft acceptance: 0.500 (2 of 4 draft tokens accepted during smoke's 3 "
            "completion(s): vllm:spec_decode_num_accepted_tokens_total +2, "
            "vllm:spec_decode_num_draft_tokens_total +4), at least the floor 0.2 (the "
            "default; no --model-dir to read a claim from)"
        )
    # Then the events file's load report, as `hybrid-draft report` prints it, and the verdict.
    from hybrid_draft.tools import report

    summary = report.text(smoke.read_events(events.path.read_text().splitlines()))
    header = lines[8]
    assert header.startswith(f"load report ({events.path}, since the server started (")
    assert header.endswith("; 0 earlier event(s) not judged)):")
    assert "\n".join(lines[9:-1]).strip() == summary
    assert lines[-1] == f"smoke: {7 - 2 * code} passed, {2 * code} failed"


def test_smoke_holds_an_agreeing_draft_to_its_floor_and_any_other_to_the_users(
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """On a checkpoint that says its draft agrees (``--model-dir``), half the proposals
    rejected fail the smoke; the user's floor (``--min-acceptance``, else compose's
    ``SMOKE_MIN_ACCEPTANCE``) decides wherever it is set."""
    from hybrid_draft.tools import cli

    events_of_a_real_load(qwen35, events, "auto", monkeypatch)
    agreeing = tmp_path / "agrees"
    assert (
        cli.main(["make-checkpoint", str(agreeing), "--arch", "qwen3_5", "--preset", "tiny"]) == 0
    )
    half, all_of_them = vllm_metrics_text(40, accepted=20), vllm_metrics_text(40, accepted=40)
    index = agreeing / "model.safetensors.index.json"

    def acceptance_line(out: subprocess.CompletedProcess[str]) -> str:
        (line,) = [ln for ln in out.stdout.splitlines() if " draft acceptance: " in ln]
        return line

    out = run_smoke(events, half, "", "--model-dir", str(agreeing))
    assert out.returncode == 1 and out.stdout.splitlines()[-1] == "smoke: 6 passed, 1 failed"
    assert acceptance_line(out).startswith("FAIL draft acceptance: 0.500 (20 of 40 ")
    assert acceptance_line(out).endswith(
        f", below the floor 0.9 (the checkpoint says its draft agrees with its target: {index})"
    )
    out = run_smoke(events, all_of_them, "", "--model-dir", str(agreeing))
    assert out.returncode == 0 and acceptance_line(out).startswith(
        "PASS draft acceptance: 1.000 (40 of 40 draft tokens accepted"
    )
    floor = ["--model-dir", str(agreeing), "--min-acceptance", "0.5"]
    out = run_smoke(events, half, "", *floor, env={"SMOKE_MIN_ACCEPTANCE": "0.9"})
    assert out.returncode == 0
    assert acceptance_line(out).endswith(", at least the floor 0.5 (set by --min-acceptance)")
    few = vllm_metrics_text(40, accepted=4)
    assert run_smoke(events, few).returncode == 1  # 0.1: below the default floor
    out = run_smoke(events, few, env={"SMOKE_MIN_ACCEPTANCE": "0.05"})
    assert out.returncode == 0
    assert acceptance_line(out).endswith(", at least the floor 0.05 (set by SMOKE_MIN_ACCEPTANCE)")


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
    assert lines[4].startswith("FAIL target decision: no target decision since the server ")
    assert lines[4].endswith(scope)
    assert lines[5].startswith("FAIL draft decision: no draft decision since the server")
    assert lines[6].startswith("FAIL loads: no hybrid_draft.loaded event for the target and ")
    assert lines[-1] == "smoke: 4 passed, 3 failed"


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
    assert lines[5].startswith("PASS draft decision: 1 draft decision(s) chose instanttensor")
    assert f"; {earlier} earlier event(s) not judged)):" in lines[8]
    # Judged on the whole file, as without a server start, the first server's decision fails it.
    whole = run_smoke(
        events, vllm_metrics_text(4).replace("process_start", "other_start"), "instanttensor"
    )
    assert whole.returncode == 1
    assert whole.stdout.splitlines()[4].startswith(
        "WARN events: the server's /metrics reports no process_start_time_seconds"
    )
