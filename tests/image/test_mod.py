"""The mod form (scripts/make-mod) applied to a running base container the way
spark-vllm-docker's ``launch-cluster.sh --apply-mod DIR`` applies a mod, in the test's own
Docker Engine (tests/image/engine.py), then compose.yaml's flow on what that gives.

launch-cluster.sh (eugr/spark-vllm-docker) starts each node's container with a command that
waits for the mods (``while [ ! -f /tmp/mod_done ]; do sleep 1; done``, then the node's own
script), and for each mod: ``docker exec C mkdir -p /workspace/mods/NAME``, ``docker cp
DIR/. C:/workspace/mods/NAME/``, ``docker exec C bash -c "cd /workspace/mods/NAME && chmod
+x run.sh && ./run.sh"`` (a failure stops the launch), then ``docker exec C touch
/tmp/mod_done``; its ``exec`` action then runs ``vllm serve ...`` with ``docker exec``. Here
the same docker commands run against the base's own container (``docker run --entrypoint
bash BASE -c WAIT``: the waiting shell replaces the base's ``vllm serve`` as the node's own
command does), with ``--network none``: run.sh installs with no network at all.

Served with the real ``docker compose``, from ``docker commit`` of the modded container with
the base's entrypoint and command put back: the very file system, user and environment a
spark-vllm-docker user's ``docker exec vllm serve`` runs in, where compose.yaml's own
services (the checkpoint, the server with its health check, the smoke test) then run as they
run on an image built by bake, with the CPU override (tests/image/cpu-compose.yaml). The one
difference from launch-cluster.sh's ``exec`` is that each service is a container of that
image instead of an exec into the node.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from buildfiles import REPO
from conftest import PYTHON_INFO, WORK, Bases, in_engine, python_info
from engine import CPU_VARIABLES, Engine, Up, passed, stood_in_reads
from localbase import NEWER_INSTANTTENSOR, WHEELHOUSE
from textmod import PATCHED

pytestmark = pytest.mark.image

NAME = "hybrid-draft"
DEST = f"/workspace/mods/{NAME}"
WAIT = (
    "echo Waiting for mod application...; while [ ! -f /tmp/mod_done ]; do sleep 1; done; "
    "echo Mod applied, starting node...; exec sleep infinity"
)
#: The image ``docker commit`` makes of the modded node, which compose then runs.
MODDED = "hybrid-draft/image-test:modded"


@pytest.fixture(scope="module")
def mod_dir(bases: Bases, figures: dict) -> Path:
    """`bash scripts/make-mod OUT_DIR` for the bases' Python and this machine's platform,
    with pip reading the shared wheelhouse only (no index)."""
    version = python_info(bases["official"])["python"]
    out = WORK / "mod"
    start = time.monotonic()
    made = subprocess.run(
        [
            "bash",
            str(REPO / "scripts" / "make-mod"),
            str(out),
            "--python-version",
            version,
            "--platform",
            f"manylinux_2_28_{platform.machine()}",
        ],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PYTHON": sys.executable,
            "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": str(WHEELHOUSE),
        },
    )
    figures["make_mod_s"] = time.monotonic() - start
    assert made.returncode == 0, made.stdout + made.stderr
    mod = out / NAME
    assert sorted(p.name for p in mod.iterdir()) == [
        "install-layer.sh",
        "pins.txt",
        "run.sh",
        "wheels",
    ]
    assert (mod / "install-layer.sh").read_bytes() == (
        REPO / "docker" / "install-layer.sh"
    ).read_bytes()
    return mod


@contextlib.contextmanager
def node(engine: Engine, image: str, label: str) -> Iterator[str]:
    """A node's container, started as launch-cluster.sh starts it when mods are given;
    removed at the end."""
    name = f"hybrid-draft-image-test-mod-{label}"
    engine.docker("rm", "--force", name, check=False)
    engine.docker(
        "run", "--detach", "--name", name, "--network", "none", "--entrypoint", "bash",
        image, "-c", WAIT,
    )  # fmt: skip
    try:
        yield name
    finally:
        engine.docker("logs", name, log=WORK / f"mod-{label}-node.log", check=False)
        engine.docker("rm", "--force", name, check=False)


def apply_mod(engine: Engine, ctr: str, mod: Path) -> str:
    """launch-cluster.sh's apply_mod_to_container for a directory, then the signal; raises
    with run.sh's output when it fails (the launch stops there)."""
    engine.docker("exec", ctr, "mkdir", "-p", DEST)
    engine.docker("cp", f"{mod}/.", f"{ctr}:{DEST}/")
    out = engine.docker(
        "exec", ctr, "bash", "-c", f"cd {DEST} && chmod +x run.sh && ./run.sh", check=False
    )
    if out.returncode != 0:
        raise ModFailed(out.stdout)
    engine.docker("exec", ctr, "touch", "/tmp/mod_done")
    return out.stdout


class ModFailed(AssertionError):
    pass


def said(output: str) -> list[str]:
    """The lines a command printed."""
    return [ln for ln in output.splitlines() if ln.strip()]


def dists_in(engine: Engine, ctr: str) -> dict[str, str]:
    out = engine.docker("exec", ctr, "python3", "-c", PYTHON_INFO)
    return json.loads(out.stdout)["dists"]


def commit(engine: Engine, ctr: str, base: str, tag: str) -> None:
    """``docker commit`` of the node, with the base's entrypoint and command (the node's
    are the waiting shell's)."""

    def config(ref: str, key: str) -> list[str] | None:
        fmt = f"{{{{json .Config.{key}}}}}"
        return json.loads(engine.docker("image", "inspect", "--format", fmt, ref).stdout)

    changes = [
        f"ENTRYPOINT {json.dumps(config(base, 'Entrypoint') or [])}",
        f"CMD {json.dumps(config(base, 'Cmd') or [])}",
    ]
    engine.docker("commit", *(a for c in changes for a in ("--change", c)), ctr, tag)
    for key in ("Entrypoint", "User", "WorkingDir", "Env"):
        assert config(tag, key) == config(base, key), key


def test_the_mod_installs_offline_into_a_running_container_which_then_serves(
    engine: Engine, bases: Bases, mod_dir: Path, work: Path, figures: dict
) -> None:
    base = bases["official"]
    before = python_info(base)["dists"]
    start = time.monotonic()
    in_engine("official")
    figures["mod_engine_load_base_s"] = time.monotonic() - start
    with node(engine, base, "serve") as ctr:
        start = time.monotonic()
        output = apply_mod(engine, ctr, mod_dir)
        figures["mod_apply_s"] = time.monotonic() - start
        (work / "run.sh.log").write_text(output)
        doctor = [ln for ln in output.splitlines() if re.match(r"^(ok  |FAIL) \w+:", ln)]
        assert doctor and all(ln.startswith("ok ") for ln in doctor), output[-3000:]
        assert f"InstantTensor {NEWER_INSTANTTENSOR} among them" in output
        assert "nothing the base had changed" in output
        after = dists_in(engine, ctr)
        assert {n: v for n, v in after.items() if n in before} == before
        assert after["instanttensor"] == NEWER_INSTANTTENSOR
        assert set(after) - set(before) <= {"hybrid-draft", "structlog"}
        start = time.monotonic()
        commit(engine, ctr, base, MODDED)
        figures["mod_commit_s"] = time.monotonic() - start

    variables = {
        **CPU_VARIABLES,
        "HYBRID_DRAFT_IMAGE": MODDED,
        "STANDIN_SITE_PACKAGES": python_info(base)["purelib"],
    }
    engine.remove_volume("events", variables)
    start = time.monotonic()
    out = engine.up(variables, work / "compose-up-mod.log")
    figures["compose_up_mod_s"] = time.monotonic() - start
    result = Up(out.returncode, out.stdout, engine.volume_path("events"))
    passed(result)
    events = result.events()
    assert any(e["event"] == "hybrid_draft.patched" for e in events)
    (draft,) = [e for e in events if e["event"] == "hybrid_draft.decision" and e["role"] == "draft"]
    assert (draft["action"], draft["reason"]) == ("switched", "same_checkpoint")
    assert len(stood_in_reads(result)) == 1  # the target's, through InstantTensor's read


def test_the_mod_refuses_a_container_with_the_text_patch_mod(engine: Engine, mod_dir: Path) -> None:
    base = in_engine("stacked-mod")
    patched = f"{python_info(base)['purelib']}/{PATCHED}"
    with node(engine, base, "stacked") as ctr:
        before = dists_in(engine, ctr)
        with pytest.raises(ModFailed) as failed:
            apply_mod(engine, ctr, mod_dir)
        assert dists_in(engine, ctr) == before
    assert said(str(failed.value)) == [
        f"install-layer: {patched} carries the spark-vllm mod instanttensor-hybrid-draft-loader"
        " (a text patch of get_model), which hybrid-draft replaces and never stacks on: "
        "reinstall vLLM in this Python (or start from a container without that mod: drop it "
        "from --apply-mod), then install again"
    ]


def test_the_mod_run_as_a_non_root_user_says_it_needs_root(engine: Engine, mod_dir: Path) -> None:
    """In the non-root image `docker exec` runs as vllm, which can neither create
    /workspace/mods nor chmod what `docker cp` put there: --apply-mod stops before run.sh.
    A user who copies the mod in and runs it as vllm gets the reason in one line."""
    base = in_engine("official-nonroot")
    with node(engine, base, "nonroot") as ctr:
        assert engine.docker("exec", ctr, "mkdir", "-p", DEST, check=False).returncode != 0
        engine.docker("exec", "--user", "0", ctr, "mkdir", "-p", DEST)
        engine.docker("cp", f"{mod_dir}/.", f"{ctr}:{DEST}/")
        out = engine.docker("exec", ctr, "sh", "-c", f"cd {DEST} && ./run.sh", check=False)
    assert out.returncode == 2
    assert said(out.stdout) == [
        f"install-layer: {python_info(base)['purelib']} is not writable by uid 2000: install "
        "as root (in a Dockerfile, USER root for this step; in a running container, docker "
        "exec -u 0)"
    ]
