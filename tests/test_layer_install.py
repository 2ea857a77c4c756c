"""docker/install-layer.sh and scripts/make-mod on small stand-in bases: virtual
environments whose "installed" packages are metadata only. What the install holds, adds and
refuses, in seconds and without root; the image test (tests/image) runs the same script on
real vLLM bases, and the mod made here in a running container."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from conftest import REPO

NEWER = "0.2.3+hybriddraft.test"
MARKER = "# spark-vllm mod: instanttensor-hybrid-draft-loader v1"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", out, REPO],
        check=True,
        capture_output=True,
    )
    (found,) = out.glob("hybrid_draft-*.whl")
    return found


def make_base(root: Path) -> tuple[Path, Path]:
    """A Python with pip and nothing else: (python, its site-packages)."""
    venv.create(root, with_pip=True)
    python = root / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return python, Path(site)


def installed(site: Path, name: str, version: str, url: str | None = None) -> None:
    """A distribution record as an installer leaves it; with ``url``, one installed from a
    local wheel file (``name @ file://...`` in ``pip freeze``)."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("uv\n")
    (info / "RECORD").write_text("")
    if url:
        (info / "direct_url.json").write_text(json.dumps({"url": url, "archive_info": {}}))


def layer_dependencies() -> list[tuple[str, str]]:
    """(name, lowest version it accepts) of each of the layer's dependencies on this Python."""
    with open(REPO / "pyproject.toml", "rb") as f:
        deps = [Requirement(d) for d in tomllib.load(f)["project"]["dependencies"]]
    out = []
    for dep in deps:
        if dep.marker is None or dep.marker.evaluate():
            (lowest,) = [s.version for s in dep.specifier if s.operator == ">="]
            out.append((dep.name, lowest))
    return out


def versions(python: Path) -> dict[str, str]:
    out = subprocess.run(
        [
            python,
            "-c",
            "import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def install(python: Path, wheel: Path, *pre: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(REPO / "docker" / "install-layer.sh"), *pre, python, wheel, REPO / "pins.txt"],
        capture_output=True,
        text=True,
    )


def test_the_install_keeps_a_newer_instanttensor_from_a_local_wheel(
    tmp_path: Path, wheel: Path
) -> None:
    """The base's InstantTensor, newer than pins.txt's and installed from a wheel file (so
    `pip freeze` shows no `==` line for it), stays; only the layer itself is added."""
    python, site = make_base(tmp_path / "base")
    installed(site, "instanttensor", NEWER, url="file:///wheels/instanttensor.whl")
    for name, version in layer_dependencies():  # the base has them all: nothing to fetch
        installed(site, name, version)
    freeze = subprocess.run(
        [python, "-m", "pip", "freeze"], check=True, capture_output=True, text=True
    ).stdout
    assert "instanttensor @ file:///wheels/instanttensor.whl" in freeze  # the case at hand
    before = versions(python)
    offline = tmp_path / "wheels"
    offline.mkdir()
    (offline / wheel.name).write_bytes(wheel.read_bytes())

    out = install(python, wheel, "--offline", str(offline))

    lines = out.stdout.splitlines()
    assert f"InstantTensor {NEWER} among them" in lines[0], out.stdout + out.stderr
    assert "install-layer: added hybrid-draft 0.1.0; nothing the base had changed" in lines
    after = versions(python)
    assert after.pop("hybrid-draft") == "0.1.0"
    assert after == before
    # The doctor ran last and failed: this base has no vLLM.
    assert out.returncode != 0 and "FAIL vllm:" in out.stdout


def test_the_install_refuses_a_vllm_patched_by_the_text_patch_mod(
    tmp_path: Path, wheel: Path
) -> None:
    python, site = make_base(tmp_path / "base")
    loader = site / "vllm" / "model_executor" / "model_loader" / "__init__.py"
    loader.parent.mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    loader.write_text(f"{MARKER}\ndef _instanttensor_draft_load_config(): ...\n")
    before = versions(python)

    out = install(python, wheel)

    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.splitlines() == [
        f"install-layer: {loader} carries the spark-vllm mod instanttensor-hybrid-draft-loader"
        " (a text patch of get_model), which hybrid-draft replaces and never stacks on: "
        "reinstall vLLM in this Python (or start from a container without that mod: drop it "
        "from --apply-mod), then install again"
    ]
    assert versions(python) == before


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["--offline", "/nonexistent/wheels", sys.executable],
            "--offline /nonexistent/wheels is not a directory of wheels",
        ),
        (["/nonexistent/python"], "/nonexistent/python is not a Python"),
    ],
)
def test_bad_arguments_get_one_line(args: list[str], said: str, wheel: Path) -> None:
    out = subprocess.run(
        ["sh", str(REPO / "docker" / "install-layer.sh"), *args, str(wheel)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert out.stderr.splitlines() == [f"install-layer: {said}"]


def test_make_mod_answers_bad_input_in_one_line(tmp_path: Path) -> None:
    make_mod = ["bash", str(REPO / "scripts" / "make-mod")]
    for args, said in (
        ([], "usage: make-mod OUT_DIR"),
        ([str(tmp_path), "--python-version", "three"], "--python-version takes X.Y"),
        ([str(tmp_path), "--frobnicate"], "unknown option --frobnicate"),
    ):
        out = subprocess.run([*make_mod, *args], capture_output=True, text=True)
        assert out.returncode == 2, args
        assert len(out.stderr.splitlines()) == 1 and said in out.stderr, out.stderr
    (tmp_path / "hybrid-draft").mkdir()
    (tmp_path / "hybrid-draft" / "run.sh").write_text("")
    out = subprocess.run([*make_mod, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"make-mod: {tmp_path}/hybrid-draft is not empty (--force replaces it)"
    )
