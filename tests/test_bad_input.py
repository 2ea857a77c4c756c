"""Every command, driven with malformed input of every kind, as a user runs it: each run ends
within a time limit (a hang fails the test), exits 2, says what is wrong on one line of
stderr naming the input, and never prints a traceback."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hostile import dev_zero, directory, fifo, huge, under_a_file

#: Seconds any one command may take here (a blocking read or an unbounded one would not end).
LIMIT = 180


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hybrid_draft", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", **(env or {})},
        timeout=LIMIT,
    )


def one_line_error(out: subprocess.CompletedProcess[str], prefix: str, *fragments: str) -> str:
    """The command's one error line (other stderr lines may come from torch's import)."""
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    ours = [line for line in out.stderr.splitlines() if line.startswith("hybrid-draft")]
    assert len(ours) == 1 and out.stderr.splitlines()[-1] == ours[0], out.stderr
    assert ours[0].startswith(prefix), ours[0]
    for fragment in fragments:
        assert fragment in ours[0], ours[0]
    return ours[0]


# --- hostile files, made fresh for each test ----------------------------------------------------


def deep(text: str) -> Callable[[Path], Path]:
    def make(p: Path) -> Path:
        p.write_text(text)
        return p

    return make


SOURCES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "fifo": (fifo, "a FIFO, not a regular file"),
    "dev_zero": (dev_zero, "a character device, not a regular file"),
    "directory": (directory, "a directory, not a regular file"),
    "huge": (huge, "over the limit of"),
    "under_a_file": (under_a_file, "Not a directory"),
}


# --- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind",
    [*SOURCES, "deep_array", "deep_table", "long_line", "not_utf8", "unknown_key", "bad_mode"],
)
def test_config(kind: str, tmp_path: Path) -> None:
    env = {}
    if kind in SOURCES:
        make, fragment = SOURCES[kind]
        path = make(tmp_path / "c.toml")
    elif kind == "deep_array":
        path, fragment = deep("a = " + "[" * 50_000 + "]" * 50_000)(tmp_path / "c.toml"), "deep"
    elif kind == "deep_table":
        path = deep("a = " + "{b = " * 5000 + "1" + "}" * 5000)(tmp_path / "c.toml")
        fragment = "nested too deeply"
    elif kind == "long_line":  # every line is scanned to place the error: linear time
        text = 'x = """\n[a' + " " * 1_000_000 + 'b\n"""\n'
        path, fragment = deep(text)(tmp_path / "c.toml"), "unknown key 'x'"
    elif kind == "not_utf8":
        path = tmp_path / "c.toml"
        path.write_bytes(b'[draft]\nmode = "\xff"\n')
        fragment = "not UTF-8"
    elif kind == "unknown_key":
        path = deep("[draft]\nmoed = 'auto'\n")(tmp_path / "c.toml")
        fragment = "unknown key 'draft.moed'"
    else:
        path, fragment = tmp_path / "absent.toml", "INSTANTTENSOR_DRAFT_LOADER"
        env["INSTANTTENSOR_DRAFT_LOADER"] = "fastest"
    out = cli("config", env={"HYBRID_DRAFT_CONFIG": str(path), **env})
    one_line_error(out, "hybrid-draft: invalid configuration: ", fragment)
    if kind != "bad_mode":
        assert str(path) in out.stderr


# --- report --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [*SOURCES, "missing"])
def test_report_of_a_file_it_cannot_read(kind: str, tmp_path: Path) -> None:
    if kind == "missing":
        path, fragment = tmp_path / "absent.jsonl", "No such file or directory"
    else:
        make, fragment = SOURCES[kind]
        path = make(tmp_path / "events.jsonl")
    one_line_error(cli("report", str(path)), f"hybrid-draft report: cannot read {path}", fragment)


def test_report_tolerates_any_content(tmp_path: Path) -> None:
    """Fields of the wrong type, deep nesting, NaN, binary noise: a report, exit 0."""
    lines = [
        {"event": "hybrid_draft.decision", "pid": [1, 2], "role": "target", "reason": 5},
        {
            "event": "hybrid_draft.loaded",
            "pid": [1, 2],
            "role": "target",
            "seconds": "12.5",
            "bytes_read": "1 GB",
            "tensors": None,
            "shards": {"n": 1},
            "load_format": 7,
        },
        {
            "event": "hybrid_draft.loaded",
            "pid": {"a": 1},
            "role": "draft",
            "seconds": float("nan"),
            "bytes_read": True,
            "checkpoint_bytes": "x",
            "model": ["m"],
        },
        {"event": "hybrid_draft.load_failed", "pid": 3.5, "role": None, "error": {"x": 1}},
    ]
    path = tmp_path / "events.jsonl"
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
        f.write('{"a": ' + "[" * 100_000 + "\n")
        f.write('{"event": "hybrid_draft.loaded", "pid": 9, "x": "' + "y" * (2 << 20) + '"}\n')
    with open(path, "ab") as f:
        f.write(bytes(range(256)) + b"\n")
    for args in (("report", str(path)), ("report", str(path), "--json")):
        out = cli(*args)
        assert out.returncode == 0 and out.stderr == "", out.stderr
    summary = json.loads(out.stdout)
    assert summary["loads"] == 2 and summary["failures"] == 1
    target, draft = (p["loads"][0] for p in summary["processes"][:2])
    assert target["seconds"] is None and target["bytes_read"] is None
    assert draft["seconds"] is None and draft["vs_full_pass"]["bytes_saved"] is None
    text = cli("report", str(path)).stdout
    assert "process [1, 2]" in text and "2 load(s), 1 failed, in 3 process(es)" in text


def test_report_of_thousands_of_loads_prints_the_first_and_counts_all(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    loaded = {"event": "hybrid_draft.loaded", "role": "target", "seconds": 1.0}
    path.write_text(
        "".join(json.dumps({**loaded, "pid": i % 250}) + "\n" for i in range(500))
        + "".join(json.dumps({**loaded, "pid": 0}) + "\n" for _ in range(300))
    )
    out = cli("report", str(path))
    assert out.returncode == 0 and out.stderr == ""
    lines = out.stdout.splitlines()
    assert lines[-2:] == [
        "... 50 more process(es) (--json has them all)",
        "800 load(s), 0 failed, in 250 process(es)",
    ]
    assert "  ... 102 more load(s) (--json has them all)" in lines
    assert len(json.loads(cli("report", str(path), "--json").stdout)["processes"]) == 250


# --- plan ----------------------------------------------------------------------------------------


def shard(header: str, data: int) -> bytes:
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(data)


GOOD = '{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
SHARD = "model-00001-of-00001.safetensors"


def index(root: Path, name: str) -> None:
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))


PLAN_CASES: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "config_fifo": (lambda m, t: (m / "config.json").unlink() or fifo(m / "config.json"), "FIFO"),
    "config_dev_zero": (
        lambda m, t: (m / "config.json").unlink() or dev_zero(m / "config.json"),
        "config.json: a symbolic link to /dev/zero, outside the checkpoint",
    ),
    "config_deeply_nested": (
        lambda m, t: (m / "config.json").write_text("[" * 100_000 + "]" * 100_000),
        "config.json: not valid JSON: nested too deeply",
    ),
    "config_outside": (
        lambda m, t: (m / "config.json").unlink() or (m / "config.json").symlink_to(t / "c.json"),
        "outside the checkpoint",
    ),
    "index_deeply_nested": (
        lambda m, t: (m / "model.safetensors.index.json").write_text("[" * 100_000),
        "not a safetensors index",
    ),
    "index_names_a_parent": (lambda m, t: index(m, "../other/x.safetensors"), "'../other/x"),
    "index_names_an_absolute_path": (lambda m, t: index(m, str(t / "c.json")), "c.json'"),
    "index_names_dev_zero": (lambda m, t: index(m, "/dev/zero"), "'/dev/zero'"),
    "shard_fifo": (lambda m, t: (m / SHARD).unlink() or fifo(m / SHARD), "FIFO"),
    "shard_not_safetensors": (lambda m, t: (m / SHARD).write_bytes(b"PK\x03\x04" * 8), SHARD),
    "shard_offsets_reversed": (
        lambda m, t: (m / SHARD).write_bytes(
            shard('{"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}', 8)
        ),
        "tensor 'w': data_offsets [8, 0] end before they begin",
    ),
    "shard_unknown_dtype": (
        lambda m, t: (m / SHARD).write_bytes(
            shard('{"w":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}}', 8)
        ),
        "tensor 'w': dtype 'Q7'",
    ),
    "shard_shape_vs_bytes": (
        lambda m, t: (m / SHARD).write_bytes(
            shard('{"w":{"dtype":"F32","shape":[9],"data_offsets":[0,8]}}', 8)
        ),
        "tensor 'w': shape [9] of F32 is 36 bytes",
    ),
    "shard_header_deeply_nested": (
        lambda m, t: (m / SHARD).write_bytes(shard('{"w":' + "[" * 100_000, 0)),
        "header is not JSON",
    ),
}


@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_plan(case: str, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / SHARD).write_bytes(shard(GOOD, 8))
    index(model, SHARD)
    (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    (tmp_path / "c.json").write_text("{}")
    breaks, fragment = PLAN_CASES[case]
    breaks(model, tmp_path)
    one_line_error(cli("plan", str(model)), f"hybrid-draft plan: {model}", fragment)


def test_plan_of_what_is_not_a_checkpoint_directory(tmp_path: Path) -> None:
    for path in (tmp_path / "absent", fifo(tmp_path / "f"), Path("/dev/zero")):
        one_line_error(cli("plan", str(path)), f"hybrid-draft plan: {path}: not a directory")


# --- make-checkpoint -----------------------------------------------------------------------------


def make(*args: str) -> subprocess.CompletedProcess[str]:
    return cli("make-checkpoint", *args, "--preset", "tiny", "--no-tokenizer", "--fill", "sparse")


def test_make_checkpoint_bad_targets_and_arguments(tmp_path: Path) -> None:
    regular = tmp_path / "file"
    regular.write_text("x")
    prefix = "hybrid-draft make-checkpoint: "
    one_line_error(make(str(regular / "sub")), prefix, str(regular / "sub"))
    one_line_error(make(str(regular)), prefix, "exists and is not a directory")
    for bad in (["--seed", "-1"], ["--seed", "x"], ["--shards", "0"], ["--arch", "nope"]):
        out = make(str(tmp_path / "new"), *bad)
        one_line_error(out, "hybrid-draft make-checkpoint: argument", bad[0])
    assert not (tmp_path / "new").exists()


def test_make_checkpoint_refuses_a_non_empty_target_and_never_writes_through_a_link(
    tmp_path: Path,
) -> None:
    target = tmp_path / "out"
    target.mkdir()
    precious = tmp_path / "precious.json"
    precious.write_text("keep me")
    (target / "config.json").symlink_to(precious)
    one_line_error(make(str(target)), "hybrid-draft make-checkpoint: ", "is not empty", "--force")
    assert precious.read_text() == "keep me"
    forced = make(str(target), "--force")
    assert forced.returncode == 0, forced.stderr
    assert precious.read_text() == "keep me"  # the link was replaced, not written through
    assert not (target / "config.json").is_symlink()
    assert json.loads((target / "config.json").read_text())["model_type"] == "qwen3_5_text"
    # A complete checkpoint: --if-missing leaves it, a plain run refuses it.
    again = make(str(target), "--if-missing")
    assert again.returncode == 0 and "already there" in again.stdout
    one_line_error(make(str(target)), "hybrid-draft make-checkpoint: ", "is not empty")


def test_make_checkpoint_finishes_its_own_interrupted_output(tmp_path: Path) -> None:
    """What compose's model service relies on: ``--if-missing`` on a volume a killed run
    left half-written carries on without --force."""
    from hybrid_draft.tools import synth

    target = tmp_path / "model"
    target.mkdir()
    (target / synth.MARKER).write_text("")
    (target / "config.json").write_text("{")
    out = make(str(target), "--if-missing")
    assert out.returncode == 0, out.stderr
    assert synth.is_complete(target) and not (target / synth.MARKER).exists()


# --- bench ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--size", "nan"], "argument --size: 'nan' is not a finite number"),
        (["--size", "inf"], "argument --size: 'inf' is not a finite number"),
        (["--size", "-1"], "argument --size: '-1' is not a number above 0"),
        (["--size", "1e9"], "argument --size: '1e9' is over the limit"),
        (["--runs", "0"], "argument --runs: 0 is out of range"),
        (["--strategies", "fastest"], "--strategies 'fastest': unknown 'fastest'"),
    ],
)
def test_bench_arguments(args: list[str], fragment: str, tmp_path: Path) -> None:
    out = cli("bench", "--out", str(tmp_path / "out"), *args)
    one_line_error(out, "hybrid-draft bench: ", fragment)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_bench_never_overwrites_a_directory_it_did_not_write(tmp_path: Path) -> None:
    other = tmp_path / "model"
    other.mkdir()
    (other / "config.json").write_text('{"mine": true}')
    regular = tmp_path / "file"
    regular.write_text("x")
    out = cli("bench", "--out", str(tmp_path / "o"), "--checkpoint", str(other), "--size", "0.01")
    one_line_error(out, "hybrid-draft bench: ", f"{other} holds files that are not a bench")
    assert json.loads((other / "config.json").read_text()) == {"mine": True}
    one_line_error(cli("bench", "--out", str(regular / "o")), "hybrid-draft bench: ", str(regular))
    out = cli("bench", "--out", str(tmp_path / "o"), "--checkpoint", str(regular))
    one_line_error(out, "hybrid-draft bench: ", f"{regular}: exists and is not a directory")


# --- smoke (answers a server gives are in test_smoke_answers.py) -------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--deadline", "nan"], "argument --deadline: 'nan' is not a finite number"),
        (["--deadline", "0"], "argument --deadline: '0' is not a number above 0"),
        (["--wait", "-5"], "argument --wait: '-5' is not a number of at least 0"),
        (["--completions", "0"], "argument --completions: 0 is out of range"),
        (["--url", "localhost:8000"], "argument --url: 'localhost:8000' is not an http://"),
        (["--mode", "fastest"], "argument --mode: 'fastest' is not a mode"),
        (["--min-acceptance", "2"], "argument --min-acceptance: '2' is not a number from 0 to 1"),
        (["--min-acceptance", "abc"], "argument --min-acceptance: 'abc' is not a number"),
        (["--min-acceptance", "nan"], "argument --min-acceptance: 'nan' is not a finite number"),
        ([], "no events file"),
    ],
)
def test_smoke_arguments(args: list[str], fragment: str) -> None:
    out = cli("smoke", *args, env={"HYBRID_DRAFT_EVENTS_FILE": ""})
    one_line_error(out, "hybrid-draft smoke", fragment)


def test_smoke_floor_and_model_dir_it_cannot_use(tmp_path: Path) -> None:
    """Refused before any request: compose's SMOKE_MIN_ACCEPTANCE, a --model-dir that is not
    a directory, or one whose index is not JSON."""
    events = ["--events-file", str(tmp_path / "events.jsonl"), "--url", "http://127.0.0.1:9"]
    out = cli("smoke", *events, env={"SMOKE_MIN_ACCEPTANCE": "-1"})
    one_line_error(
        out, "hybrid-draft smoke: SMOKE_MIN_ACCEPTANCE: '-1' is not a number from 0 to 1"
    )
    out = cli("smoke", *events, "--model-dir", str(tmp_path / "none"))
    one_line_error(out, f"hybrid-draft smoke: --model-dir {tmp_path / 'none'}: not a directory")
    (tmp_path / "model.safetensors.index.json").write_text("{")
    out = cli("smoke", *events, "--model-dir", str(tmp_path))
    one_line_error(out, "hybrid-draft smoke: --model-dir: ", "not valid JSON")


# --- any command -------------------------------------------------------------------------------


def test_unknown_commands_and_options() -> None:
    one_line_error(cli("frobnicate"), "hybrid-draft: argument command: invalid choice")
    one_line_error(cli("report"), "hybrid-draft report: the following arguments are required")
    one_line_error(cli("config", "--yaml"), "hybrid-draft: unrecognized arguments: --yaml")


def test_an_unforeseen_error_is_one_line_unless_asked_for_the_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybrid_draft.tools import cli as command
    from hybrid_draft.tools import report

    def broken(_: object) -> object:
        raise RecursionError("maximum recursion depth exceeded\nwhile reading")

    monkeypatch.setattr(report, "summarize", broken)
    monkeypatch.delenv("HYBRID_DRAFT_TRACEBACK", raising=False)
    empty = tmp_path / "events.jsonl"
    empty.write_text("")
    assert command.main(["report", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "hybrid-draft report: unexpected error: RecursionError: maximum recursion depth "
        "exceeded while reading (HYBRID_DRAFT_TRACEBACK=1 shows where)\n"
    )
    monkeypatch.setenv("HYBRID_DRAFT_TRACEBACK", "1")
    with pytest.raises(RecursionError):
        command.main(["report", str(empty)])


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(
        "".join(
            json.dumps({"event": "hybrid_draft.loaded", "pid": i, "role": "target"}) + "\n"
            for i in range(20000)
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybrid_draft", "report", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=LIMIT) in (0, 1) and "Traceback" not in err, err


def test_doctor_with_every_source_hostile(tmp_path: Path) -> None:
    """The config a FIFO, the events file a FIFO: doctor ends, says which check failed."""
    out = cli(
        "doctor",
        env={
            "HYBRID_DRAFT_CONFIG": str(fifo(tmp_path / "c.toml")),
            "HYBRID_DRAFT_EVENTS_FILE": str(fifo(tmp_path / "e.jsonl")),
        },
    )
    assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr
    (config_line,) = [ln for ln in out.stdout.splitlines() if " config:" in ln]
    assert config_line.startswith("FAIL") and "a FIFO, not a regular file" in config_line
    shutil.rmtree(tmp_path)
