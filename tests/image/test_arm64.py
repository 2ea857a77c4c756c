"""The official target's linux/arm64 half, built on an amd64 machine under QEMU as a user
builds it: ``PLATFORMS=linux/arm64 docker buildx bake official`` on an arm64 stand-in for
vllm/vllm-openai (localbase.arm64: arm64 Debian, vLLM's own aarch64 wheels, CUDA build),
in the test's own Docker Engine with its default builder. Every RUN step of the build runs
arm64 code under QEMU user emulation (binfmt_misc), the build's ``hybrid-draft doctor``
included, which imports that vLLM without a GPU; then the image's own doctor runs in a
container of it.

Opt-in (HYBRID_DRAFT_IMAGE_TEST_ARM64=1; scripts/system-setup then unpacks QEMU 10 from
Debian trixie into build/system-tools, never installing it, and scripts/image-test registers
it: bookworm's 7.2 shows the host's x86 /proc/cpuinfo, and torch's aarch64 build dies
importing there): importing vLLM and torch under emulation takes minutes on each run
(docs/testing.md has the figures).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from buildfiles import pins
from conftest import Baked, baked
from engine import Engine

pytestmark = [
    pytest.mark.image,
    pytest.mark.skipif(
        os.environ.get("HYBRID_DRAFT_IMAGE_TEST_ARM64") != "1",
        reason="the arm64 build under QEMU is opt-in: HYBRID_DRAFT_IMAGE_TEST_ARM64=1",
    ),
]

BINFMT = Path("/proc/sys/fs/binfmt_misc")
#: BuildKit's plain progress prefixes each line of a step's output with "#STEP SECONDS ".
STEP_PREFIX = re.compile(r"^#\d+ \d+\.\d+ ")
WRAPPED = f"vllm: {pins()['vllm']}, vllm.model_executor.model_loader.get_model is wrapped"


def doctor_lines(output: str) -> list[str]:
    lines = (STEP_PREFIX.sub("", ln) for ln in output.splitlines())
    return [ln for ln in lines if re.match(r"^(ok  |FAIL) \w+:", ln)]


@pytest.fixture(scope="module")
def arm64(engine: Engine) -> Baked:
    """The image, baked once for the module; fails, saying what to install, where this
    machine cannot run arm64 programs."""
    registered = [p for p in BINFMT.glob("*aarch64*") if "enabled" in p.read_text()]
    if not registered:
        pytest.fail(
            f"no binfmt_misc handler for arm64 in {BINFMT}: run scripts/system-setup and "
            "scripts/image-test with HYBRID_DRAFT_IMAGE_TEST_ARM64=1 (they unpack QEMU 10 "
            "and register it)"
        )
    return baked("arm64")


def test_bake_official_for_arm64_runs_the_doctor_under_emulation(
    arm64: Baked, engine: Engine
) -> None:
    """The build passed, its doctor step found the layer active in the base's system
    Python and vLLM's get_model wrapped, and the image is an arm64 one."""
    doctor = doctor_lines(arm64.log)
    assert doctor and all(ln.startswith("ok ") for ln in doctor), "\n".join(doctor)
    assert {ln.split()[1].rstrip(":") for ln in doctor} >= {"layer", "vllm", "instanttensor"}
    assert f"ok   {WRAPPED}" in doctor, doctor
    assert any("layer: hybrid-draft" in ln and " /usr/bin/python3 " in ln for ln in doctor)
    assert "nothing the base had changed" in arm64.log
    out = engine.docker("image", "inspect", "--format", "{{.Os}}/{{.Architecture}}", arm64.tag)
    assert out.stdout.strip() == "linux/arm64"


def test_the_arm64_image_activates_the_layer(arm64: Baked, engine: Engine) -> None:
    """`docker run --platform linux/arm64`: the machine is aarch64 (QEMU), and the layer's
    .pth has wrapped vLLM's get_model in the image's Python."""
    out = engine.docker(
        "run",
        "--rm",
        "--platform",
        "linux/arm64",
        "--network",
        "none",
        "--entrypoint",
        "sh",
        arm64.tag,
        "-c",
        "uname -m && hybrid-draft doctor",
        check=False,
        timeout=3600,
    )
    assert out.returncode == 0, out.stdout[-4000:]
    assert out.stdout.splitlines()[0] == "aarch64", out.stdout[:200]
    assert f"ok   {WRAPPED}" in doctor_lines(out.stdout), out.stdout[-4000:]
