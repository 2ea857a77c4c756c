"""A stuck or slow target read from object storage says where it is: a Run:ai Model Streamer
target in real vLLM on the CPU, against the suite's fault servers on loopback (moto's S3,
``tests/s3server.py``; fake-gcs-server, ``tests/objectservers.py``) injecting one fault into
the requests for the shard holding the MTP layer. Nothing stands in for anything.

The Run:ai Model Streamer serves one object store per process (the first it reads): the S3
cases run here; the ``gs://`` case, whose load Run:ai's GCS client retries for up to 15
minutes, runs in a child process of its own, ended once the event it waits for has come."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, Events, engine_config
from hybrid_draft.core import checkpoint
from objectservers import GCSServer
from s3server import Fault, S3Server

pytestmark = pytest.mark.vllm

BUCKET = "models"
#: Set in the child process: the ``gs://`` target it loads, and where its config is.
CHILD_ENV = "HYBRID_DRAFT_TEST_WATCH_GS"
#: Where the child writes its events (the suite's conftest clears the layer's own variable).
CHILD_EVENTS_ENV = "HYBRID_DRAFT_TEST_WATCH_EVENTS"
#: Run:ai's two header reads of each shard come before its tensors' ranges.
RUNAI_HEADER_GETS = 2


def _mtp_shard(qwen35: Path) -> Path:
    (mtp,) = [
        s
        for s in checkpoint.read_checkpoint(qwen35)
        if any(t.name == "mtp.fc.weight" for t in s.tensors)
    ]
    return mtp.path


def _target(config: Any) -> Any:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.model_executor.model_loader import get_model

    with set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        return get_model(vllm_config=config)


@pytest.fixture(scope="module")
def s3(qwen35: Path, vllm_runtime: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``qwen35`` in a fresh S3 server; this process set to reach it."""
    root = tmp_path_factory.mktemp("watch")
    with S3Server() as server, pytest.MonkeyPatch.context() as mp:
        for key, value in server.env.items():
            mp.setenv(key, value)
        mp.setenv("VLLM_CACHE_ROOT", str(root / "vllm-cache"))
        mp.setenv("VLLM_ASSETS_CACHE", str(root / "vllm-assets"))
        prefix = f"watch-{uuid.uuid4().hex[:8]}"
        uri = server.upload_dir(qwen35, BUCKET, prefix)
        key = f"{prefix}/{_mtp_shard(qwen35).name}"
        yield server, uri, key


def test_an_s3_object_that_stops_answering_is_named_while_the_target_waits(
    s3: Any, qwen35: Path, events: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MTP shard's ranges get headers and no byte: within ``stall_seconds`` a warning
    names that object, what the store said when the layer asked (nothing in time) and what
    Run:ai's S3 client does about it; its client then gives up and the load fails."""
    server, uri, key = s3
    monkeypatch.setenv("HYBRID_DRAFT_STALL_SECONDS", "1")
    monkeypatch.setenv("HYBRID_DRAFT_OBJECT_TIMEOUT", "1")
    monkeypatch.setenv("RUNAI_STREAMER_S3_MAX_RETRIES", "1")
    server.arm(Fault.stall(key, 60, after=RUNAI_HEADER_GETS))
    try:
        with pytest.raises(ValueError, match="libstreamer"):
            _target(engine_config(uri, load_format="runai_streamer", config_dir=qwen35))
    finally:
        server.disarm()

    stalled = events.named("hybrid_draft.load_stalled")
    assert stalled, events.all()
    first = stalled[0]
    assert (first["role"], first["store"], first["waiting_on"]) == (
        "target",
        "s3",
        f"s3://{BUCKET}/{key}",
    )
    assert first["answer"].startswith("no answer from the object store within 1 s")
    assert "RUNAI_STREAMER_S3_MAX_RETRIES" in first["retries"]
    assert "1 times here" in first["retries"]
    assert first["stoppable"] is False  # Run:ai waits in its C++ library
    (failed,) = events.named("hybrid_draft.load_failed")
    assert failed["stalls"] >= 1


def test_an_s3_store_slow_but_moving_says_its_progress_and_no_stall(
    s3: Any, qwen35: Path, events: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every read of the MTP shard answered 0.5 s late: progress, never a stall."""
    server, uri, key = s3
    monkeypatch.setenv("HYBRID_DRAFT_PROGRESS_SECONDS", "0.2")
    monkeypatch.setenv("HYBRID_DRAFT_STALL_SECONDS", "3")
    server.arm(Fault.delay(key, 0.5))
    try:
        _target(engine_config(uri, load_format="runai_streamer", config_dir=qwen35))
    finally:
        server.disarm()

    said = [e for e in events.named("hybrid_draft.progress") if e["role"] == "target"]
    assert len(said) >= 2, events.all()
    assert all(e["load_format"] == "runai_streamer" for e in said)
    assert said[-1]["network_bytes"] > 0
    assert events.named("hybrid_draft.load_stalled") == []
    (loaded,) = events.named("hybrid_draft.loaded")
    assert loaded["network_bytes"] > 0 and "stalls" not in loaded


# --- gs://, 503 forever: in a child process ------------------------------------------------


def test_a_gs_object_answered_503_forever_is_named_within_90_s(
    qwen35: Path, tmp_path: Path
) -> None:
    """The issue's case: a Run:ai target on ``gs://`` whose MTP shard answers 503 to every
    read. Run:ai's GCS client retries for up to 15 minutes; within 90 s a warning names the
    object and the store's answer, and with ``load_timeout`` the load is said to be past
    its bound and beyond the layer's stop while Run:ai's client retries."""
    if os.environ.get(CHILD_ENV):
        pytest.skip("the child itself")
    events_file = tmp_path / "events.jsonl"
    with GCSServer() as gcs:
        prefix = f"watch-{uuid.uuid4().hex[:8]}"
        uri = gcs.upload_dir(qwen35, BUCKET, prefix)
        key = f"{prefix}/{_mtp_shard(qwen35).name}"
        gcs.arm(Fault.throttle(key, None))
        env = {
            **gcs.client_env(),
            CHILD_ENV: uri,
            CHILD_EVENTS_ENV: str(events_file),
            "HYBRID_DRAFT_STALL_SECONDS": "5",
            "HYBRID_DRAFT_LOAD_TIMEOUT": "15",
            "HYBRID_DRAFT_OBJECT_TIMEOUT": "2",
            "VLLM_ASSETS_CACHE": str(tmp_path / "vllm-assets"),
        }
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
        log = (tmp_path / "child.log").open("w")
        child = subprocess.Popen(
            [*argv, "-k", "child_loads_the_gs_target"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        started = time.monotonic()
        found: list[dict[str, Any]] = []
        try:
            while time.monotonic() - started < 240 and child.poll() is None:
                found = _stalled(events_file)
                if any(e.get("action") for e in found):
                    break
                time.sleep(1)
        finally:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            log.close()
    tail = (tmp_path / "child.log").read_text()[-3000:]
    assert found, f"no load_stalled in {time.monotonic() - started:.0f} s: {tail}"
    first = found[0]
    assert (first["role"], first["store"], first["waiting_on"]) == (
        "target",
        "gs",
        f"gs://{BUCKET}/{key}",
    )
    assert first["answer"].startswith("the object store answered 503")
    assert "GCS client" in first["retries"] and "15 minutes" in first["retries"]
    # The bound: named within 90 s of the load's start (its stall is 5 s here).
    assert first["at_seconds"] + first["stalled_seconds"] < 90
    (bound,) = [e for e in found if e.get("action")]
    assert (bound["action"], bound["stoppable"]) == ("stopping", False)
    assert "runai_response" in bound["detail"]


def _stalled(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line being written
        if event.get("event") == "hybrid_draft.load_stalled":
            out.append(event)
    return out


def test_child_loads_the_gs_target(
    qwen35: Path, vllm_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(The child process of the test above: loads the ``gs://`` target, and waits.)"""
    uri = os.environ.get(CHILD_ENV)
    if not uri:
        pytest.skip("run by test_a_gs_object_answered_503_forever_is_named_within_90_s")
    monkeypatch.setenv("HYBRID_DRAFT_EVENTS_FILE", os.environ[CHILD_EVENTS_ENV])
    _target(engine_config(uri, load_format="runai_streamer", config_dir=qwen35))
