"""The project's image, built for real with buildah on the local vLLM CPU base, with the
args ``docker buildx bake local`` passes: what the build ran, and what the image holds."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import buildah
from buildfiles import REPO, bake_args, compose
from conftest import Built

pytestmark = pytest.mark.image


def test_build_passes_exactly_the_args_bake_local_passes(image: Built) -> None:
    assert image.args == bake_args("local", {"BASE_IMAGE": image.base})
    assert image.args["BASE_IMAGE"] == image.base
    # compose.yaml runs the tag the bake file gives the local target.
    assert {s["image"] for s in compose()["services"].values()} == {image.tag}


def test_the_builds_doctor_step_passed(image: Built) -> None:
    """install-layer.sh ends with `hybrid-draft doctor`, in the build, on the base's Python."""
    doctor = [ln for ln in image.log.splitlines() if re.match(r"^(ok  |FAIL) \w+:", ln)]
    assert doctor and all(ln.startswith("ok ") for ln in doctor), "\n".join(doctor)
    checks = {ln.split()[1].rstrip(":") for ln in doctor}
    assert checks >= {"layer", "config", "vllm", "instanttensor"}, doctor
    assert any(
        re.search(
            r"vllm: [\d.]+, vllm\.model_executor\.model_loader\.get_model is "
            r"wrapped",
            ln,
        )
        for ln in doctor
    ), doctor
    assert any("layer: hybrid-draft" in ln and "/opt/venv/bin/python3" in ln for ln in doctor)


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


def test_entrypoint_and_command_are_the_bases(image: Built) -> None:
    mine, base = buildah.image_config(image.tag), buildah.image_config(image.base)
    for key in ("Entrypoint", "Cmd", "WorkingDir", "User", "Env"):
        assert mine.get(key) == base.get(key), key
    assert mine["Entrypoint"] == ["vllm", "serve"]


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


def test_the_layer_holds_no_wheel_build_backend_or_cache(image: Built, figures: dict) -> None:
    """What the layer adds over the base: the installed layer and its dependencies, the
    config; never the wheel, the build backend, pip's cache or the mounted build files."""
    mine = buildah.Container(image.tag, f"layer-{os.getpid()}")
    base = buildah.Container(image.base, f"layer-base-{os.getpid()}")
    try:
        new, old = _tree(mine.mount()), _tree(base.mount())
    finally:
        mine.remove()
        base.remove()
    added = sorted(p for p, st in new.items() if old.get(p) != st)
    figures["layer_files"] = len(added)
    figures["layer_file_bytes"] = sum(new[p][0] for p in added)
    assert "etc/hybrid-draft.toml" in added
    assert any(p.endswith("site-packages/hybrid_draft.pth") for p in added)
    assert any("/site-packages/instanttensor/" in p for p in added)
    leftovers = [
        p
        for p in added
        if p.endswith(".whl")
        or re.search(r"(^|/)(hatchling|hatch|pip-\w+|build)(/|-[\d.]+\.dist-info)", p)
        or p.startswith(("root/.cache", "tmp/", "src/", "dist/"))
    ]
    assert not leftovers, leftovers[:20]
