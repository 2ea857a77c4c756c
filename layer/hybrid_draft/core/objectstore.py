"""Shards in object storage (``s3://``, ``gs://``, ``az://``): their headers, and the version
of each object that the draft's every read is held to.

An ``s3://`` shard's header is read by the layer's own S3 client (boto3, which the Run:ai
Model Streamer's S3 package brings and builds its own client with: the same endpoint,
credentials, addressing and signing) with two ranged requests, its 8-byte length and then its
header, the second pinned to the first's version (``If-Match`` its ETag). The shard keeps that
version (``checkpoint.ObjectVersion``: ETag, version id, size), and the draft's reads are
held to it (:func:`verify`): before and after the Run:ai Model Streamer reads the draft's
tensors, and once the target's stream has filled a one-pass hold (:func:`changed`). An object
replaced, rewritten or truncated since is refused (``shardread.ShardChanged``, naming both
versions): never read at another version's offsets, never mixed with another version.

Every request of the layer's own has a timeout and is retried, a bounded number of times, on
a transient fault (throttling, a 5xx, a connection reset or timeout): :class:`Access`, from
the settings; the retries are counted in the load's figures (``figures.retried``). A request
the object store refuses, or one still failing after its retries, is an
:class:`ObjectStoreError` naming the address and the store's answer (HTTP status and S3 error
code). The Run:ai Model Streamer's own client is given the same bounds for the draft's stream
(:func:`runai_limits`); when its read fails, the layer asks the store itself why
(:func:`explain`).

``gs://`` and ``az://`` headers are read by Run:ai's client (two ranged requests per shard
too), with no version: those shards are not held to one. No vLLM import.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from hybrid_draft import files, settings
from hybrid_draft.core import checkpoint, figures
from hybrid_draft.core.shardread import ShardChanged

#: Header reads in flight at once (a boto3 client is thread-safe).
READERS = 16
#: The Run:ai Model Streamer's settings of its S3 client, read as a stream opens it.
RUNAI_MAX_RETRIES = "RUNAI_STREAMER_S3_MAX_RETRIES"
RUNAI_REQUEST_TIMEOUT_MS = "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS"


@dataclass(frozen=True)
class Access:
    """How each request to object storage is bounded: cut after ``timeout`` seconds without
    a byte of its answer (connecting included), retried ``retries`` times."""

    timeout: float = settings.DEFAULT_OBJECT_TIMEOUT
    retries: int = settings.DEFAULT_OBJECT_RETRIES

    @classmethod
    def of(cls, current: settings.Settings | None) -> Access:
        """The bounds a load's settings give (the defaults without settings)."""
        if current is None:
            return cls()
        return cls(float(current.object_timeout.value), int(current.object_retries.value))


class ObjectStoreError(checkpoint.CheckpointError):
    """An object the layer could not read: one line naming its address and the object
    store's answer (HTTP status and S3 error code, no answer in time, no connection)."""


def is_s3(uri: str) -> bool:
    return uri.lower().startswith("s3://")


def _address(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.partition("://")[2].partition("/")
    return bucket, key


#: The environment an S3 client is built from: a client is reused while none of these
#: changes (building one reads botocore's service models: about 0.1 s and 1.5 MB).
_CLIENT_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CA_BUNDLE",
    "AWS_EC2_METADATA_DISABLED",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING",
    "RUNAI_STREAMER_S3_UNSIGNED",
)


def client(access: Access, attempts: int) -> Any:
    """An S3 client built as the Run:ai Model Streamer's S3 package builds its own
    (``AWS_ENDPOINT_URL``, the credential chain, path-style addressing where
    ``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0``, unsigned requests where
    ``RUNAI_STREAMER_S3_UNSIGNED=1``), its requests bounded by ``access``: botocore's
    standard retries (throttling, 5xx, connection errors and timeouts), ``attempts`` in all.
    Reused while the environment it was built from holds (a boto3 client is thread-safe)."""
    env = tuple(os.environ.get(name) for name in _CLIENT_ENV)
    return _client(access.timeout, attempts, env)


@functools.lru_cache(maxsize=8)
def _client(timeout: float, attempts: int, env: tuple[str | None, ...]) -> Any:
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    options: dict[str, Any] = {
        "connect_timeout": timeout,
        "read_timeout": timeout,
        "retries": {"mode": "standard", "total_max_attempts": attempts},
    }
    if os.environ.get("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "1") == "0":
        options["s3"] = {"addressing_style": "path"}
    if os.environ.get("RUNAI_STREAMER_S3_UNSIGNED", "0") == "1":
        options["signature_version"] = UNSIGNED
    # Run:ai's client takes its region from AWS_REGION as well; botocore only from
    # AWS_DEFAULT_REGION (and the profile).
    region = None if os.environ.get("AWS_DEFAULT_REGION") else os.environ.get("AWS_REGION")
    session = boto3.session.Session(region_name=region or None)
    return session.client("s3", config=Config(**options))


class _Requests:
    """One client's requests, their retries counted (from any thread)."""

    def __init__(self, access: Access, attempts: int | None = None) -> None:
        self.access = access
        self.attempts = attempts or access.retries + 1
        self.client = client(access, self.attempts)
        self.retries = 0
        self._lock = threading.Lock()

    def count(self, n: int) -> None:
        with self._lock:
            self.retries += n

    def call(self, operation: str, uri: str, **kwargs: Any) -> dict[str, Any]:
        bucket, key = _address(uri)
        try:
            response: dict[str, Any] = getattr(self.client, operation)(
                Bucket=bucket, Key=key, **kwargs
            )
        except Exception as exc:
            self.count(_retries_of(exc, self.attempts))
            raise
        self.count(int(response.get("ResponseMetadata", {}).get("RetryAttempts", 0)))
        return response


@contextlib.contextmanager
def _counted(requests: _Requests) -> Iterator[_Requests]:
    """``requests``, its retries added to the current load's figures once done."""
    try:
        yield requests
    finally:
        figures.retried(requests.retries)


def _retries_of(exc: BaseException, attempts: int) -> int:
    """How many times botocore retried a request that failed with ``exc``."""
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(exc, ClientError):
        return int(exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0))
    if isinstance(exc, (BotoConnectionError, HTTPClientError)):
        return attempts - 1  # connection errors and timeouts: retried to the last attempt
    return 0


def _status(exc: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and S3 error code of a refused request (None, None: not one)."""
    from botocore.exceptions import ClientError

    if not isinstance(exc, ClientError):
        return None, None
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = exc.response.get("Error", {}).get("Code")
    return (int(status) if status else None), (str(code) if code else None)


def _answer(exc: BaseException, access: Access) -> str:
    """What the object store did, in words: ``answered 403 AccessDenied``, ..."""
    from botocore.exceptions import (
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    status, code = _status(exc)
    if status is not None or code is not None:
        shown = f"{status or '?'} {code}" if code and code != str(status) else f"{status}"
        return f"the object store answered {shown}"
    if isinstance(exc, (ReadTimeoutError, ConnectTimeoutError)):
        return (
            f"no answer from the object store within {access.timeout:g} s "
            f"({settings.ENV_OBJECT_TIMEOUT})"
        )
    if isinstance(exc, EndpointConnectionError):
        return f"no connection to the object store ({files.one_line(str(exc), 300)})"
    if isinstance(exc, NoCredentialsError):
        return "no credentials for the object store (AWS_ACCESS_KEY_ID, a profile, a role...)"
    return f"the request failed: {files.error_line(exc)}"


def _times(n: int) -> str:
    return f"{n} time" if n == 1 else f"{n} times"


def _refused(uri: str, doing: str, exc: BaseException, requests: _Requests) -> ObjectStoreError:
    """The one line for a request that failed: the object, what was being done, the store's
    answer, and how often the request was retried."""
    retried = _retries_of(exc, requests.attempts)
    return ObjectStoreError(
        f"{files.show_path(uri)}: {doing}: {_answer(exc, requests.access)}"
        + (f", retried {_times(retried)}" if retried else "")
    )


def _transient_body(exc: BaseException) -> bool:
    """A failure while an answer's body was read (a connection reset or cut, a stall):
    botocore does not retry those, the layer does."""
    from botocore.exceptions import (
        ConnectionClosedError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

    return isinstance(
        exc,
        (
            _ShortBody,
            ConnectionClosedError,
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        ),
    )


def _version(response: dict[str, Any]) -> checkpoint.ObjectVersion:
    """The version a GET or HEAD answer is of: its ETag, version id, and the object's whole
    size (a ranged answer's ``Content-Range`` total, else its length)."""
    size = int(response.get("ContentLength", 0))
    content_range = str(response.get("ContentRange") or "")
    total = content_range.rpartition("/")[2]
    if total.isdigit():
        size = int(total)
    return checkpoint.ObjectVersion(
        etag=response.get("ETag") or None,
        version_id=response.get("VersionId") or None,
        size=size,
    )


def _pin(version: checkpoint.ObjectVersion) -> dict[str, str]:
    """The arguments that hold a request to ``version``: ``If-Match`` its ETag, and its
    version id in a versioned bucket."""
    out = {}
    if version.etag:
        out["IfMatch"] = version.etag
    if version.version_id:
        out["VersionId"] = version.version_id
    return out


def _same(planned: checkpoint.ObjectVersion, found: checkpoint.ObjectVersion) -> bool:
    return (
        found.size == planned.size
        and (planned.etag is None or found.etag == planned.etag)
        and (planned.version_id is None or found.version_id == planned.version_id)
    )


class _ShortBody(Exception):
    """An answer's body ended before its length: the connection was cut."""


def _body(response: dict[str, Any], size: int) -> bytes:
    """The first ``size`` bytes of an answer's body (a store that ignores the range sends
    the whole object: not read past what is needed); :class:`_ShortBody` when it ends
    before them."""
    stream = response["Body"]
    want = min(size, int(response.get("ContentLength", size)))
    data = b""
    try:
        while len(data) < want:
            piece: bytes = stream.read(want - len(data))
            if not piece:
                raise _ShortBody(f"{len(data):,} of {want:,} bytes, then the answer ended")
            data += piece
    finally:
        stream.close()
    return data


class _Again(Exception):
    """A header read to start over: the object was replaced between its two requests (the
    second, pinned to the first's version, was refused: 412), or an answer's body was cut."""


def _read_s3(uri: str, requests: _Requests) -> checkpoint.Shard:
    """One ``s3://`` shard from its header, and the version it was read from; read again
    (``access.retries`` times at most, each counted) when it changed or was cut between
    its two requests."""
    for attempt in range(requests.access.retries + 1):
        try:
            return _read_header(uri, requests)
        except _Again as again:
            if attempt == requests.access.retries:
                raise ObjectStoreError(
                    f"{files.show_path(uri)}: reading its header for the draft's plan: "
                    f"{again} ({_times(attempt + 1)} in a row)"
                ) from None
            requests.count(1)
    raise AssertionError("unreachable")


def _read_header(uri: str, requests: _Requests) -> checkpoint.Shard:
    from botocore.exceptions import ClientError

    shown = files.show_path(uri)
    doing = "reading its header for the draft's plan"

    def get(size: int, **kwargs: Any) -> tuple[bytes, checkpoint.ObjectVersion]:
        try:
            response = requests.call("get_object", uri, **kwargs)
        except ClientError as exc:
            if _status(exc)[0] == 412:
                raise _Again("the object changed between the two requests") from None
            raise _refused(uri, doing, exc, requests) from None
        except Exception as exc:
            raise _refused(uri, doing, exc, requests) from None
        try:
            return _body(response, size), _version(response)
        except Exception as exc:
            if _transient_body(exc):
                raise _Again(f"an answer was cut ({files.error_line(exc)})") from None
            raise _refused(uri, doing, exc, requests) from None

    raw, version = get(8, Range="bytes=0-7")
    length = checkpoint.header_length(shown, raw)
    header = b""
    if length:  # an empty header is asked for no range: object_shard refuses it
        header, _ = get(length, Range=f"bytes=8-{7 + length}", **_pin(version))
    shard = checkpoint.object_shard(uri, raw + header, version)
    if shard.size != version.size:
        raise ObjectStoreError(
            f"{shown}: the object has {version.size:,} bytes, but its header describes "
            f"{shard.size:,}: it is truncated, or not a whole safetensors file"
        )
    return shard


def read_shards(uris: Sequence[str], access: Access | None = None) -> list[checkpoint.Shard]:
    """The shards at ``uris``, from their headers alone; :class:`checkpoint.CheckpointError`
    naming the address for one that is not a safetensors file safetensors would accept,
    :class:`ObjectStoreError` for one that cannot be read. An ``s3://`` shard keeps the
    version its header was read from."""
    if not uris:
        return []
    if not all(map(is_s3, uris)):
        return _read_by_runai(uris)
    with _counted(_Requests(access or Access())) as requests:
        if len(uris) == 1:
            return [_read_s3(uris[0], requests)]
        pool = ThreadPoolExecutor(max_workers=min(READERS, len(uris)))
        try:
            futures = [pool.submit(_read_s3, uri, requests) for uri in uris]
            for done in as_completed(futures):
                done.result()  # the first failure ends the plan: the rest are not sent
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _head(uri: str, requests: _Requests, access: Access) -> checkpoint.ObjectVersion:
    """The object's version now (a HEAD; a refused HEAD, which carries no error code, is
    asked again as a GET of its first byte, once, for the store's code)."""
    from botocore.exceptions import ClientError

    try:
        return _version(requests.call("head_object", uri))
    except ClientError:
        pass
    return _first_byte(uri, _Requests(access, attempts=1))


def _first_byte(uri: str, requests: _Requests) -> checkpoint.ObjectVersion:
    """The object's version, from a GET of its first byte: an answer that, refused, carries
    the store's error code (a refused HEAD has none)."""
    response = requests.call("get_object", uri, Range="bytes=0-0")
    _body(response, 1)
    return _version(response)


def _gone(uri: str, exc: BaseException, planned: checkpoint.ObjectVersion | None) -> str | None:
    status, code = _status(exc)
    if status != 404:
        return None
    was = f" ({planned})" if planned is not None else ""
    return (
        f"{files.show_path(uri)}: the object is gone ({status} {code}); it was there{was} "
        "when the draft's load was planned"
    )


def _pinned(shards: Iterable[checkpoint.Shard]) -> list[checkpoint.Shard]:
    """The shards held to a version: ``s3://`` objects whose header read gave one."""
    return [s for s in shards if s.uri is not None and s.version is not None and is_s3(s.uri)]


def verify(shards: Iterable[checkpoint.Shard], access: Access, when: str) -> None:
    """Each object shard is still the version its header was read from; else
    ``ShardChanged`` naming the object and both versions (``when`` says at which point of the
    load), or :class:`ObjectStoreError` where the store will not say."""
    pinned = _pinned(shards)
    if not pinned:
        return
    with _counted(_Requests(access)) as requests:
        for shard in pinned:
            assert shard.uri is not None and shard.version is not None
            try:
                found = _head(shard.uri, requests, access)
            except Exception as exc:
                gone = _gone(shard.uri, exc, shard.version)
                if gone is not None:
                    raise ShardChanged(gone) from None
                raise _refused(shard.uri, f"checking its version {when}", exc, requests) from None
            if not _same(shard.version, found):
                raise ShardChanged(_changed(shard, found, when))


def _changed(shard: checkpoint.Shard, found: checkpoint.ObjectVersion, when: str) -> str:
    return (
        f"{files.show_path(shard.uri or shard.location)}: the object changed {when}: its "
        f"header was read from ({shard.version}), it is now ({found}); it was replaced or "
        "rewritten, and is not read at the old header's offsets"
    )


def changed(shards: Iterable[checkpoint.Shard], access: Access) -> dict[str, str]:
    """The object shards whose version is not, or cannot be told to be, the one their
    header was read from, each with why (never raises: the caller drops what it took)."""
    out = {}
    by_location = {s.location: s for s in _pinned(shards)}
    for location, shard in by_location.items():
        try:
            verify([shard], access, "after the target's stream")
        except checkpoint.CheckpointError as exc:
            out[location] = str(exc)
        except Exception as exc:  # a fault of the client's own: not taken either
            out[location] = files.error_line(exc)
    return out


def explain(
    shards: Iterable[checkpoint.Shard], access: Access, failure: BaseException
) -> checkpoint.CheckpointError | None:
    """Why the Run:ai Model Streamer's read of ``shards`` failed (``failure``: its error,
    which names neither object nor answer), by the layer's own question to the object store:
    a GET of each object's first byte, one attempt each. ``ShardChanged`` for an object
    that changed, :class:`ObjectStoreError` with the store's answer for one it refuses;
    None where there is no ``s3://`` shard to ask about."""
    objects = [s for s in shards if s.uri is not None and is_s3(s.uri)]
    if not objects:
        return None
    why = _runai_reason(failure)
    one = _Requests(access, attempts=1)
    for shard in objects:
        assert shard.uri is not None
        try:
            found = _first_byte(shard.uri, one)
        except Exception as exc:
            gone = _gone(shard.uri, exc, shard.version)
            if gone is not None:
                return ShardChanged(gone)
            return ObjectStoreError(
                f"{files.show_path(shard.uri)}: the Run:ai Model Streamer could not read the "
                f"draft's tensors ({why}); asked again, {_answer(exc, access)}"
            )
        if shard.version is not None and not _same(shard.version, found):
            return ShardChanged(_changed(shard, found, "while the draft's tensors were read"))
    shown = ", ".join(files.show_path(s.uri or s.location) for s in objects)
    return ObjectStoreError(
        f"{shown}: the Run:ai Model Streamer could not read the draft's tensors ({why}) "
        f"within its {access.retries} retries of each request; asked again, the object store "
        "answers, and the object is unchanged"
    )


def _runai_reason(failure: BaseException) -> str:
    """Run:ai's own words in its error (``... due to: b'File access error'``)."""
    text = str(failure)
    found = re.search(r"due to: b?'([^']*)'", text)
    return found.group(1) if found else files.one_line(text, 200)


@contextlib.contextmanager
def runai_limits(access: Access) -> Iterator[None]:
    """The Run:ai Model Streamer's S3 client bounded by ``access`` while it is open: each
    request retried ``retries`` times (``RUNAI_STREAMER_S3_MAX_RETRIES``) and cut once it
    receives less than a byte a second for ``timeout`` seconds
    (``RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS``). Run:ai reads them as a stream opens its
    client (in its own threads), so they stay set for the stream's life; one already set
    in the environment (the user's own) is left as it is."""
    wanted = {
        RUNAI_MAX_RETRIES: str(access.retries),
        RUNAI_REQUEST_TIMEOUT_MS: str(max(1, round(access.timeout * 1000))),
    }
    ours = {name: value for name, value in wanted.items() if not os.environ.get(name)}
    os.environ.update(ours)
    try:
        yield
    finally:
        for name, value in ours.items():
            if os.environ.get(name) == value:
                del os.environ[name]


def _read_by_runai(uris: Sequence[str]) -> list[checkpoint.Shard]:
    """Headers of objects the layer has no client of its own for (``gs://``, ``az://``):
    read by Run:ai's streamer, with no version."""
    lengths = _chunks([(i, uri, 0, 8) for i, uri in enumerate(uris)])
    sizes = [
        checkpoint.header_length(files.show_path(uri), lengths.get(i, b""))
        for i, uri in enumerate(uris)
    ]
    # An empty header is asked for no range: object_shard then says it is not JSON.
    headers = _chunks(
        [(i, uri, 8, size) for i, (uri, size) in enumerate(zip(uris, sizes, strict=True)) if size]
    )
    return [
        checkpoint.object_shard(uri, lengths[i] + headers.get(i, b"")) for i, uri in enumerate(uris)
    ]


def _chunks(requests: Sequence[tuple[int, str, int, int]]) -> dict[int, bytes]:
    """Each ``(index, address, offset, size)`` range, read by Run:ai's streamer, by its
    index."""
    from runai_model_streamer import DistributedStreamer, FileChunks

    out: dict[int, bytes] = {}
    with DistributedStreamer() as streamer:
        streamer.stream_files(
            [FileChunks(i, uri, [offset], [size]) for i, uri, offset, size in requests],
            None,
            "cpu",
            False,
        )
        for index, _chunk, buffer in streamer.get_chunks():
            out[index] = bytes(buffer.numpy().tobytes())
    return out


def list_shards(uri: str) -> list[str]:
    """The ``*.safetensors`` objects directly under ``uri``, as vLLM's Run:ai loader lists
    them (Run:ai's ``list_safetensors``), in order."""
    from runai_model_streamer import list_safetensors

    return sorted(list_safetensors(uri))


def pull_configs(uri: str, dest: str) -> None:
    """The JSON files (``config.json``, the index) and configuration code under ``uri``,
    copied into ``dest`` as vLLM copies them before it loads such a checkpoint."""
    from runai_model_streamer import pull_files

    pull_files(uri.rstrip("/") + "/", dest, allow_pattern=["*.json", "*.py"])
