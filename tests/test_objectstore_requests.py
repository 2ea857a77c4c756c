"""The layer's own requests to object storage, without vLLM (``core/objectstore.py``): the
version each header is read from, what a changed object is refused with, each request's
bounds, and the Run:ai Model Streamer's client bounded alike. Against a real S3-compatible
server on loopback (moto's, ``tests/s3server.py``) with one fault injected at a time."""

from __future__ import annotations

import hashlib
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybrid_draft.core import checkpoint, figures, objectstore, readers
from hybrid_draft.core.shardread import ShardChanged
from s3server import Fault, S3Server

pytestmark = pytest.mark.once  # the same on every vLLM release (docs/testing.md)

BUCKET = "models"
ACCESS = objectstore.Access(timeout=1.0, retries=2)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


@pytest.fixture
def uris(s3: S3Server, qwen35: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``qwen35``'s shards under a prefix of their own; this process set to reach them."""
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    for name in (objectstore.RUNAI_MAX_RETRIES, objectstore.RUNAI_REQUEST_TIMEOUT_MS):
        monkeypatch.delenv(name, raising=False)
    uri = s3.upload_dir(qwen35, BUCKET, f"req-{uuid.uuid4().hex[:8]}")
    yield [f"{uri}/{p.name}" for p in sorted(qwen35.glob("*.safetensors"))]
    s3.disarm()


def _key(uri: str) -> str:
    return uri.removeprefix(f"s3://{BUCKET}/")


def _etag(data: bytes) -> str:
    return f'"{hashlib.md5(data).hexdigest()}"'


def test_each_header_keeps_the_version_it_was_read_from(
    s3: S3Server, uris: list[str], qwen35: Path
) -> None:
    with figures.measuring() as stats:
        shards = objectstore.read_shards(uris, ACCESS)
    assert stats.retried == 0
    for shard, local in zip(shards, sorted(qwen35.glob("*.safetensors")), strict=True):
        data = local.read_bytes()
        assert shard.version == checkpoint.ObjectVersion(_etag(data), None, len(data))
        assert shard.tensors == checkpoint.read_shard(local).tensors
    # Two ranged requests per shard; the second held to the first's version.
    assert [r.range for r in s3.object_gets()].count("bytes=0-7") == len(uris)


def test_replaced_between_its_two_requests_the_header_is_read_again(
    s3: S3Server, uris: list[str], tmp_path: Path, qwen35: Path
) -> None:
    local = sorted(qwen35.glob("*.safetensors"))[-1]
    other = tmp_path / "other.safetensors"
    other.write_bytes(local.read_bytes()[:-1] + b"\x01")  # the same header, another ETag
    s3.arm(Fault.replace_with(_key(uris[-1]), other, after=1))
    with figures.measuring() as stats:
        (shard,) = objectstore.read_shards(uris[-1:], ACCESS)
    assert stats.retried == 1  # the pinned second request was refused (412): read again
    assert shard.version is not None and shard.version.etag == _etag(other.read_bytes())


def test_a_changed_object_is_refused_naming_both_versions(
    s3: S3Server, uris: list[str], tmp_path: Path, qwen35: Path
) -> None:
    (shard,) = objectstore.read_shards(uris[-1:], ACCESS)
    objectstore.verify([shard], ACCESS, "now")  # unchanged: nothing to say
    local = sorted(qwen35.glob("*.safetensors"))[-1].read_bytes()
    s3.client().put_object(Bucket=BUCKET, Key=_key(uris[-1]), Body=local[: len(local) // 2])
    with pytest.raises(ShardChanged) as info:
        objectstore.verify([shard], ACCESS, "now")
    assert str(info.value) == (
        f"{uris[-1]}: the object changed now: its header was read from (ETag {_etag(local)}, "
        f"{len(local):,} bytes), it is now (ETag {_etag(local[: len(local) // 2])}, "
        f"{len(local) // 2:,} bytes); it was replaced or rewritten, and is not read at the old "
        "header's offsets"
    )
    assert objectstore.changed([shard], ACCESS) == {
        uris[-1]: str(info.value).replace("changed now", "changed after the target's stream")
    }
    s3.client().delete_object(Bucket=BUCKET, Key=_key(uris[-1]))
    with pytest.raises(ShardChanged, match=r"the object is gone \(404 NoSuchKey\); it was there"):
        objectstore.verify([shard], ACCESS, "now")


def test_an_endpoint_that_refuses_connections_is_one_line_within_its_bound(
    uris: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(objectstore.ObjectStoreError) as info:
        objectstore.read_shards(uris[-1:], ACCESS)
    assert time.monotonic() - started < 30
    assert str(info.value) == (
        f"{uris[-1]}: reading its header for the draft's plan: no connection to the object "
        f'store (Could not connect to the endpoint URL: "http://127.0.0.1:{port}/{BUCKET}/'
        f'{_key(uris[-1])}"), retried {ACCESS.retries} times'
    )


def test_a_stream_reads_only_the_planned_version(
    s3: S3Server, uris: list[str], tmp_path: Path, qwen35: Path
) -> None:
    """The Run:ai Model Streamer re-reads the header and takes no version: a shard whose
    bytes change under it, header and size alike, is refused once it has read them."""
    shards = objectstore.read_shards(uris, ACCESS)
    selection = checkpoint.selection(shards, lambda t: t.name.startswith("mtp."))
    local = sorted(qwen35.glob("*.safetensors"))[-1].read_bytes()
    other = tmp_path / "other.safetensors"
    other.write_bytes(local[:-4] + b"\x01\x02\x03\x04")
    with figures.measuring():
        clean = dict(readers.runai_filtered_iterator(selection, access=ACCESS))
    assert set(clean) == set(selection.names)
    s3.arm(Fault.replace_with(_key(uris[-1]), other, after=3))  # after Run:ai's header
    with pytest.raises(ShardChanged, match="the object changed while the draft's tensors"):
        dict(readers.runai_filtered_iterator(selection, access=ACCESS))


def test_runai_limits_bound_its_client_for_the_stream_and_leave_a_users_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(objectstore.RUNAI_MAX_RETRIES, raising=False)
    monkeypatch.setenv(objectstore.RUNAI_REQUEST_TIMEOUT_MS, "7000")  # the user's own
    with objectstore.runai_limits(objectstore.Access(timeout=2.5, retries=3)):
        assert os.environ[objectstore.RUNAI_MAX_RETRIES] == "3"
        assert os.environ[objectstore.RUNAI_REQUEST_TIMEOUT_MS] == "7000"
    assert objectstore.RUNAI_MAX_RETRIES not in os.environ
    assert os.environ[objectstore.RUNAI_REQUEST_TIMEOUT_MS] == "7000"
