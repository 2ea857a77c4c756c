"""The layer's own requests to ``gs://`` and ``az://`` objects, without vLLM
(``core/objectstore.py``), against real emulators on loopback behind the S3 tests' fault
middleware (``tests/objectservers.py``: fake-gcs-server, Azurite): the version each header is
read from (a GCS generation, an Azure ETag), an object changed at each point the layer
checks refused naming both versions, transient faults retried, and each permanent fault one
line naming the object and the store's code, within its bound. (The Run:ai Model Streamer
reading ``gs://`` in vLLM: ``test_objectstore_faults.py``, in a process of its own.)"""

from __future__ import annotations

import dataclasses
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybrid_draft.core import checkpoint, figures, objectstore
from hybrid_draft.core.shardread import ShardChanged
from objectservers import AzureServer, GCSServer
from s3server import Fault

pytestmark = pytest.mark.once  # the same on every vLLM release (docs/testing.md)

BUCKET = "models"
ACCESS = objectstore.Access(timeout=1.0, retries=2)


@pytest.fixture(scope="module", params=["gs", "az"])
def server(request: pytest.FixtureRequest) -> Iterator[GCSServer | AzureServer]:
    if request.param == "az":
        why = AzureServer.available()
        if why is not None:
            pytest.skip(why)
        with AzureServer() as azure:
            yield azure
    else:
        with GCSServer() as gcs:
            yield gcs


@pytest.fixture
def uris(
    server: GCSServer | AzureServer, qwen35: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[str]]:
    """``qwen35``'s shards under a prefix of their own; this process set to reach them."""
    for key, value in server.client_env().items():
        monkeypatch.setenv(key, value)
    for name in (objectstore.RUNAI_MAX_RETRIES, objectstore.RUNAI_REQUEST_TIMEOUT_MS):
        monkeypatch.delenv(name, raising=False)
    uri = server.upload_dir(qwen35, BUCKET, f"req-{uuid.uuid4().hex[:8]}")
    server.reset()
    yield [f"{uri}/{p.name}" for p in sorted(qwen35.glob("*.safetensors"))]
    server.disarm()


def _key(uri: str) -> str:
    return uri.partition("://")[2].partition("/")[2]


def _mtp(qwen35: Path) -> Path:
    return sorted(qwen35.glob("*.safetensors"))[-1]


def test_each_header_keeps_the_version_it_was_read_from(
    server: GCSServer | AzureServer, uris: list[str], qwen35: Path
) -> None:
    with figures.measuring() as stats:
        shards = objectstore.read_shards(uris, ACCESS)
    assert stats.retried == 0
    for shard, local in zip(shards, sorted(qwen35.glob("*.safetensors")), strict=True):
        assert shard.version is not None and shard.version.size == local.stat().st_size
        assert shard.tensors == checkpoint.read_shard(local).tensors
        if isinstance(server, GCSServer):
            assert shard.version.generation == server.generation(BUCKET, _key(shard.uri or ""))
        else:
            assert shard.version.etag and shard.version.etag.startswith('"0x')
    # Each header's length and header: two ranged reads of the object's bytes.
    ranges = [r.range for r in server.object_gets()]
    assert ranges.count("bytes=0-7") == len(uris)
    assert len(ranges) == 2 * len(uris)


def test_replaced_between_its_requests_the_header_is_read_again(
    server: GCSServer | AzureServer, uris: list[str], tmp_path: Path, qwen35: Path
) -> None:
    other = tmp_path / "other.safetensors"
    other.write_bytes(_mtp(qwen35).read_bytes()[:-1] + b"\x01")  # the same header, new bytes
    server.arm(Fault.replace_with(_key(uris[-1]), other, after=1))
    with figures.measuring() as stats:
        (shard,) = objectstore.read_shards(uris[-1:], ACCESS)
    assert stats.retried == 1  # the pinned second read was refused: read again
    assert shard.version == objectstore.read_shards(uris[-1:], ACCESS)[0].version
    objectstore.verify([shard], ACCESS, "now")  # the version now: the replacement's


def test_a_changed_object_is_refused_naming_both_versions(
    server: GCSServer | AzureServer, uris: list[str], qwen35: Path
) -> None:
    (shard,) = objectstore.read_shards(uris[-1:], ACCESS)
    objectstore.verify([shard], ACCESS, "now")  # unchanged: nothing to say
    local = _mtp(qwen35).read_bytes()
    server.put(BUCKET, _key(uris[-1]), local[: len(local) // 2])
    with pytest.raises(ShardChanged) as info:
        objectstore.verify([shard], ACCESS, "now")
    message = str(info.value)
    assert message.startswith(
        f"{uris[-1]}: the object changed now: its header was read from ({shard.version}), "
        "it is now ("
    )
    assert message.endswith(
        f", {len(local) // 2:,} bytes); it was replaced or rewritten, and is not read at the "
        "old header's offsets"
    )
    assert objectstore.changed([shard], ACCESS) == {
        uris[-1]: message.replace("changed now", "changed after the target's stream")
    }


def test_a_deleted_object_is_gone_naming_the_store_s_code(
    server: GCSServer | AzureServer, uris: list[str]
) -> None:
    (shard,) = objectstore.read_shards(uris[-1:], ACCESS)
    server.arm(Fault.missing(_key(uris[-1]), methods=("GET", "HEAD")))
    with pytest.raises(ShardChanged) as info:
        objectstore.verify([shard], ACCESS, "now")
    assert str(info.value) == (
        f"{uris[-1]}: the object is gone (404 NoSuchKey); it was there ({shard.version}) when "
        "the draft's load was planned"
    )


@pytest.mark.parametrize(
    ("fault", "retried"),
    [
        pytest.param(lambda key: Fault.throttle(key, 2), {"gs": 2, "az": 2}, id="503-twice"),
        # Azure's client reads a cut body again itself, uncounted.
        pytest.param(lambda key: Fault.reset(key, sent=4), {"gs": 1, "az": 0}, id="reset-mid-body"),
        pytest.param(
            lambda key: Fault.delay(key, 5, times=1), {"gs": 1, "az": 1}, id="answer-too-slow"
        ),
    ],
)
def test_a_transient_fault_is_retried_and_the_header_is_the_objects(
    server: GCSServer | AzureServer,
    uris: list[str],
    qwen35: Path,
    fault: object,
    retried: dict[str, int],
) -> None:
    server.arm(fault(_key(uris[-1])))  # type: ignore[operator]
    with figures.measuring() as stats:
        (shard,) = objectstore.read_shards(uris[-1:], ACCESS)
    assert server.fault_state()["applied"] >= 1
    assert stats.retried == retried[server.STORE]
    assert shard.tensors == checkpoint.read_shard(_mtp(qwen35)).tensors


@pytest.mark.parametrize(
    ("fault", "answer"),
    [
        pytest.param(Fault.deny, "the object store answered 403 AccessDenied", id="403"),
        pytest.param(Fault.missing, "the object store answered 404 NoSuchKey", id="404"),
        pytest.param(
            lambda key: Fault.throttle(key, None),
            f"the object store answered 503 SlowDown, retried {ACCESS.retries} times",
            id="503-forever",
        ),
        pytest.param(
            lambda key: Fault.delay(key, 30),
            f"no answer from the object store within {ACCESS.timeout:g} s "
            f"(HYBRID_DRAFT_OBJECT_TIMEOUT), retried {ACCESS.retries} times",
            id="no-answer",
        ),
    ],
)
def test_a_header_the_store_refuses_is_one_line_naming_the_object_and_the_code(
    server: GCSServer | AzureServer, uris: list[str], fault: object, answer: str
) -> None:
    """Every read of the object refused, its metadata included."""
    server.arm(dataclasses.replace(fault(_key(uris[-1])), methods=("GET", "HEAD")))  # type: ignore[operator]
    started = time.monotonic()
    with pytest.raises(objectstore.ObjectStoreError) as info:
        objectstore.read_shards(uris[-1:], ACCESS)
    assert time.monotonic() - started < 60
    assert str(info.value) == f"{uris[-1]}: reading its header for the draft's plan: {answer}"


def test_an_endpoint_that_refuses_connections_is_one_line_within_its_bound(
    server: GCSServer | AzureServer, uris: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    for key, value in server.client_env().items():
        monkeypatch.setenv(key, value.replace(str(server.port), str(port)))
    started = time.monotonic()
    with pytest.raises(objectstore.ObjectStoreError) as info:
        objectstore.read_shards(uris[-1:], ACCESS)
    assert time.monotonic() - started < 60
    message = str(info.value)
    assert message.startswith(
        f"{uris[-1]}: reading its header for the draft's plan: no connection to the object store ("
    )
    assert message.endswith(f"), retried {ACCESS.retries} times")
    assert "\n" not in message


def test_a_failed_target_read_names_the_truncated_shard_over_one_that_answers_late(
    server: GCSServer | AzureServer, uris: list[str], qwen35: Path
) -> None:
    """``failed_read`` after a target's load failed in its loader's words: one shard gives
    no answer within the bound (as a busy store can for a whole shard), another is
    truncated: the truncated one is named, with what its answer shows."""
    late, cut = uris[0], uris[-1]
    whole = _mtp(qwen35).read_bytes()
    server.put(BUCKET, _key(cut), whole[:-1000])
    server.arm(dataclasses.replace(Fault.delay(_key(late), 30), methods=("GET", "HEAD")))
    read = objectstore.failed_read([late, cut], ACCESS)
    assert read is not None
    assert (read.address, read.status, read.code) == (cut, None, None)
    assert read.answer == (
        f"{cut}: the object has {len(whole) - 1000:,} bytes, but its header describes "
        f"{len(whole):,}: it is truncated, or not a whole safetensors file"
    )
    server.disarm()
    # With no answer from any other, the late one is named, as no answer in time.
    server.arm(dataclasses.replace(Fault.delay(_key(late), 30), methods=("GET", "HEAD")))
    read = objectstore.failed_read([late], ACCESS)
    assert read is not None and read.address == late
    assert read.answer == (
        f"no answer from the object store within {ACCESS.timeout:g} s (HYBRID_DRAFT_OBJECT_TIMEOUT)"
    )
