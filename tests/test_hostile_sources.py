"""The hook never turns off silently: whatever ``HYBRID_DRAFT_CONFIG``,
``HYBRID_DRAFT_EVENTS_FILE`` or the config text hold (a FIFO, ``/dev/zero``, a directory, deep
nesting, a huge file, a path under a regular file), a process importing vLLM's model loader
gets ``get_model`` wrapped, and a model load either runs with the layer active or stops with
``hybrid_draft.config_error`` and an exception naming the source. A process that loads no
model is untouched: no hang, no read at start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import Events, Recorder, engine_config, load_target_and_draft
from hostile import dev_zero, directory, fifo, huge, under_a_file

LIMIT = 300


def python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", **env},
        timeout=LIMIT,
    )


def events_in(stderr: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith('{"event"')]


def deep(p: Path) -> Path:
    p.write_text("a = " + "[" * 100_000 + "]" * 100_000)
    return p


BAD: dict[str, tuple[Callable[[Path], Path], str]] = {
    "fifo": (fifo, "a FIFO, not a regular file"),
    "dev_zero": (dev_zero, "a character device, not a regular file"),
    "directory": (directory, "a directory, not a regular file"),
    "deep": (deep, "invalid TOML: nested too deeply to parse"),
    "huge": (huge, "is 1,073,741,824 bytes, over the limit of 1,048,576 bytes"),
    "under_a_file": (under_a_file, "Not a directory"),
}


def test_a_process_that_loads_no_model_is_untouched(tmp_path: Path) -> None:
    out = python(
        "print('started')",
        {
            "HYBRID_DRAFT_CONFIG": str(dev_zero(tmp_path / "c.toml")),
            "HYBRID_DRAFT_EVENTS_FILE": str(fifo(tmp_path / "e.jsonl")),
            "INSTANTTENSOR_DRAFT_LOADER": "bogus",
        },
    )
    assert (out.returncode, out.stdout, out.stderr) == (0, "started\n", "")


@pytest.mark.parametrize(
    ("config", "events_file"), [("fifo", "fifo"), ("dev_zero", "directory"), ("deep", "dev_zero")]
)
def test_the_model_loader_import_wraps_get_model_whatever_the_sources_hold(
    config: str, events_file: str, tmp_path: Path
) -> None:
    out = python(
        """
        import vllm.model_executor.model_loader as loader
        print(getattr(loader.get_model, "__hybrid_draft_wrapped__", False))
        """,
        {
            "HYBRID_DRAFT_CONFIG": str(BAD[config][0](tmp_path / "c.toml")),
            "HYBRID_DRAFT_EVENTS_FILE": str(BAD[events_file][0](tmp_path / "e.jsonl")),
        },
    )
    assert out.returncode == 0 and out.stdout.split() == ["True"], out.stderr[-3000:]
    kinds = [e["event"] for e in events_in(out.stderr)]
    assert kinds == [
        "hybrid_draft.activated",
        "hybrid_draft.events_file_error",  # said once, then events go to stderr only
        "hybrid_draft.patched",
    ]
    (problem,) = [e for e in events_in(out.stderr) if e["event"].endswith("events_file_error")]
    assert problem["events_file"] == str(tmp_path / "e.jsonl")
    assert BAD[events_file][1].split(",")[0] in problem["detail"]


@pytest.fixture(scope="module")
def qwen35_config(qwen35: Path, vllm_runtime: Any) -> Any:
    return engine_config(qwen35)


@pytest.mark.vllm
@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_config_source_stops_the_load_naming_it(
    kind: str,
    qwen35_config: Any,
    events: Events,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybrid_draft.settings import ConfigError

    make, detail = BAD[kind]
    path = make(tmp_path / "hybrid-draft.toml")
    monkeypatch.setenv("HYBRID_DRAFT_CONFIG", str(path))
    with pytest.raises(ConfigError) as info:
        load_target_and_draft(qwen35_config)
    assert info.value.source == str(path) and detail in info.value.detail
    (error,) = events.named("hybrid_draft.config_error")
    assert (error["source"], error["detail"]) == (info.value.source, info.value.detail)
    (failed,) = events.named("hybrid_draft.load_failed")
    assert failed["role"] == "target" and failed["error_type"] == "ConfigError"


@pytest.mark.vllm
def test_an_events_file_that_is_a_fifo_leaves_the_layer_active(
    qwen35_config: Any,
    instanttensor_standin: Recorder,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    from hybrid_draft import events

    events.logger.cache_clear()  # a fresh sink: its one-time report is seen here
    path = fifo(tmp_path / "events.jsonl")
    monkeypatch.setenv("HYBRID_DRAFT_EVENTS_FILE", str(path))
    monkeypatch.setenv("HYBRID_DRAFT_CONFIG", str(tmp_path / "absent.toml"))
    loaded = load_target_and_draft(qwen35_config)
    assert loaded.draft is not None
    lines = events_in(capfd.readouterr().err)
    decisions = [e for e in lines if e["event"] == "hybrid_draft.decision"]
    assert [(d["role"], d["reason"]) for d in decisions] == [
        ("target", "target_model"),
        ("draft", "same_checkpoint"),
    ]
    assert [e["event"] for e in lines].count("hybrid_draft.events_file_error") == 1
    assert [e["role"] for e in lines if e["event"] == "hybrid_draft.loaded"] == ["target", "draft"]
