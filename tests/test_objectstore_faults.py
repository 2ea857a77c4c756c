"""Object storage that misbehaves: the draft of an ``s3://`` or ``gs://`` Run:ai target in real
vLLM on the CPU, against a real server on loopback (moto's S3, ``tests/s3server.py``;
fake-gcs-server, ``tests/objectservers.py``) that injects one fault at a time into the
requests for the shard holding the MTP layer. The Run:ai Model Streamer serves one object
store per process (the first it reads), so the ``gs://`` set runs in a child pytest of its
own (``test_the_gs_fault_set_in_a_process_of_its_own``).

Each fault, in the draft's plan or in its tensor stream, with the draft streaming its own
tensors (``HYBRID_DRAFT_HOLD_BUDGET=0``) and taking them from the target's stream (one pass,
in a load scope): a transient fault is retried and the draft is the checkpoint's; a shard
replaced or truncated at any point of the load never yields a draft that is not one
consistent version of it; a permanent fault is one ``load_failed`` naming the object and the
store's answer. The settings keep each case short: a 1 s timeout, 2 retries (Run:ai's client
takes about 5 s to give up on a stalled request whatever its timeout).

Nothing stands in for anything: vLLM's loaders, Run:ai's S3 and GCS clients, boto3 and
google-cloud-storage run unchanged."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import Events, assert_qwen35_draft_is_the_checkpoints, child_pytest, engine_config
from hybrid_draft.core import checkpoint
from objectservers import (
    AzureServer,
    GCSServer,
    azure_namespace_unavailable,
    azure_tls,
    in_azure_namespace,
)
from s3server import Fault, S3Server

pytestmark = pytest.mark.vllm

#: The store this process's fault set runs against (``gs`` or ``az`` in a child process).
STORE_ENV = "HYBRID_DRAFT_TEST_FAULT_STORE"
STORE = os.environ.get(STORE_ENV, "s3")
#: The folder of :func:`objectservers.azure_tls`' files the ``az`` child's namespace mounts.
AZURE_TLS_ENV = "HYBRID_DRAFT_TEST_AZURE_TLS"
#: Set to 1 to run the ``az`` set (Run:ai's Azure client in namespaces of its own).
AZURE_STREAM_ENV = "HYBRID_DRAFT_TEST_AZURE_STREAM"

BUCKET = "models"
TIMEOUT_S = 1
RETRIES = 2
#: The GETs of the MTP shard a draft that streams its own tensors sends, in order: its
#: plan's two (length, header), then Run:ai's two (the same), then the tensors' ranges.
PLAN_GETS = 2
RUNAI_HEADER_GETS = 2
#: The metadata reads of the MTP shard its plan sends first (GCS: its generation and size).
PLAN_HEADS = 1 if STORE == "gs" else 0
#: Why a case does not run against ``gs://``: Run:ai's GCS client (google-cloud-cpp) retries
#: a 5xx and a stalled answer for up to 15 minutes, its default, which nothing of Run:ai's sets.
GCS_RETRIES_ITS_OWN = pytest.mark.skipif(
    STORE == "gs", reason="Run:ai's GCS client retries its own for up to 15 minutes"
)
#: Why a case does not run against ``az://``: Run:ai's Azure client keeps the Azure SDK's
#: own bounds, which cut no answer that comes late or stalls.
AZURE_WAITS_ITS_OWN = pytest.mark.skipif(
    STORE == "az", reason="Run:ai's Azure client waits for a late or stalled answer"
)
#: The plan's retries of an answer cut mid-body: Azure's client reads it again itself, uncounted.
CUT_RETRIED = 0 if STORE == "az" else 1


# --- versions of the MTP shard --------------------------------------------------------------


def revalued(src: Path, dst: Path) -> Path:
    """``src`` with every tensor's values changed and nothing else: the same header, so the
    same offsets; only the object's ETag tells the two apart."""
    import torch
    from safetensors import safe_open

    data = bytearray(src.read_bytes())
    with safe_open(str(src), framework="pt") as f:
        for info in checkpoint.read_shard(src).tensors:
            tensor = f.get_tensor(info.name)
            if tensor.is_floating_point():
                new = (tensor.float() * 2 + 1).to(tensor.dtype).contiguous()
                data[info.start : info.end] = new.view(torch.uint8).numpy().tobytes()
    dst.write_bytes(bytes(data))
    return dst


def reshaped(src: Path, dst: Path) -> Path:
    """``src``'s tensors, values changed, behind one more tensor: the same names at other
    offsets (another header)."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = {k: (v.float() * 2 + 1).to(v.dtype) for k, v in load_file(str(src)).items()}
    save_file({"aaa.extra": torch.zeros(64), **tensors}, str(dst))
    return dst


def truncated(src: Path, dst: Path) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) // 2])
    return dst


# --- the store and the loads ----------------------------------------------------------------


@dataclass
class Store:
    s3: S3Server | GCSServer | AzureServer
    uri: str
    #: The MTP shard: its object key, address, and local original.
    key: str
    address: str
    shard: Path
    #: Local checkpoints whose MTP shard is a replacement (for the expected tensors).
    revalued_dir: Path
    reshaped_dir: Path
    truncated_file: Path

    def put(self, body: Path | bytes) -> None:
        data = body.read_bytes() if isinstance(body, Path) else body
        if isinstance(self.s3, S3Server):
            self.s3.client().put_object(Bucket=BUCKET, Key=self.key, Body=data)
        else:
            self.s3.put(BUCKET, self.key, data)

    def version(self, data: bytes) -> str:
        """The version the object holding ``data`` has now, as an error names it: S3's
        ETag of an object put whole (its MD5), GCS's generation."""
        if isinstance(self.s3, GCSServer):
            return f"generation {self.s3.generation(BUCKET, self.key)}, {len(data):,} bytes"
        if isinstance(self.s3, AzureServer):
            return f"ETag {self.s3.etag(BUCKET, self.key)}, {len(data):,} bytes"
        return f'ETag "{hashlib.md5(data).hexdigest()}", {len(data):,} bytes'

    def restore(self) -> None:
        self.s3.disarm()
        self.put(self.shard)

    @property
    def replacement(self) -> Path:
        return self.revalued_dir / self.shard.name

    @property
    def other_offsets(self) -> Path:
        return self.reshaped_dir / self.shard.name


@pytest.fixture(scope="module")
def store(
    qwen35: Path, vllm_runtime: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Store]:
    """``qwen35`` in a fresh server under a prefix of its own; this module's process set to
    reach it (``AWS_ENDPOINT_URL``, credentials), vLLM's copies of the config files kept in
    a folder of its own."""
    root = tmp_path_factory.mktemp("faults")
    (mtp,) = [
        s
        for s in checkpoint.read_checkpoint(qwen35)
        if any(t.name == "mtp.fc.weight" for t in s.tensors)
    ]
    local: dict[str, Path] = {}
    for kind, make in (("revalued", revalued), ("reshaped", reshaped)):
        copy = root / kind
        shutil.copytree(qwen35, copy)
        make(mtp.path, copy / mtp.path.name)
        local[kind] = copy
    server: S3Server | GCSServer | AzureServer = S3Server()
    if STORE == "gs":
        server = GCSServer()
    elif STORE == "az":
        server = AzureServer(tls=Path(os.environ[AZURE_TLS_ENV]))
    with server as s3, pytest.MonkeyPatch.context() as mp:
        for key, value in s3.env.items():
            mp.setenv(key, value)
        mp.setenv("VLLM_ASSETS_CACHE", str(root / "vllm-assets"))
        mp.setenv("VLLM_CACHE_ROOT", str(root / "vllm-cache"))
        prefix = f"faults-{uuid.uuid4().hex[:8]}"
        uri = s3.upload_dir(qwen35, BUCKET, prefix)
        key = f"{prefix}/{mtp.path.name}"
        yield Store(
            s3=s3,
            uri=uri,
            key=key,
            address=f"{STORE}://{BUCKET}/{key}",
            shard=mtp.path,
            revalued_dir=local["revalued"],
            reshaped_dir=local["reshaped"],
            truncated_file=truncated(mtp.path, root / "truncated.safetensors"),
        )


@pytest.fixture
def bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A short timeout and few retries: each fault case is over in seconds."""
    monkeypatch.setenv("HYBRID_DRAFT_OBJECT_TIMEOUT", str(TIMEOUT_S))
    monkeypatch.setenv("HYBRID_DRAFT_OBJECT_RETRIES", str(RETRIES))


@pytest.fixture
def clean(store: Store) -> Iterator[Store]:
    """The store as uploaded, no fault armed, before and after the test."""
    store.restore()
    yield store
    store.restore()


def _target(config: Any) -> Any:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.model_executor.model_loader import get_model

    with set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        return get_model(vllm_config=config)


def _draft(config: Any, target: Any) -> Any:
    """The draft by model runner v2's ``load_eagle_model`` (both releases' route)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

    with set_current_vllm_config(config):
        return load_eagle_model(target, config)


@pytest.fixture(scope="module")
def loaded_target(store: Store, qwen35: Path) -> Any:
    """One target for the drafts that stream their own tensors (no load scope: no hold)."""
    store.restore()
    return _target(engine_config(store.uri, load_format="runai_streamer", config_dir=qwen35))


@dataclass
class OwnStream:
    """The store, and a loaded target whose drafts plan and stream their own tensors."""

    store: Store
    target: Any
    qwen35: Path

    def load(self) -> Any:
        """A draft of the target (its own config: vLLM registers each draft's layers in
        the config it is built with, once)."""
        config = engine_config(self.store.uri, load_format="runai_streamer", config_dir=self.qwen35)
        return _draft(config, self.target)


@pytest.fixture
def own_stream(
    clean: Store,
    loaded_target: Any,
    qwen35: Path,
    bounded: None,
    monkeypatch: pytest.MonkeyPatch,
) -> OwnStream:
    monkeypatch.setenv("HYBRID_DRAFT_HOLD_BUDGET", "0")
    return OwnStream(clean, loaded_target, qwen35)


def _failed(events: Events, error_type: str) -> dict[str, Any]:
    """The draft's one ``load_failed``, of ``error_type``; no draft loaded."""
    assert [e["role"] for e in events.named("hybrid_draft.loaded")].count("draft") == 0
    (failed,) = [e for e in events.named("hybrid_draft.load_failed") if e["role"] == "draft"]
    assert failed["error_type"] == error_type, failed
    assert "\n" not in failed["error"]
    return failed


def _loaded(events: Events) -> dict[str, Any]:
    (loaded,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"]
    return loaded


# --- transient faults: retried, the same weights --------------------------------------------


@pytest.mark.parametrize(
    ("fault", "retried"),
    [
        pytest.param(lambda key: Fault.throttle(key, 2), 2, id="plan-503-twice"),
        pytest.param(
            lambda key: Fault.reset(key, sent=4, after=1), CUT_RETRIED, id="plan-reset-mid-body"
        ),
        pytest.param(lambda key: Fault.delay(key, 5, times=1), 1, id="plan-answer-too-slow"),
        pytest.param(lambda key: Fault.throttle(key, 2, after=PLAN_GETS), 0, id="stream-503-twice"),
        pytest.param(
            lambda key: Fault.reset(key, sent=100, after=PLAN_GETS + RUNAI_HEADER_GETS),
            0,
            id="stream-reset-mid-body",
        ),
    ],
)
def test_a_transient_fault_is_retried_and_the_draft_is_the_checkpoints(
    own_stream: OwnStream,
    qwen35: Path,
    events: Events,
    fault: Any,
    retried: int,
) -> None:
    store = own_stream.store
    store.s3.arm(fault(store.key))

    draft = own_stream.load()

    assert store.s3.fault_state()["applied"] >= 1
    assert_qwen35_draft_is_the_checkpoints(qwen35, draft)
    loaded = _loaded(events)
    # The layer's own requests it retried (its plan's); Run:ai's client retries its own
    # requests without saying how often.
    assert loaded["retried"] == retried
    assert loaded["sources"]["storage"]["tensors"] > 0


# --- an object that changes under the load ----------------------------------------------------


def test_replaced_before_the_plan_the_draft_is_all_the_new_version(
    own_stream: OwnStream, events: Events
) -> None:
    store = own_stream.store
    store.put(store.replacement)

    draft = own_stream.load()

    assert_qwen35_draft_is_the_checkpoints(store.revalued_dir, draft)
    assert _loaded(events)["retried"] == 0


def _refused(own_stream: OwnStream, fault: Any) -> tuple[str, float, dict[str, Any]]:
    """The draft's load with one fault armed: the error it raised, how long it took and the
    fault's state."""
    from hybrid_draft.core.objectstore import ObjectStoreError

    store = own_stream.store
    store.s3.arm(fault(store.key))
    started = time.monotonic()
    with pytest.raises(ObjectStoreError) as info:
        own_stream.load()
    took = time.monotonic() - started
    return str(info.value), took, store.s3.disarm()


def _replace(body: str, **where: Any) -> Any:
    return lambda store: Fault.replace_with(store.key, getattr(store, body), **where)


@pytest.mark.parametrize(
    ("fault", "body", "when"),
    [
        pytest.param(
            _replace("other_offsets", methods=("HEAD",), after=PLAN_HEADS),
            "other_offsets",
            "before the draft's tensors were read",
            id="before-the-read-other-header",
        ),
        pytest.param(
            _replace("replacement", methods=("HEAD",), after=PLAN_HEADS),
            "replacement",
            "before the draft's tensors were read",
            id="before-the-read-same-header",
        ),
        pytest.param(
            _replace("other_offsets", after=PLAN_GETS),
            "other_offsets",
            "while the draft's tensors were read",
            id="before-runai-header-other-header",
        ),
        pytest.param(
            _replace("truncated_file", after=PLAN_GETS),
            "truncated_file",
            "while the draft's tensors were read",
            id="before-runai-header-truncated",
        ),
        pytest.param(
            _replace("other_offsets", after=PLAN_GETS + RUNAI_HEADER_GETS),
            "other_offsets",
            "while the draft's tensors were read",
            id="after-runai-header-other-header",
        ),
        pytest.param(
            _replace("replacement", after=PLAN_GETS + RUNAI_HEADER_GETS + 1),
            "replacement",
            "while the draft's tensors were read",
            id="mid-stream-same-header",
        ),
        pytest.param(
            _replace("truncated_file", after=PLAN_GETS + RUNAI_HEADER_GETS + 1),
            "truncated_file",
            "while the draft's tensors were read",
            id="mid-stream-truncated",
        ),
    ],
)
def test_replaced_after_the_plan_the_draft_fails_naming_both_versions(
    own_stream: OwnStream, events: Events, fault: Any, body: str, when: str
) -> None:
    from hybrid_draft.core.shardread import ShardChanged

    store = own_stream.store
    planned = store.version(store.shard.read_bytes())
    store.s3.arm(fault(store))

    with pytest.raises(ShardChanged) as info:
        own_stream.load()

    assert store.s3.fault_state()["applied"] == 1
    failed = _failed(events, "ShardChanged")
    assert failed["error"] == str(info.value)
    now = store.version(getattr(store, body).read_bytes())
    assert failed["error"] == (
        f"{store.address}: the object changed {when}: its header was read from ({planned}), "
        f"it is now ({now}); it was replaced or rewritten, and is not read at the old header's "
        "offsets"
    )


def test_truncated_before_the_plan_the_draft_fails_naming_the_object(
    own_stream: OwnStream, events: Events
) -> None:
    from hybrid_draft.core.objectstore import ObjectStoreError

    store = own_stream.store
    store.put(store.truncated_file)

    with pytest.raises(ObjectStoreError):
        own_stream.load()

    failed = _failed(events, "ObjectStoreError")
    size, whole = store.truncated_file.stat().st_size, store.shard.stat().st_size
    assert failed["error"] == (
        f"{store.address}: the object has {size:,} bytes, but its header describes {whole:,}: "
        "it is truncated, or not a whole safetensors file"
    )


# --- permanent faults: one line, the object and the store's answer ----------------------------


@pytest.mark.parametrize(
    ("fault", "answer", "gets"),
    [
        pytest.param(Fault.deny, "the object store answered 403 AccessDenied", 1, id="403"),
        pytest.param(Fault.missing, "the object store answered 404 NoSuchKey", 1, id="404"),
        pytest.param(
            lambda key: Fault.throttle(key, None),
            f"the object store answered 503 SlowDown, retried {RETRIES} times",
            RETRIES + 1,
            id="503-forever",
        ),
        pytest.param(
            lambda key: Fault.delay(key, 30),
            f"no answer from the object store within {TIMEOUT_S} s "
            f"(HYBRID_DRAFT_OBJECT_TIMEOUT), retried {RETRIES} times",
            RETRIES + 1,
            id="no-answer",
        ),
    ],
)
def test_a_plan_the_store_refuses_fails_once_naming_the_object_and_the_answer(
    own_stream: OwnStream, events: Events, fault: Any, answer: str, gets: int
) -> None:
    error, took, state = _refused(own_stream, fault)
    expected = f"{own_stream.store.address}: reading its header for the draft's plan: {answer}"
    assert error == expected
    assert _failed(events, "ObjectStoreError")["error"] == expected
    (decision,) = events.decisions("draft")
    assert (decision["action"], decision["reason"]) == ("switched", "same_checkpoint")
    assert decision["plan_error"] == f"ObjectStoreError: {expected}"
    # Asked once (with its retries), not a second time by vLLM's own path.
    assert state["matched"] == gets
    assert took < 60  # bounded: the timeout and retries, not a hang


@pytest.mark.parametrize(
    ("fault", "answer"),
    [
        pytest.param(
            lambda key: Fault.deny(key, after=PLAN_GETS),
            "the object store answered 403 AccessDenied",
            id="403",
        ),
        pytest.param(
            lambda key: Fault.throttle(key, None, after=PLAN_GETS),
            "the object store answered 503 SlowDown",
            id="503-forever",
            marks=GCS_RETRIES_ITS_OWN,
        ),
        pytest.param(
            lambda key: Fault.delay(key, 30, after=PLAN_GETS),
            f"no answer from the object store within {TIMEOUT_S} s (HYBRID_DRAFT_OBJECT_TIMEOUT)",
            id="no-answer",
            marks=[GCS_RETRIES_ITS_OWN, AZURE_WAITS_ITS_OWN],
        ),
    ],
)
def test_a_stream_the_store_refuses_fails_naming_the_object_and_the_answer(
    own_stream: OwnStream, events: Events, fault: Any, answer: str
) -> None:
    error, took, _ = _refused(own_stream, fault)
    expected = (
        f"{own_stream.store.address}: the Run:ai Model Streamer could not read the draft's tensors "
        f"(File access error); asked again, {answer}"
    )
    assert error == expected
    assert _failed(events, "ObjectStoreError")["error"] == expected
    assert took < 90  # Run:ai's client: about 5 s per stalled attempt, 3 attempts


@GCS_RETRIES_ITS_OWN
@AZURE_WAITS_ITS_OWN
def test_a_stalled_stream_fails_within_its_bound(own_stream: OwnStream, events: Events) -> None:
    """Headers and a few bytes, then nothing: Run:ai's client cuts each attempt."""
    from hybrid_draft.core.objectstore import ObjectStoreError

    store = own_stream.store
    store.s3.arm(Fault.stall(store.key, 120, sent=10, after=PLAN_GETS + RUNAI_HEADER_GETS))
    started = time.monotonic()

    with pytest.raises(ObjectStoreError):
        own_stream.load()

    assert time.monotonic() - started < 90
    failed = _failed(events, "ObjectStoreError")
    assert failed["error"].startswith(
        f"{store.address}: the Run:ai Model Streamer could not read the draft's tensors "
        f"(File access error) within its {RETRIES} retries of each request"
    )


# --- one pass: the draft from the target's stream ----------------------------------------------


def _one_pass(store: Store, qwen35: Path, between: Any = None) -> tuple[Any, Any, int]:
    """Target and draft in a load scope (one pass); ``between`` runs after the target's
    load; the server's record position then."""
    from hybrid_draft.adapter import loadscope

    config = engine_config(store.uri, load_format="runai_streamer", config_dir=qwen35)
    with loadscope.scope():
        target = _target(config)
        if between is not None:
            between()
        mark = store.s3.mark()
        draft = _draft(config, target)
    return target, draft, mark


def test_one_pass_replaced_before_the_load_is_all_the_new_version(
    clean: Store, qwen35: Path, events: Events, bounded: None
) -> None:
    clean.put(clean.replacement)

    _target_model, draft, _ = _one_pass(clean, qwen35)

    assert_qwen35_draft_is_the_checkpoints(clean.revalued_dir, draft)
    assert _loaded(events)["sources"]["storage"]["tensors"] == 0


@pytest.mark.parametrize(
    ("after", "body"),
    [
        pytest.param(PLAN_GETS, "replacement", id="between-plan-and-target-stream"),
        pytest.param(PLAN_GETS + RUNAI_HEADER_GETS, "other_offsets", id="mid-target-stream"),
    ],
)
def test_one_pass_replaced_under_the_targets_stream_nothing_held_is_used(
    clean: Store, qwen35: Path, events: Events, bounded: None, after: int, body: str
) -> None:
    """The target reads what it reads (vLLM's); what its stream held for the draft is let
    go, and the draft, held to the version its plan read, fails naming both."""
    from hybrid_draft.core.shardread import ShardChanged

    clean.s3.arm(Fault.replace_with(clean.key, getattr(clean, body), after=after))

    with pytest.raises(ShardChanged):
        _one_pass(clean, qwen35)

    assert clean.s3.fault_state()["applied"] == 1
    assert [e["role"] for e in events.named("hybrid_draft.loaded")] == ["target"]
    (decision,) = events.decisions("draft")
    assert decision["sources"]["stream"]["tensors"] == 0
    assert decision["sources_detail"]["stream"].startswith(
        f"object_changed: {clean.address}: the object changed after the target's stream"
    )
    failed = _failed(events, "ShardChanged")
    assert failed["error"].startswith(
        f"{clean.address}: the object changed before the draft's tensors were read"
    )


def test_one_pass_truncated_under_the_targets_stream_fails_the_target(
    clean: Store, qwen35: Path, events: Events, bounded: None
) -> None:
    """vLLM's own read of a truncated object fails, in its words: no draft is loaded."""
    clean.s3.arm(Fault.replace_with(clean.key, clean.truncated_file, after=PLAN_GETS))

    with pytest.raises(ValueError, match="libstreamer"):
        _one_pass(clean, qwen35)

    (failed,) = events.named("hybrid_draft.load_failed")
    assert failed["role"] == "target"
    assert [e["role"] for e in events.named("hybrid_draft.loaded")] == []
    # The layer asked again: the store answers, but the object is not a whole shard.
    size, whole = clean.truncated_file.stat().st_size, clean.shard.stat().st_size
    assert failed["failed_read"] == {
        "address": clean.address,
        "answer": f"{clean.address}: the object has {size:,} bytes, but its header describes "
        f"{whole:,}: it is truncated, or not a whole safetensors file",
        "status": None,
        "code": None,
    }


@pytest.mark.parametrize(
    ("fault", "status", "code"),
    [
        pytest.param(Fault.deny, 403, "AccessDenied", id="403"),
        pytest.param(
            lambda key, **kw: Fault.throttle(key, None, **kw),
            503,
            "SlowDown",
            id="503-forever",
            marks=GCS_RETRIES_ITS_OWN,
        ),
    ],
)
def test_a_target_whose_reads_the_store_refuses_fails_naming_the_object_and_the_answer(
    clean: Store,
    qwen35: Path,
    events: Events,
    bounded: None,
    monkeypatch: pytest.MonkeyPatch,
    fault: Any,
    status: int,
    code: str,
) -> None:
    """Every read of the MTP shard's bytes refused (the target's plan made before): vLLM's
    error stays vLLM's, and the target's ``load_failed`` says which object and what the
    store answered."""
    from hybrid_draft.adapter import loadscope

    monkeypatch.setenv("RUNAI_STREAMER_S3_MAX_RETRIES", "1")  # the user's own: a short run
    config = engine_config(clean.uri, load_format="runai_streamer", config_dir=qwen35)
    clean.s3.arm(fault(clean.key, after=PLAN_GETS))
    started = time.monotonic()

    with pytest.raises(ValueError, match="libstreamer"), loadscope.scope():
        _target(config)

    assert time.monotonic() - started < 120
    (failed,) = events.named("hybrid_draft.load_failed")
    assert (failed["role"], failed["error_type"]) == ("target", "ValueError")
    assert failed["failed_read"] == {
        "address": clean.address,
        "answer": f"the object store answered {status} {code}",
        "status": status,
        "code": code,
    }


def test_one_pass_replaced_after_the_targets_stream_the_held_version_is_taken(
    clean: Store, qwen35: Path, events: Events, bounded: None
) -> None:
    """The target's stream read the planned version (checked as it ended); the object then
    changes: the draft takes what was held, and asks the store nothing."""
    _target_model, draft, mark = _one_pass(
        clean, qwen35, between=lambda: clean.put(clean.replacement)
    )

    assert_qwen35_draft_is_the_checkpoints(qwen35, draft)
    assert clean.s3.requests(since=mark) == []
    loaded = _loaded(events)
    assert loaded["sources"]["storage"]["tensors"] == 0
    assert loaded["sources"]["stream"]["tensors"] > 0


def test_one_pass_a_plan_retried_then_held(
    clean: Store, qwen35: Path, events: Events, bounded: None
) -> None:
    clean.s3.arm(Fault.throttle(clean.key, 2))

    _target_model, draft, _ = _one_pass(clean, qwen35)

    assert_qwen35_draft_is_the_checkpoints(qwen35, draft)
    target_load, draft_load = events.named("hybrid_draft.loaded")
    assert (target_load["role"], target_load["retried"]) == ("target", 2)
    assert draft_load["sources"]["stream"]["tensors"] > 0


def test_one_pass_a_plan_refused_once_is_made_again_by_the_draft(
    clean: Store, qwen35: Path, events: Events, bounded: None
) -> None:
    """A 403 on the target's plan (not retried): no one pass; the target loads, and the
    draft plans and streams its own tensors."""
    clean.s3.arm(Fault.deny(clean.key, times=1))

    _target_model, draft, _ = _one_pass(clean, qwen35)

    assert_qwen35_draft_is_the_checkpoints(qwen35, draft)
    (target,) = events.decisions("target")
    assert target["one_pass"]["reason"] == "planning_failed"
    assert "403 AccessDenied" in target["one_pass"]["detail"]
    assert _loaded(events)["sources"]["storage"]["tensors"] > 0


# --- hybrid-draft plan ------------------------------------------------------------------------


def test_plan_of_an_object_the_store_refuses_is_one_line_and_exit_2(
    clean: Store, tmp_path: Path
) -> None:
    clean.s3.arm(Fault.deny(clean.key))
    env = {**clean.s3.client_env(), "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "hybrid_draft", "plan", clean.uri],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 2
    assert done.stderr == (
        f"hybrid-draft plan: {clean.address}: reading its header for the draft's plan: "
        "the object store answered 403 AccessDenied\n"
    )


@pytest.mark.once  # the stores' clients; the S3 set above runs on every release
@pytest.mark.parametrize("other", ["gs", "az"])
def test_the_fault_set_of_another_store_in_a_process_of_its_own(other: str, tmp_path: Path) -> None:
    """This module's every case against fake-gcs-server (Run:ai's GCS client) or Azurite
    (Run:ai's Azure client, over HTTPS as ``devstoreaccount1.blob.core.windows.net`` in a
    network and mount namespace of the child's own), in a child pytest: Run:ai serves one
    object store per process."""
    if STORE != "s3":
        pytest.skip("the child itself")
    env, wrap = {STORE_ENV: other}, None
    if other == "az":
        if os.environ.get(AZURE_STREAM_ENV) != "1":
            pytest.skip(
                f"{AZURE_STREAM_ENV}=1 runs it: with other suites beside it, a request of "
                "Run:ai's Azure client can outlast the cases' 1 s bound, and the retry moves "
                "the request a fault is injected at"
            )
        why = azure_namespace_unavailable()
        if why is not None:
            pytest.skip(why)
        tls = azure_tls(tmp_path / "tls")
        env[AZURE_TLS_ENV] = str(tls)
        wrap = lambda argv: in_azure_namespace(argv, tls)  # noqa: E731
    proc = child_pytest(__file__, "not in_a_process_of_its_own", env, wrap=wrap)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    skipped = {"gs": 4, "az": 2}[other]
    assert re.search(rf"\b\d+ passed, {skipped} skipped\b", proc.stdout), tail
