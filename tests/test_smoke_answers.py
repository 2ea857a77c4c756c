"""``smoke`` against servers that answer wrongly or slowly: every malformed answer is a FAIL line
naming the endpoint and what it returned, and the whole run ends within ``--deadline`` even
when a server sends its headers and then trickles bytes (which no read timeout stops)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

pytestmark = pytest.mark.once  # the same on every vLLM release (docs/testing.md)

MODELS = json.dumps({"object": "list", "data": [{"id": "served", "object": "model"}]})
COMPLETION = json.dumps({"choices": [{"index": 0, "text": "hello"}]})
METRICS = (
    "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
    "vllm:spec_decode_num_draft_tokens_total 4.0\n"
)

Answer = Callable[[BaseHTTPRequestHandler], None]


def body(text: str, status: int = 200) -> Answer:
    def send(h: BaseHTTPRequestHandler) -> None:
        data = text.encode()
        h.send_response(status)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    return send


def trickle_body(h: BaseHTTPRequestHandler) -> None:
    """Headers at once, then one byte every 0.2 s of a body announced as 10 kB."""
    h.send_response(200)
    h.send_header("Content-Length", "10000")
    h.end_headers()
    for _ in range(10000):
        h.wfile.write(b" ")
        h.wfile.flush()
        time.sleep(0.2)


def trickle_headers(h: BaseHTTPRequestHandler) -> None:
    """The status line, then a header one byte every 0.2 s: never the end of the headers."""
    h.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    for _ in range(10000):
        h.wfile.write(b"a")
        h.wfile.flush()
        time.sleep(0.2)


class Server(BaseHTTPRequestHandler):
    answers: ClassVar[dict[str, Answer]] = {}

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer()

    def _answer(self) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.answers.get(self.path, body("not found", 404))(self)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Callable[..., str]]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Server)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    def serve(**answers: Answer) -> str:
        Server.answers = {
            "/health": body(""),
            "/v1/models": body(MODELS),
            "/v1/completions": body(COMPLETION),
            "/metrics": body(METRICS),
            **{f"/{k.replace('__', '/')}": v for k, v in answers.items()},
        }
        return f"http://127.0.0.1:{httpd.server_port}"

    yield serve
    httpd.shutdown()
    httpd.server_close()


def smoke(url: str, events: Path, *args: str, limit: float = 120) -> tuple[int, list[str]]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybrid_draft",
            "smoke",
            "--url",
            url,
            "--events-file",
            str(events),
            "--mode",
            "auto",
            "--completions",
            "1",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=limit,
    )
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, out.stdout.splitlines()


@pytest.fixture
def events(tmp_path: Path) -> Path:
    path = tmp_path / "events.jsonl"
    path.write_text("")
    return path


def fail_line(lines: list[str], check: str) -> str:
    (line,) = [ln for ln in lines if ln.startswith(f"FAIL {check}:")]
    return line


@pytest.mark.parametrize(
    ("answer", "shown"),
    [
        ("[1, 2]", "returned [1, 2], not an object with a data list of models"),
        ('{"data": "x"}', 'returned {"data": "x"}, not an object with a data list of models'),
        ('{"data": [{"name": 3}]}', 'lists no model: {"data": [{"name": 3}]}'),
        ("<html>busy</html>", "returned '<html>busy</html>', not JSON"),
        ("[" * 100_000, "returned '" + "[" * 76 + "..., not JSON"),
    ],
)
def test_a_malformed_model_list_fails_naming_it(
    answer: str, shown: str, server: Callable[..., str], events: Path
) -> None:
    url = server(v1__models=body(answer))
    code, lines = smoke(url, events)
    assert code == 1
    assert fail_line(lines, "models") == f"FAIL models: GET {url}/v1/models {shown}"
    assert lines[-1] == "smoke: 0 passed, 1 failed"


@pytest.mark.parametrize(
    ("answer", "shown"),
    [
        (body("<html><body>metrics</body></html>"), "returned '<html><body>metrics</body></html>'"),
        (body("vllm:spec_decode_num_draft_tokens_total four"), "not Prometheus text"),
        (body("gone", 503), "HTTP 503: 'gone'"),
    ],
)
def test_metrics_that_are_not_prometheus_text_fail_naming_the_endpoint(
    answer: Answer, shown: str, server: Callable[..., str], events: Path
) -> None:
    url = server(metrics=answer)
    code, lines = smoke(url, events)
    line = fail_line(lines, "speculative metrics")
    assert code == 1 and f"{url}/metrics" in line and shown in line, line
    assert lines[0].startswith("PASS models") and lines[1].startswith("PASS completions")


@pytest.mark.parametrize(
    ("answer", "shown"),
    [
        (body('{"choices": "none"}'), 'returned {"choices": "none"}'),
        (body("[]"), "returned []"),
        (body("{", 500), "POST @URL/v1/completions: HTTP 500: '{'"),
    ],
)
def test_malformed_completions_fail_saying_what_came_back(
    answer: Answer, shown: str, server: Callable[..., str], events: Path
) -> None:
    url = server(v1__completions=answer)
    _, lines = smoke(url, events)
    line = fail_line(lines, "completions")
    assert line.startswith("FAIL completions: 1 of 1 returned no text") and (
        shown.replace("@URL", url) in line
    ), line


@pytest.mark.parametrize("answer", [trickle_body, trickle_headers])
@pytest.mark.parametrize("endpoint", ["v1__models", "metrics"])
def test_a_trickling_server_cannot_outlast_the_deadline(
    answer: Answer, endpoint: str, server: Callable[..., str], events: Path
) -> None:
    url = server(**{endpoint: answer})
    code, lines = smoke(url, events, "--deadline", "4", limit=60)  # a hang times out
    assert code == 1, lines
    path = "/" + endpoint.replace("__", "/")
    line = fail_line(lines, "models" if endpoint == "v1__models" else "speculative metrics")
    assert f"GET {url}{path}: no complete answer within" in line, line
    assert lines[-1].startswith("smoke: ")


def test_the_deadline_includes_the_wait_for_health(
    server: Callable[..., str], events: Path
) -> None:
    url = server(health=body("starting", 503))
    code, lines = smoke(url, events, "--wait", "600", "--deadline", "3", limit=60)
    assert code == 1
    assert lines == [f"FAIL health: {url}/health did not answer within 3 s"]


def test_an_answer_over_the_size_limit_fails(
    server: Callable[..., str], events: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybrid_draft.tools import smoke as command

    monkeypatch.setattr(command, "BODY_LIMIT", 1000)
    url = server(metrics=body("# " + "x" * 5000 + "\n"))
    (result,) = [
        r
        for r in command.run_checks(url, None, str(events), "auto", 1)
        if r.name == "speculative metrics"
    ]
    assert not result.ok and result.detail == (f"GET {url}/metrics: answered more than 1,000 bytes")
