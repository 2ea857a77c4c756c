"""``hybrid-draft make-checkpoint``'s presets, as a user meets them on the command line.

That the ``cpu`` presets really serve is proven by the end-to-end test (tests/e2e), which
serves them with vLLM's CPU build.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_draft.tools import cli, synth

pytestmark = pytest.mark.once  # the same on every vLLM release (docs/testing.md)


def test_an_unknown_preset_names_the_accepted_ones(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = cli.main(
        ["make-checkpoint", str(tmp_path / "m"), "--arch", "glm4_moe", "--preset", "full"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "--preset 'full'" in err and ", ".join(synth.GLM4_MOE_PRESETS) in err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(("arch", "preset"), [("deepseek_v3", "tiny"), ("qwen3_5", "default")])
def test_the_default_preset_is_the_architectures_own(
    arch: str, preset: str, tmp_path: Path
) -> None:
    out = tmp_path / arch
    assert cli.main(["make-checkpoint", str(out), "--arch", arch, "--no-tokenizer"]) == 0
    written = json.loads((out / "config.json").read_text())
    expected = synth.ARCHITECTURES[arch](preset).config
    assert written == expected


@pytest.mark.parametrize("arch", synth.CPU_SERVABLE)
def test_cpu_presets_write_a_complete_checkpoint_with_a_tokenizer(
    arch: str, tmp_path: Path
) -> None:
    out = tmp_path / arch
    assert cli.main(["make-checkpoint", str(out), "--arch", arch, "--preset", "cpu"]) == 0
    assert synth.is_complete(out) and (out / "tokenizer.json").is_file()
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


# --- killed at every file operation ------------------------------------------------------

#: The system calls by which make-checkpoint changes a directory. An ``openat`` is left out
#: (the interpreter's imports make hundreds): the state just after one is the state a kill
#: at the next operation on that file finds.
FILE_OPS = (
    "mkdir",
    "mkdirat",
    "rename",
    "renameat",
    "renameat2",
    "unlink",
    "unlinkat",
    "write",
    "pwrite64",
    "writev",
    "ftruncate",
    "fsync",
    "fdatasync",
)
KILL_ARGS = ["--arch", "qwen3_5", "--preset", "tiny", "--shards", "2", "--seed", "7"]


def _strace() -> str:
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip(
            "strace is not installed: apt-get install strace (scripts/test installs it "
            "when run as root)"
        )
    probe = subprocess.run([strace, "-o", os.devnull, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"strace cannot trace here: {probe.stderr.strip()}")
    return strace


def _files(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden ones included) and its bytes."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() or p.is_symlink()
    }


def test_a_make_checkpoint_killed_at_any_file_operation_is_completed_by_if_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    strace = _strace()
    command = [sys.executable, "-m", "hybrid_draft", "make-checkpoint", *KILL_ARGS]
    tracing = [strace, "-f", "-qq"]  # every thread, no notes of strace's own on stderr
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # no writes of the interpreter's own
    reference = tmp_path / "reference"
    log = tmp_path / "ops.log"
    subprocess.run(
        [*tracing, "-o", str(log), "-e", "trace=" + ",".join(FILE_OPS), *command, str(reference)],
        env=env,
        check=True,
        capture_output=True,
    )
    counts: dict[tuple[str, str], int] = {}  # (thread, call): invocations
    for line in log.read_text().splitlines():
        match = re.match(r"(\d+) +(\w+)\(", line)
        if match:
            counts[match.groups()] = counts.get(match.groups(), 0) + 1
    per_call: dict[str, int] = {}
    for (_, call), n in counts.items():  # strace counts per call and per thread
        per_call[call] = max(per_call.get(call, 0), n)
    assert {"mkdir", "write", "rename", "unlink"} <= per_call.keys()
    expected = _files(reference)
    assert synth.MARKER not in expected and synth.is_complete(reference)
    kills = 0
    for call, n in sorted(per_call.items()):
        for when in range(1, n + 1):
            out = tmp_path / f"{call}-{when}"
            inject = ["-e", f"trace={call}", "-e", f"inject={call}:signal=SIGKILL:when={when}"]
            killed = subprocess.run(
                [*tracing, "-o", os.devnull, *inject, *command, str(out)],
                env=env,
                capture_output=True,
            )
            assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), (call, when)
            kills += 1
            assert cli.main(["make-checkpoint", "--if-missing", *KILL_ARGS, str(out)]) == 0, (
                call,
                when,
                capsys.readouterr().err,
            )
            assert _files(out) == expected, (call, when)
            shutil.rmtree(out)
    assert kills == sum(per_call.values())


@pytest.mark.parametrize(
    ("names", "state"),
    [
        (["..hybrid-draft-make-checkpoint.partial"], "partial"),  # killed writing the marker
        (["..hybrid-draft-make-checkpoint.partial", "notes.txt"], "partial"),  # with --force
        ([".config.json.partial", ".model-00002-of-00002.safetensors.partial"], "partial"),
        ([".config.json.partial", "config.json"], "occupied"),  # not all unfinished
        ([".notes.txt.partial"], "occupied"),  # not a name make-checkpoint writes
        (["notes.txt"], "occupied"),
        ([".partial"], "occupied"),
    ],
)
def test_what_an_interrupted_run_leaves_is_written_again_without_force(
    names: list[str], state: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m"
    out.mkdir()
    for name in names:
        (out / name).write_text("x")
    assert synth.target_state(out) == state
    code = cli.main(["make-checkpoint", str(out), "--if-missing", "--no-tokenizer"])
    assert code == (0 if state == "partial" else 2)
    assert synth.is_complete(out) == (state == "partial")
    if state == "partial":
        assert not [n for n in os.listdir(out) if n.endswith(".partial")]
