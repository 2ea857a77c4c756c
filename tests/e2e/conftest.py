"""The end-to-end environment: vLLM's CPU build in a second virtual environment, the
hybrid-draft wheel installed there by docker/install-layer.sh (as the image installs it),
the test-only InstantTensor stand-in, and generated checkpoints.

Driven from the main test environment with subprocesses. ``HYBRID_DRAFT_E2E=0`` skips it.
Every step's wall time is printed in pytest's terminal summary.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from hybrid_draft.tools import synth

from .harness import (
    ENABLE_ENV,
    STANDIN,
    TIMINGS,
    VENV,
    WHEELHOUSE,
    Checkpoint,
    CpuEnv,
    Timer,
    build_wheel,
    enabled,
    run,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow end-to-end tests run last, after the quick ones; skipped when disabled."""
    e2e = [i for i in items if i.get_closest_marker("e2e")]
    if not enabled():
        skip = pytest.mark.skip(reason=f"{ENABLE_ENV}=0: the end-to-end tests are off")
        for item in e2e:
            item.add_marker(skip)
    items[:] = [i for i in items if i not in e2e] + e2e


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TIMINGS:
        terminalreporter.section("end-to-end timings (wall seconds)")
        for name, seconds in TIMINGS.items():
            terminalreporter.write_line(f"{name:<44}{seconds:>8.1f}")


@pytest.fixture(scope="session")
def cpu_env(tmp_path_factory: pytest.TempPathFactory) -> CpuEnv:
    """Wheelhouse and venv (scripts/cpu-env.sh; both reused when complete), then the wheel
    with docker/install-layer.sh from the wheelhouse alone, then the stand-in's two files."""
    if not enabled():
        pytest.skip(f"{ENABLE_ENV}=0")
    with Timer("env: wheelhouse (scripts/cpu-env.sh)"):
        run(["sh", "scripts/cpu-env.sh", "wheelhouse", WHEELHOUSE], what="the wheelhouse")
    with Timer("env: venv from the wheelhouse"):
        run(["sh", "scripts/cpu-env.sh", "venv", VENV, WHEELHOUSE], what="the CPU venv")
    python = VENV / "bin" / "python"
    work = tmp_path_factory.mktemp("cpu-env")
    with Timer("env: wheel + docker/install-layer.sh"):
        wheel = build_wheel(work / "wheel")
        env = {
            **os.environ,
            "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": str(WHEELHOUSE),
            "VLLM_TARGET_DEVICE": "cpu",
        }
        env.pop("PYTHONPATH", None)
        installed = run(
            ["sh", "docker/install-layer.sh", python, wheel, "pins.txt"],
            env=env,
            what="docker/install-layer.sh into the CPU venv",
        )
    site = Path(
        run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            what="locating site-packages",
        ).stdout.strip()
    )
    for f in STANDIN.iterdir():
        if f.suffix in (".py", ".pth"):
            shutil.copy2(f, site / f.name)
    cache = work / "vllm-cache"  # shared by every server: vLLM inspects each class once
    cache.mkdir()
    return CpuEnv(python, site, cache, installed.stdout)


@pytest.fixture(scope="session")
def checkpoints(cpu_env: CpuEnv, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    """The ``cpu`` presets, written by the CPU environment's own ``hybrid-draft``, and what
    ``plan`` says a same-checkpoint MTP draft of each reads."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    with Timer("checkpoints: make-checkpoint + plan"):
        for arch in synth.CPU_SERVABLE:
            path = root / arch
            cpu_env.cli("make-checkpoint", path, "--arch", arch, "--preset", "cpu", "--shards", "3")
            plan = json.loads(cpu_env.cli("plan", path, "--json").stdout)
            out[arch] = Checkpoint(path, plan)
    return out
