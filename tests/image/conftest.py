"""Fixtures of the image test (scripts/image-test): the local vLLM CPU base, the project's
image built on it with buildah exactly as ``docker buildx bake local`` would, and the
figures docs/testing.md reports (timings, sizes, disk use), printed at the end of the run.

Run as root (buildah, debootstrap, network namespaces). Logs and the compose flow's
volumes go to build/image-test/ (the logs are kept for a failed CI run to be read).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: buildfiles

import buildah
import composeflow
import localbase
from buildfiles import REPO, bake_args, bake_tags

WORK = REPO / "build" / "image-test"
FIGURES: dict[str, Any] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    if os.geteuid() != 0:
        pytest.exit("the image test needs root (buildah, debootstrap, ip netns)", returncode=2)
    for tool in ("buildah", "debootstrap", "ip"):
        if shutil.which(tool) is None:
            pytest.exit(
                f"the image test needs {tool}: run scripts/image-test, which installs it",
                returncode=2,
            )
    buildah.remove_leftovers()
    composeflow.remove_leftover_namespaces()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    FIGURES["start"] = time.monotonic()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if "start" not in FIGURES:
        return
    FIGURES["total_s"] = time.monotonic() - FIGURES.pop("start")
    try:
        FIGURES["storage_bytes"] = buildah.Store.current().disk_bytes()
    except Exception as exc:  # the figures are a report, never a failure
        FIGURES["storage_bytes"] = repr(exc)
    terminalreporter.section("image test figures")
    for key, value in FIGURES.items():
        if isinstance(value, float):
            value = f"{value:.1f}"
        elif isinstance(value, int) and key.endswith("bytes"):
            value = f"{value:,} ({value / 2**20:.1f} MiB)"
        terminalreporter.write_line(f"{key:32} {value}")
    (WORK / "figures.json").write_text(json.dumps(FIGURES, indent=1, default=str))


@pytest.fixture(scope="session")
def figures() -> dict[str, Any]:
    return FIGURES


@pytest.fixture(scope="session")
def work() -> Path:
    return WORK


@dataclass
class Built:
    tag: str
    base: str
    args: dict[str, str]
    log: str
    returncode: int


def build_project(base: str, tag: str, log: Path) -> Built:
    """The project's Dockerfile with exactly the args ``docker buildx bake local`` passes,
    BASE_IMAGE overridden (as ``BASE_IMAGE=... docker buildx bake`` does)."""
    args = bake_args("local", {"BASE_IMAGE": base})
    out = buildah.build(REPO / "Dockerfile", REPO, tag, build_args=args, log=log)
    return Built(tag, base, args, out.stdout, out.returncode)


@pytest.fixture(scope="session")
def base_image() -> str:
    (tag,) = bake_tags("local")
    for name in buildah.image_names("localhost/" + tag.rsplit(":", 1)[0]):
        buildah.remove_image(name)  # rebuilt below; it may hold an older base
    timings: dict[str, float] = {}
    start = time.monotonic()
    base = localbase.base(timings, WORK)
    FIGURES.update(timings)
    FIGURES["base_ready_s"] = time.monotonic() - start
    FIGURES["base_image"] = base
    return base


@pytest.fixture(scope="session")
def image(base_image: str) -> Built:
    (tag,) = bake_tags("local")
    start = time.monotonic()
    built = build_project(base_image, tag, WORK / "image-build.log")
    FIGURES["image_build_s"] = time.monotonic() - start
    if built.returncode != 0:
        pytest.fail(
            f"the image did not build (log: {WORK / 'image-build.log'}):\n{built.log[-4000:]}"
        )
    size, layers = buildah.Store.current().size_over(tag, base_image)
    FIGURES["layer_over_base_bytes"] = size
    FIGURES["layers_over_base"] = layers
    return built


@pytest.fixture(scope="session")
def image_cfg(image: Built) -> dict[str, dict[str, Any]]:
    """The OCI config of each image compose.yaml names (all the one built here)."""
    return {image.tag: buildah.image_config(image.tag)}


@pytest.fixture(scope="session")
def site_packages(image: Built) -> str:
    ctr = buildah.Container(image.tag, "site-packages")
    try:
        out = ctr.run(["python3", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()
    finally:
        ctr.remove()


@pytest.fixture(scope="session")
def standin(site_packages: str) -> dict[str, str]:
    """Host file -> path in the image, for the stand-in of InstantTensor's GPU read."""
    files = composeflow.cpu_run()["standin"]["files"]
    missing = [f for f in files if not (REPO / f).is_file()]
    assert not missing, f"the stand-in's files are missing: {missing}"
    return {str(REPO / f): f"{site_packages}/{Path(f).name}" for f in files}


@pytest.fixture
def container(image: Built) -> Iterator[buildah.Container]:
    ctr = buildah.Container(image.tag, f"check-{os.getpid()}")
    try:
        yield ctr
    finally:
        ctr.remove()
