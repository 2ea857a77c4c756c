"""The mod form (scripts/make-mod) applied to a running base container the way
spark-vllm-docker's ``launch-cluster.sh --apply-mod DIR`` applies a mod, then compose's
server and smoke run in that container.

launch-cluster.sh (eugr/spark-vllm-docker) starts each node's container with a command that
waits for the mods (``while [ ! -f /tmp/mod_done ]; do sleep 1; done``, then the node's own
script), and for each mod: ``docker exec C mkdir -p /workspace/mods/NAME``, ``docker cp
DIR/. C:/workspace/mods/NAME/``, ``docker exec C bash -c "cd /workspace/mods/NAME && chmod
+x run.sh && ./run.sh"`` (a failure stops the launch), then ``docker exec C touch
/tmp/mod_done``; its ``exec`` action then runs ``vllm serve ...`` with ``docker exec``. Here
a buildah working container is the running container: one root file system that every
``buildah run`` shares as every ``docker exec`` does, ``buildah copy`` is ``docker cp``, and
each run is as the image's user, as ``docker exec`` is. Everything runs in a network
namespace with a loopback only: run.sh installs with no network at all.
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

import buildah
import composeflow
from buildfiles import REPO
from conftest import PYTHON_INFO, WORK, Bases, image_config, python_info, standin_for
from localbase import NEWER_INSTANTTENSOR, WHEELHOUSE
from textmod import PATCHED

pytestmark = pytest.mark.image

NAME = "hybrid-draft"
DEST = f"/workspace/mods/{NAME}"
WAIT = (
    "echo Waiting for mod application...; while [ ! -f /tmp/mod_done ]; do sleep 1; done; "
    "echo Mod applied, starting node...; exec sleep infinity"
)


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
def node(image: str, label: str, netns: str | None = None) -> Iterator[buildah.Container]:
    """A node's container, started as launch-cluster.sh starts it when mods are given."""
    hosts = {s: "127.0.0.1" for s in ("model", "server", "smoke")}
    ctr = buildah.Container(image, f"mod-{label}-{os.getpid()}", hosts)
    try:
        ctr.start(["bash", "-c", WAIT], log=WORK / f"mod-{label}-node.log", netns=netns)
        yield ctr
    finally:
        ctr.remove()


def apply_mod(ctr: buildah.Container, mod: Path, netns: str | None = None) -> str:
    """launch-cluster.sh's apply_mod_to_container for a directory, then the signal; raises
    with run.sh's output when it fails (the launch stops there)."""
    assert ctr.run(["mkdir", "-p", DEST], netns=netns).returncode == 0
    ctr.copy(mod, DEST + "/")
    out = ctr.run(["bash", "-c", f"cd {DEST} && chmod +x run.sh && ./run.sh"], netns=netns)
    if out.returncode != 0:
        raise ModFailed(out.stdout + out.stderr)
    assert ctr.run(["touch", "/tmp/mod_done"], netns=netns).returncode == 0
    return out.stdout + out.stderr


class ModFailed(AssertionError):
    pass


def said(output: str) -> list[str]:
    """The lines a command printed, without buildah's own about its exit status."""
    return [
        ln
        for ln in output.splitlines()
        if ln.strip() and not re.fullmatch(r"(subprocess exited with|Error: exit) status \d+", ln)
    ]


def dists_in(ctr: buildah.Container) -> dict[str, str]:
    out = ctr.run(["python3", "-c", PYTHON_INFO])
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["dists"]


def test_the_mod_installs_offline_into_a_running_container_which_then_serves(
    bases: Bases, mod_dir: Path, model_volume: Path, figures: dict
) -> None:
    base = bases["official"]
    before = python_info(base)["dists"]
    work = WORK / "mod-serve"
    named = {"default-model": model_volume, "events": work / "events"}
    named["events"].mkdir(parents=True)
    purelib = python_info(base)["purelib"]
    services = {
        s.name: s
        for s in composeflow.resolve(
            {"HYBRID_DRAFT_IMAGE": base}, named, standin_for(purelib), image_config(base)
        )
    }
    netns = f"{buildah.PREFIX}mod-{os.getpid()}"
    with composeflow.network_namespace(netns), node(base, "serve", netns) as ctr:
        start = time.monotonic()
        output = apply_mod(ctr, mod_dir, netns)
        figures["mod_apply_s"] = time.monotonic() - start
        (work / "run.sh.log").write_text(output)
        doctor = [ln for ln in output.splitlines() if re.match(r"^(ok  |FAIL) \w+:", ln)]
        assert doctor and all(ln.startswith("ok ") for ln in doctor), output[-3000:]
        assert f"InstantTensor {NEWER_INSTANTTENSOR} among them" in output
        assert "nothing the base had changed" in output
        after = dists_in(ctr)
        assert {n: v for n, v in after.items() if n in before} == before
        assert after["instanttensor"] == NEWER_INSTANTTENSOR
        assert set(after) - set(before) <= {"hybrid-draft", "structlog"}

        # launch-cluster.sh's `exec vllm serve ...` and then the smoke test, as compose
        # runs them (model, server, smoke), each a `docker exec` into the node.
        for name in ("model", "server"):
            s = services[name]
            s.container, s.log = ctr, work / f"{name}.log"
            s.proc = ctr.start(s.argv, env=s.env, volumes=s.volumes, netns=netns, log=s.log)
            figures[f"mod_{name}_healthy_s"] = composeflow.wait_healthy(s, netns)
        smoke = services["smoke"]
        out = ctr.run(smoke.argv, env=smoke.env, volumes=smoke.volumes, netns=netns, timeout=600)
        (work / "smoke.log").write_text(out.stdout + out.stderr)
        figures["mod_serve_and_smoke_s"] = time.monotonic() - start
        assert out.returncode == 0, out.stdout[-4000:] + composeflow.tail(
            services["server"].log, 80
        )
        assert re.search(r"^smoke: \d+ passed, 0 failed$", out.stdout, re.M), out.stdout
    events = [
        json.loads(ln)
        for ln in (named["events"] / "hybrid-draft.jsonl").read_text().splitlines()
        if ln.strip()
    ]
    assert any(e["event"] == "hybrid_draft.patched" for e in events)
    (draft,) = [e for e in events if e["event"] == "hybrid_draft.decision" and e["role"] == "draft"]
    assert (draft["action"], draft["reason"]) == ("switched", "same_checkpoint")


def test_the_mod_refuses_a_container_with_the_text_patch_mod(bases: Bases, mod_dir: Path) -> None:
    base = bases["stacked-mod"]
    patched = f"{python_info(base)['purelib']}/{PATCHED}"
    with node(base, "stacked") as ctr:
        before = dists_in(ctr)
        with pytest.raises(ModFailed) as failed:
            apply_mod(ctr, mod_dir)
        assert dists_in(ctr) == before
    assert said(str(failed.value)) == [
        f"install-layer: {patched} carries the spark-vllm mod instanttensor-hybrid-draft-loader"
        " (a text patch of get_model), which hybrid-draft replaces and never stacks on: "
        "reinstall vLLM in this Python (or start from a container without that mod: drop it "
        "from --apply-mod), then install again"
    ]


def test_the_mod_run_as_a_non_root_user_says_it_needs_root(bases: Bases, mod_dir: Path) -> None:
    """In the non-root image `docker exec` runs as vllm, which can neither create
    /workspace/mods nor chmod what `docker cp` put there: --apply-mod stops before run.sh.
    A user who copies the mod in and runs it as vllm gets the reason in one line."""
    base = bases["official-nonroot"]
    with node(base, "nonroot") as ctr:
        assert ctr.run(["mkdir", "-p", DEST], user="0:0").returncode == 0
        ctr.copy(mod_dir, DEST + "/")
        out = ctr.run(["sh", "-c", f"cd {DEST} && ./run.sh"])
    assert out.returncode == 2
    assert said(out.stdout + out.stderr) == [
        f"install-layer: {python_info(base)['purelib']} is not writable by uid 2000: install "
        "as root (in a Dockerfile, USER root for this step; in a running container, docker "
        "exec -u 0)"
    ]
