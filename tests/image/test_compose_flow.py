"""compose.yaml's flow inside the built image: the model service's make-checkpoint, the
server, then the smoke service against it (tests/image/composeflow.py reads all of it from
compose.yaml; tests/image/cpu-run.yaml holds the CPU run's differences).

Two runs show the configuration's precedence in the server's own decision events: a TOML
file mounted over the baked one (compose's HYBRID_DRAFT_CONFIG_FILE) wins over it, and the
environment (INSTANTTENSOR_DRAFT_LOADER) wins over both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import buildah
import composeflow
from conftest import Built

pytestmark = pytest.mark.image

MOUNTED_MODE = "instanttensor"  # differs from the baked file's mode (auto)
ENV_MODE = "auto"


@pytest.fixture(scope="module")
def custom_toml(work: Path) -> Path:
    path = work / "my-hybrid-draft.toml"
    path.write_text(f'[draft]\nmode = "{MOUNTED_MODE}"\n')
    return path


@pytest.fixture(scope="module")
def model_volume(work: Path) -> Path:
    """compose's `default-model` volume, kept across the runs as Compose keeps it."""
    path = work / "volumes" / "default-model"
    path.mkdir(parents=True)
    return path


def run_flow(
    name: str,
    variables: dict[str, str],
    work: Path,
    model_volume: Path,
    standin: dict[str, str],
    image_cfg: dict,
    figures: dict,
) -> composeflow.FlowResult:
    named = {"default-model": model_volume, "events": work / name / "events"}
    named["events"].mkdir(parents=True)
    result = composeflow.up(
        variables, work=work / name, named=named, standin=standin, image_cfg=image_cfg
    )
    figures.update({f"{name}_{k}": v for k, v in result.seconds.items()})
    return result


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
    image: Built,
    custom_toml: Path,
    work: Path,
    model_volume: Path,
    standin: dict[str, str],
    image_cfg: dict,
    figures: dict,
) -> None:
    result = run_flow(
        "mounted-file",
        {"HYBRID_DRAFT_CONFIG_FILE": str(custom_toml)},
        work,
        model_volume,
        standin,
        image_cfg,
        figures,
    )
    assert result.returncode == 0, result.output(result.exit_service)[-6000:] + composeflow.tail(
        result.logs["server"], 80
    )
    smoke = result.output(result.exit_service)
    assert "FAIL" not in smoke, smoke
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
    reads = [
        json.loads(ln)
        for ln in (result.volumes["events"] / "standin.jsonl").read_text().splitlines()
        if '"call"' in ln
    ]
    assert len(reads) == 2, reads


def test_environment_wins_over_both(
    image: Built,
    custom_toml: Path,
    work: Path,
    model_volume: Path,
    standin: dict[str, str],
    image_cfg: dict,
    figures: dict,
) -> None:
    result = run_flow(
        "env",
        {"HYBRID_DRAFT_CONFIG_FILE": str(custom_toml), "INSTANTTENSOR_DRAFT_LOADER": ENV_MODE},
        work,
        model_volume,
        standin,
        image_cfg,
        figures,
    )
    assert result.returncode == 0, result.output(result.exit_service)[-6000:] + composeflow.tail(
        result.logs["server"], 80
    )
    # The checkpoint of the first run was reused (make-checkpoint --if-missing).
    assert "already there" in result.output("model")
    events = result.events()
    target, draft = decision(events, "target"), decision(events, "draft")
    assert (target["mode"], target["mode_source"]) == (ENV_MODE, "env")
    assert (target["chosen_format"], target["action"]) == ("instanttensor", "kept")
    assert (draft["mode"], draft["mode_source"]) == (ENV_MODE, "env")
    assert (draft["action"], draft["chosen_format"], draft["reason"]) == (
        "switched",
        "safetensors",
        "same_checkpoint",
    )
    # Only the target went through InstantTensor's (stood-in) read.
    reads = [
        json.loads(ln)
        for ln in (result.volumes["events"] / "standin.jsonl").read_text().splitlines()
        if '"call"' in ln
    ]
    assert len(reads) == 1, reads
    assert os.path.basename(draft["model"]) == os.path.basename(target["model"])
