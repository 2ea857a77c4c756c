"""Shards in object storage (``s3://``, ``gs://``, ``az://``): their headers, and the version
of each object that the draft's every read is held to.

Each store is read by the layer's own client, the one the Run:ai Model Streamer's package for
that store brings and builds its own with (the same endpoint, credentials and addressing):
boto3 for ``s3://`` (:class:`_S3`), google-cloud-storage for ``gs://`` (:class:`_GCS`),
azure-storage-blob for ``az://`` (:class:`_Azure`). A shard's header is read with ranged
requests, its 8-byte length and then its header, every request after the first pinned to the
version the first found: S3's ``If-Match`` its ETag (and the version id in a versioned
bucket), GCS's ``generation``, Azure's ``If-Match`` its ETag. The shard keeps that version
(``checkpoint.ObjectVersion``), and the draft's reads are held to it (:func:`verify`): before
and after the Run:ai Model Streamer reads the draft's tensors, and once the target's stream
has filled a one-pass hold (:func:`changed`). An object replaced, rewritten or truncated
since is refused (``shardread.ShardChanged``, naming both versions): never read at another
version's offsets, never mixed with another version.

Every request of the layer's own has a timeout and is retried, a bounded number of times, on
a transient fault (throttling, a 5xx, a connection reset or timeout): :class:`Access`, from
the settings; the retries are counted in the load's figures (``figures.retried``). A request
the object store refuses, or one still failing after its retries, is an
:class:`ObjectStoreError` naming the address and the store's answer (HTTP status and the
store's error code). The Run:ai Model Streamer's own client is given the same bounds for the
draft's stream where it reads them (:func:`runai_limits`); when its read fails, the layer
asks the store itself why (:func:`explain`, and :func:`failed_read` for a target's load).
No vLLM import.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from hybrid_draft import files, records, settings
from hybrid_draft.core import checkpoint, figures
from hybrid_draft.core.shardread import ShardChanged

#: Header reads in flight at once (each store's client is thread-safe).
READERS = 16
#: The Run:ai Model Streamer's settings of its S3 client, read as a stream opens it (its
#: GCS client reads the timeout too).
RUNAI_MAX_RETRIES = "RUNAI_STREAMER_S3_MAX_RETRIES"
RUNAI_REQUEST_TIMEOUT_MS = "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS"
#: The seconds the layer's own clients wait before their first retry (then twice as long
#: each time, at most 20 s), where the client's own backoff would wait far longer.
BACKOFF_S = 0.5


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
    store's answer (HTTP status and the store's error code, no answer in time, no
    connection). ``answered``: whether the store answered (a status, or an object found
    wrong), as against no answer in time or no connection, which a busy store gives too."""

    def __init__(self, message: str, *, answered: bool = True) -> None:
        super().__init__(message)
        self.answered = answered


def is_s3(uri: str) -> bool:
    return uri.lower().startswith("s3://")


def _address(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.partition("://")[2].partition("/")
    return bucket, key


def _times(n: int) -> str:
    return f"{n} time" if n == 1 else f"{n} times"


class _Failure(Exception):
    """A request of a store's client that failed, as the layer tells it: the store's
    answer in words, its status and code, how often it was retried, and whether the object
    changed under a pinned request or an answer was cut (both: read the header again)."""

    def __init__(
        self,
        answer: str,
        *,
        status: int | None = None,
        code: str | None = None,
        retried: int = 0,
        changed: bool = False,
        cut: bool = False,
    ) -> None:
        super().__init__(answer)
        self.answer, self.status, self.code = answer, status, code
        self.retried, self.changed, self.cut = retried, changed, cut

    @property
    def answered(self) -> bool:
        """Whether the store answered (with a status), as against no answer in time or no
        connection."""
        return self.status is not None


def _refusal(status: int | None, code: str | None, retried: int, changed: bool = False) -> _Failure:
    """A request the store answered with an error: its status and code; ``changed`` where
    it was held to a version the object no longer is."""
    return _Failure(
        _answered(status, code), status=status, code=code, retried=retried, changed=changed
    )


def _cut(detail: object) -> _Failure:
    """An answer whose body ended early: the header is read again."""
    text = files.error_line(detail) if isinstance(detail, BaseException) else str(detail)
    return _Failure(f"an answer was cut ({text})", cut=True)


def _answered(status: int | None, code: str | None) -> str:
    shown = f"{status or '?'} {code}" if code and code != str(status) else f"{status}"
    return f"the object store answered {shown}"


def _no_answer(access: Access) -> str:
    return (
        f"no answer from the object store within {access.timeout:g} s "
        f"({settings.ENV_OBJECT_TIMEOUT})"
    )


def _no_connection(exc: BaseException) -> str:
    return f"no connection to the object store ({files.one_line(str(exc), 300)})"


class _ShortBody(Exception):
    """An answer's body ended before its length: the connection was cut."""


class _Store:
    """One store's client, each request bounded by ``access`` (``attempts`` in all), its
    retries counted (from any thread). Every method raises :class:`_Failure`."""

    def __init__(self, access: Access, attempts: int | None = None) -> None:
        self.access = access
        self.attempts = attempts or access.retries + 1
        self.retries = 0
        self._lock = threading.Lock()

    def count(self, n: int) -> None:
        with self._lock:
            self.retries += n

    def _failure(self, exc: BaseException, retried: int, pinned: bool = False) -> _Failure:
        """``exc``, a failure of the client's, as the layer tells it."""
        raise NotImplementedError

    def _attempt(self, call: Callable[[], Any], retried: list[int], pinned: bool) -> Any:
        """``call``'s result; its failure as a :class:`_Failure` (``retried[0]``: how often
        the client retried it, counted either way)."""
        try:
            return call()
        except Exception as exc:
            raise self._failure(exc, retried[0], pinned) from exc
        finally:
            self.count(retried[0])

    def stat(self, uri: str) -> checkpoint.ObjectVersion:
        """The object's version now (its metadata alone)."""
        raise NotImplementedError

    def read(
        self, uri: str, start: int, size: int, pin: checkpoint.ObjectVersion | None
    ) -> tuple[bytes, checkpoint.ObjectVersion]:
        """``size`` bytes from ``start``, held to ``pin`` (``_Failure.changed`` when the
        object is no longer that version), and the version they are of."""
        raise NotImplementedError

    def probe(self, uri: str) -> checkpoint.ObjectVersion:
        """The object's version, from a read of its first byte: the request a stream
        makes, whose refusal carries the store's error code."""
        return self.read(uri, 0, 1, None)[1]


# --- s3:// -----------------------------------------------------------------------------------

#: The proxy settings every store's client follows.
_PROXY_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
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
    *_PROXY_ENV,
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


class _S3(_Store):
    """``s3://`` through boto3: a HEAD for the version (a refused HEAD, which carries no
    error code, asked again as a GET of the first byte, once), ranged GETs for the bytes."""

    def __init__(self, access: Access, attempts: int | None = None) -> None:
        super().__init__(access, attempts)
        self.client = client(access, self.attempts)

    def _call(self, operation: str, uri: str, **kwargs: Any) -> dict[str, Any]:
        bucket, key = _address(uri)
        try:
            response: dict[str, Any] = getattr(self.client, operation)(
                Bucket=bucket, Key=key, **kwargs
            )
        except Exception as exc:
            failure = self._told(exc)
            self.count(failure.retried)
            raise failure from exc
        self.count(int(response.get("ResponseMetadata", {}).get("RetryAttempts", 0)))
        return response

    def _told(self, exc: BaseException) -> _Failure:
        """``exc``, a failure of botocore's, as the layer tells it."""
        from botocore.exceptions import (
            ClientError,
            ConnectTimeoutError,
            EndpointConnectionError,
            HTTPClientError,
            NoCredentialsError,
            ReadTimeoutError,
        )
        from botocore.exceptions import ConnectionError as BotoConnectionError

        retried = 0
        if isinstance(exc, ClientError):
            retried = int(exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0))
            raw = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code")
            return _refusal(int(raw) if raw else None, str(code) if code else None, retried)
        if isinstance(exc, (BotoConnectionError, HTTPClientError)):
            retried = self.attempts - 1  # connection errors and timeouts: to the last attempt
        if isinstance(exc, (ReadTimeoutError, ConnectTimeoutError)):
            return _Failure(_no_answer(self.access), retried=retried)
        if isinstance(exc, EndpointConnectionError):
            return _Failure(_no_connection(exc), retried=retried)
        if isinstance(exc, NoCredentialsError):
            return _Failure(
                "no credentials for the object store (AWS_ACCESS_KEY_ID, a profile, a role...)"
            )
        return _Failure(f"the request failed: {files.error_line(exc)}", retried=retried)

    def stat(self, uri: str) -> checkpoint.ObjectVersion:
        try:
            return _s3_version(self._call("head_object", uri))
        except _Failure as failure:
            if failure.status is None:
                raise
        return _S3(self.access, attempts=1).probe(uri)

    def read(
        self, uri: str, start: int, size: int, pin: checkpoint.ObjectVersion | None
    ) -> tuple[bytes, checkpoint.ObjectVersion]:
        kwargs: dict[str, str] = {"Range": f"bytes={start}-{start + size - 1}"}
        if pin is not None:
            if pin.etag:
                kwargs["IfMatch"] = pin.etag
            if pin.version_id:
                kwargs["VersionId"] = pin.version_id
        try:
            response = self._call("get_object", uri, **kwargs)
        except _Failure as failure:
            failure.changed = pin is not None and failure.status == 412
            raise
        try:
            return _s3_body(response, size), _s3_version(response)
        except Exception as exc:
            if _s3_transient_body(exc):
                raise _cut(exc) from exc
            raise self._told(exc) from exc


def _s3_transient_body(exc: BaseException) -> bool:
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


def _total(content_range: str | None, length: int) -> int:
    """An object's whole size: a ranged answer's ``Content-Range`` total, else ``length``."""
    total = str(content_range or "").rpartition("/")[2]
    return int(total) if total.isdigit() else length


def _s3_version(response: dict[str, Any]) -> checkpoint.ObjectVersion:
    """The version a GET or HEAD answer is of: its ETag, version id, and the object's whole
    size."""
    return checkpoint.ObjectVersion(
        etag=response.get("ETag") or None,
        version_id=response.get("VersionId") or None,
        size=_total(response.get("ContentRange"), int(response.get("ContentLength", 0))),
    )


def _s3_body(response: dict[str, Any], size: int) -> bytes:
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


# --- gs:// -----------------------------------------------------------------------------------

#: The environment a GCS client is built from (reused while none of these changes).
_GCS_ENV = (
    "STORAGE_EMULATOR_HOST",
    "CLOUD_STORAGE_EMULATOR_ENDPOINT",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_CLOUD_PROJECT",
    "RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS",
    "RUNAI_STREAMER_GCS_CREDENTIAL_FILE",
    *_PROXY_ENV,
)


@functools.lru_cache(maxsize=4)
def _gcs_client(env: tuple[str | None, ...]) -> Any:
    """A GCS client with the credentials the Run:ai Model Streamer's GCS package uses
    (anonymous where ``RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS``, the key file of
    ``RUNAI_STREAMER_GCS_CREDENTIAL_FILE``, else the default ones), at the endpoint its
    streamer reads (``CLOUD_STORAGE_EMULATOR_ENDPOINT`` where ``STORAGE_EMULATOR_HOST``,
    which google-cloud-storage reads itself, is not set)."""
    import google.auth
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    anonymous = os.environ.get("RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS", "")
    key_file = os.environ.get("RUNAI_STREAMER_GCS_CREDENTIAL_FILE")
    project = os.environ.get("GOOGLE_CLOUD_PROJECT")
    if anonymous.lower() in ("true", "1"):
        credentials: Any = AnonymousCredentials()  # type: ignore[no-untyped-call]
        project = project or "anonymous"
    elif key_file:
        credentials, found = google.auth.load_credentials_from_file(key_file)  # type: ignore[no-untyped-call]
        project = project or found
    else:
        credentials, found = google.auth.default()
        project = project or found
    options = None
    emulator = os.environ.get("CLOUD_STORAGE_EMULATOR_ENDPOINT")
    if emulator and not os.environ.get("STORAGE_EMULATOR_HOST"):
        options = {"api_endpoint": emulator}
    return storage.Client(project=project, credentials=credentials, client_options=options)


class _GCS(_Store):
    """``gs://`` through google-cloud-storage: the object's metadata for its version (its
    generation and size), ranged reads of that generation (``generation=``: a replaced
    object's old generation is gone, 404, or refused, 412)."""

    def __init__(self, access: Access, attempts: int | None = None) -> None:
        super().__init__(access, attempts)
        try:
            self.client = _gcs_client(tuple(os.environ.get(n) for n in _GCS_ENV))
        except Exception as exc:
            raise self._failure(exc, 0) from exc

    def _retry(self, retried: list[int]) -> Any:
        """google-api-core's retry of the client's own transient faults, ``attempts`` in all:
        each retry counted into ``retried``, the last fault raised once they are spent."""
        from google.api_core.retry import Retry
        from google.cloud.storage.retry import _should_retry

        def on_error(exc: Exception) -> None:
            if retried[0] + 1 >= self.attempts:
                raise exc
            retried[0] += 1

        return Retry(
            predicate=_should_retry,
            initial=BACKOFF_S,
            maximum=20.0,
            multiplier=2.0,
            timeout=None,
            on_error=on_error,
        )

    def _run(self, operation: Callable[[Any], Any], pinned: bool = False) -> Any:
        retried = [0]
        return self._attempt(lambda: operation(self._retry(retried)), retried, pinned)

    def _failure(self, exc: BaseException, retried: int, pinned: bool = False) -> _Failure:
        import requests
        from google.api_core import exceptions as api
        from google.auth import exceptions as auth

        if isinstance(exc, api.GoogleAPICallError) and exc.code is not None:
            status = int(exc.code)
            return _refusal(status, _gcs_reason(exc), retried, pinned and status in (404, 412))
        if isinstance(exc, requests.Timeout):
            return _Failure(_no_answer(self.access), retried=retried)
        if isinstance(exc, requests.exceptions.ChunkedEncodingError):
            return _cut(exc)
        if isinstance(exc, requests.ConnectionError):
            return _Failure(_no_connection(exc), retried=retried)
        if isinstance(exc, auth.DefaultCredentialsError):
            return _Failure(
                "no credentials for the object store (GOOGLE_APPLICATION_CREDENTIALS, "
                "RUNAI_STREAMER_GCS_CREDENTIAL_FILE, RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS)"
            )
        return _Failure(f"the request failed: {files.error_line(exc)}", retried=retried)

    def _blob(self, uri: str, generation: str | None = None) -> Any:
        """The object, at ``generation`` where given."""
        bucket, key = _address(uri)
        return self.client.bucket(bucket).blob(
            key, generation=int(generation) if generation else None
        )

    def stat(self, uri: str) -> checkpoint.ObjectVersion:
        blob = self._blob(uri)
        timeout = (self.access.timeout, self.access.timeout)
        self._run(lambda retry: blob.reload(timeout=timeout, retry=retry))
        return checkpoint.ObjectVersion(
            etag=None, version_id=None, size=int(blob.size or 0), generation=str(blob.generation)
        )

    def read(
        self, uri: str, start: int, size: int, pin: checkpoint.ObjectVersion | None
    ) -> tuple[bytes, checkpoint.ObjectVersion]:
        version = pin if pin is not None else self.stat(uri)
        blob = self._blob(uri, version.generation)
        timeout = (self.access.timeout, self.access.timeout)
        try:
            data: bytes = self._run(
                lambda retry: blob.download_as_bytes(
                    start=start,
                    end=start + size - 1,
                    raw_download=True,
                    timeout=timeout,
                    retry=retry,
                ),
                pinned=True,
            )
        except _Failure as failure:
            # A generation that is gone is a changed object; one that is still the object's
            # own, refused all the same, is the store's answer.
            if failure.changed and failure.status == 404 and self.stat(uri) == version:
                failure.changed = False
            raise
        if len(data) < min(size, version.size - start):
            raise _cut(f"{len(data):,} of {size:,} bytes")
        return data[:size], version

    def probe(self, uri: str) -> checkpoint.ObjectVersion:
        blob = self._blob(uri)
        timeout = (self.access.timeout, self.access.timeout)
        self._run(
            lambda retry: blob.download_as_bytes(
                start=0, end=0, raw_download=True, timeout=timeout, retry=retry
            )
        )
        return self.stat(uri)


def _gcs_reason(exc: Any) -> str | None:
    """The reason code of a refused GCS request (``notFound``, ``rateLimitExceeded``...),
    from the exception's errors or the answer's JSON error document (a download's)."""
    reasons = [e.get("reason") for e in exc.errors or [] if isinstance(e, dict)]
    if not any(reasons):
        with contextlib.suppress(Exception):
            reasons = [e.get("reason") for e in exc.response.json()["error"]["errors"]]
    return next((str(r) for r in reasons if r), None)


# --- az:// -----------------------------------------------------------------------------------

#: The environment an Azure client is built from (reused while none of these changes).
_AZURE_ENV = (
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_ENDPOINT_SUFFIX",
    "AZURE_CLIENT_ID",
    "AZURE_TENANT_ID",
    "AZURE_CLIENT_SECRET",
    *_PROXY_ENV,
)


@functools.lru_cache(maxsize=4)
def _azure_client(timeout: float, retries: int, env: tuple[str | None, ...]) -> Any:
    """An Azure blob service client with the credentials the Run:ai Model Streamer's Azure
    package uses (``AZURE_STORAGE_CONNECTION_STRING``, else ``AZURE_STORAGE_ACCOUNT_NAME``
    with ``AZURE_STORAGE_SAS_TOKEN``, ``AZURE_STORAGE_ACCOUNT_KEY`` or Azure's default
    credential, at ``https://ACCOUNT.AZURE_STORAGE_ENDPOINT_SUFFIX``), each request cut after
    ``timeout`` seconds and retried ``retries`` times, waiting :data:`BACKOFF_S` first."""
    from azure.storage.blob import BlobServiceClient, ExponentialRetry

    bounds: dict[str, Any] = {
        "connection_timeout": timeout,
        "read_timeout": timeout,
        "retry_policy": ExponentialRetry(
            initial_backoff=BACKOFF_S,  # type: ignore[arg-type]
            increment_base=2,
            retry_total=retries,
            random_jitter_range=0,
        ),
        "max_single_get_size": 64 << 20,
    }
    connection = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if connection:
        return BlobServiceClient.from_connection_string(connection, **bounds)
    account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    if not account:
        raise ValueError(
            "no Azure storage account: set AZURE_STORAGE_ACCOUNT_NAME (or "
            "AZURE_STORAGE_CONNECTION_STRING)"
        )
    suffix = os.environ.get("AZURE_STORAGE_ENDPOINT_SUFFIX") or "blob.core.windows.net"
    credential: Any = (os.environ.get("AZURE_STORAGE_SAS_TOKEN") or "").lstrip("?") or (
        os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
    )
    if not credential:
        from azure.identity import DefaultAzureCredential

        credential = DefaultAzureCredential()
    return BlobServiceClient(f"https://{account}.{suffix}", credential=credential, **bounds)


class _Azure(_Store):
    """``az://CONTAINER/BLOB`` through azure-storage-blob: Get Blob Properties for the
    version (its ETag and size: a refused one carries the store's code in a header),
    ranged downloads held to that ETag (``If-Match``: 412 once it changed)."""

    def __init__(self, access: Access, attempts: int | None = None) -> None:
        super().__init__(access, attempts)
        env = tuple(os.environ.get(n) for n in _AZURE_ENV)
        try:
            self.client = _azure_client(access.timeout, self.attempts - 1, env)
        except Exception as exc:
            raise self._failure(exc, 0) from exc

    def _run(self, operation: Callable[[Callable[..., None]], Any], pinned: bool = False) -> Any:
        retried = [0]

        def hook(**_kwargs: Any) -> None:
            retried[0] += 1

        return self._attempt(lambda: operation(hook), retried, pinned)

    def _failure(self, exc: BaseException, retried: int, pinned: bool = False) -> _Failure:
        from azure.core import exceptions as az

        if isinstance(exc, az.HttpResponseError) and exc.status_code is not None:
            status = int(exc.status_code)
            raw = getattr(exc, "error_code", None)
            code = str(getattr(raw, "value", raw)) if raw else None
            return _refusal(status, code, retried, pinned and status == 412)
        if isinstance(exc, (az.ServiceRequestTimeoutError, az.ServiceResponseTimeoutError)):
            return _Failure(_no_answer(self.access), retried=retried)
        if isinstance(exc, (az.IncompleteReadError, az.ServiceResponseError)):
            return _cut(exc)
        if isinstance(exc, az.ServiceRequestError):
            return _Failure(_no_connection(exc), retried=retried)
        if isinstance(exc, az.ClientAuthenticationError):
            return _Failure(f"no credentials for the object store ({files.error_line(exc)})")
        return _Failure(f"the request failed: {files.error_line(exc)}", retried=retried)

    def _blob(self, uri: str) -> Any:
        container, blob = _address(uri)
        return self.client.get_blob_client(container, blob)

    def stat(self, uri: str) -> checkpoint.ObjectVersion:
        blob = self._blob(uri)
        props = self._run(lambda hook: blob.get_blob_properties(retry_hook=hook))
        return checkpoint.ObjectVersion(
            etag=props.etag or None, version_id=props.version_id or None, size=int(props.size)
        )

    def read(
        self, uri: str, start: int, size: int, pin: checkpoint.ObjectVersion | None
    ) -> tuple[bytes, checkpoint.ObjectVersion]:
        from azure.core import MatchConditions

        blob = self._blob(uri)
        held: dict[str, Any] = {}
        if pin is not None and pin.etag:
            held = {"etag": pin.etag, "match_condition": MatchConditions.IfNotModified}

        def download(hook: Callable[..., None]) -> tuple[bytes, Any]:
            answer = blob.download_blob(
                offset=start, length=size, max_concurrency=1, retry_hook=hook, **held
            )
            return answer.readall(), answer.properties

        data, props = self._run(download, pinned=pin is not None)
        version = checkpoint.ObjectVersion(
            etag=props.etag or None,
            version_id=props.version_id or None,
            size=_total(props.content_range, int(props.size)),
        )
        if len(data) < min(size, version.size - start):
            raise _cut(f"{len(data):,} of {size:,} bytes")
        return data, version


_STORES: dict[str, type[_Store]] = {"s3": _S3, "gs": _GCS, "az": _Azure}


def is_pinned(uri: str) -> bool:
    """Whether the layer reads ``uri`` with a client of its own, holding it to a version."""
    return uri.partition("://")[0].lower() in _STORES and "://" in uri


def _store(uri: str, access: Access, attempts: int | None = None) -> _Store:
    return _STORES[uri.partition("://")[0].lower()](access, attempts)


class _Stores:
    """The clients of one batch of requests, one per scheme, their retries counted into the
    current load's figures once done."""

    def __init__(self, access: Access, attempts: int | None = None) -> None:
        self.access, self.attempts = access, attempts
        self._made: dict[str, _Store] = {}
        self._lock = threading.Lock()

    def __call__(self, uri: str) -> _Store:
        scheme = uri.partition("://")[0].lower()
        with self._lock:
            if scheme not in self._made:
                self._made[scheme] = _store(uri, self.access, self.attempts)
            return self._made[scheme]

    @property
    def retries(self) -> int:
        return sum(s.retries for s in self._made.values())


@contextlib.contextmanager
def _counted(stores: _Stores) -> Iterator[_Stores]:
    """``stores``, their retries added to the current load's figures once done."""
    try:
        yield stores
    finally:
        figures.retried(stores.retries)


def _client_of(stores: _Stores, uri: str, doing: str) -> _Store:
    """The store's client for ``uri``; a client that cannot be built is the object's error."""
    try:
        return stores(uri)
    except _Failure as failure:
        raise _refused(uri, doing, failure) from None


def _refused(uri: str, doing: str, failure: _Failure) -> ObjectStoreError:
    """The one line for a request that failed: the object, what was being done, the store's
    answer, and how often the request was retried."""
    return ObjectStoreError(
        f"{files.show_path(uri)}: {doing}: {failure.answer}"
        + (f", retried {_times(failure.retried)}" if failure.retried else ""),
        answered=failure.answered,
    )


class _Again(Exception):
    """A header read to start over: the object was replaced between its requests (one
    pinned to the first's version was refused), or an answer's body was cut."""


def _read_object(uri: str, stores: _Stores) -> checkpoint.Shard:
    """One object shard from its header, and the version it was read from; read again
    (``access.retries`` times at most, each counted) when it changed or was cut between
    its requests."""
    retries = stores.access.retries
    for attempt in range(retries + 1):
        try:
            return _read_header(uri, stores)
        except _Again as again:
            if attempt == retries:
                raise ObjectStoreError(
                    f"{files.show_path(uri)}: reading its header for the draft's plan: "
                    f"{again} ({_times(attempt + 1)} in a row)"
                ) from None
            stores(uri).count(1)
    raise AssertionError("unreachable")


def _read_header(uri: str, stores: _Stores) -> checkpoint.Shard:
    shown = files.show_path(uri)
    doing = "reading its header for the draft's plan"
    store = _client_of(stores, uri, doing)

    def get(start: int, size: int, pin: checkpoint.ObjectVersion | None) -> Any:
        try:
            return store.read(uri, start, size, pin)
        except _Failure as failure:
            if failure.changed:
                raise _Again("the object changed between the requests") from None
            if failure.cut:
                raise _Again(failure.answer) from None
            raise _refused(uri, doing, failure) from None

    raw, version = get(0, 8, None)
    length = checkpoint.header_length(shown, raw)
    header = b""
    if length:  # an empty header is asked for no range: object_shard refuses it
        header, _ = get(8, length, version)
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
    :class:`ObjectStoreError` for one that cannot be read. Each keeps the version its
    header was read from."""
    if not uris:
        return []
    unknown = [uri for uri in uris if not is_pinned(uri)]
    if unknown:
        raise ObjectStoreError(
            f"{files.show_path(unknown[0])}: not an object-storage address the layer reads "
            "(s3://, gs://, az://)"
        )
    with _counted(_Stores(access or Access())) as stores:
        if len(uris) == 1:
            return [_read_object(uris[0], stores)]
        pool = ThreadPoolExecutor(max_workers=min(READERS, len(uris)))
        try:
            futures = [pool.submit(_read_object, uri, stores) for uri in uris]
            for done in as_completed(futures):
                done.result()  # the first failure ends the plan: the rest are not sent
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _gone(uri: str, failure: _Failure, planned: checkpoint.ObjectVersion | None) -> str | None:
    if failure.status != 404:
        return None
    was = f" ({planned})" if planned is not None else ""
    code = f"{failure.status} {failure.code}" if failure.code else f"{failure.status}"
    return (
        f"{files.show_path(uri)}: the object is gone ({code}); it was there{was} "
        "when the draft's load was planned"
    )


def _pinned(shards: Iterable[checkpoint.Shard]) -> list[checkpoint.Shard]:
    """The shards held to a version: objects whose header read gave one."""
    return [s for s in shards if s.uri is not None and s.version is not None and is_pinned(s.uri)]


def _same(planned: checkpoint.ObjectVersion, found: checkpoint.ObjectVersion) -> bool:
    return (
        found.size == planned.size
        and (planned.etag is None or found.etag == planned.etag)
        and (planned.version_id is None or found.version_id == planned.version_id)
        and (planned.generation is None or found.generation == planned.generation)
    )


def verify(shards: Iterable[checkpoint.Shard], access: Access, when: str) -> None:
    """Each object shard is still the version its header was read from; else
    ``ShardChanged`` naming the object and both versions (``when`` says at which point of the
    load), or :class:`ObjectStoreError` where the store will not say."""
    pinned = _pinned(shards)
    if not pinned:
        return
    doing = f"checking its version {when}"
    with _counted(_Stores(access)) as stores:
        for shard in pinned:
            assert shard.uri is not None and shard.version is not None
            try:
                found = _client_of(stores, shard.uri, doing).stat(shard.uri)
            except _Failure as failure:
                gone = _gone(shard.uri, failure, shard.version)
                if gone is not None:
                    raise ShardChanged(gone) from None
                raise _refused(shard.uri, doing, failure) from None
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


def _ask(uri: str, access: Access) -> tuple[checkpoint.ObjectVersion | None, _Failure | None]:
    """The layer's own question about ``uri`` after a stream's read failed: a read of its
    first byte, one attempt; the version it found, or the store's refusal."""
    try:
        return _store(uri, access, attempts=1).probe(uri), None
    except _Failure as failure:
        return None, failure
    except Exception as exc:  # a client that cannot be built, or a fault of its own
        return None, _Failure(f"the request failed: {files.error_line(exc)}")


def explain(
    shards: Iterable[checkpoint.Shard], access: Access, failure: BaseException
) -> checkpoint.CheckpointError | None:
    """Why the Run:ai Model Streamer's read of ``shards`` failed (``failure``: its error,
    which names neither object nor answer), by the layer's own question to the object store:
    a read of each object's first byte, one attempt each. ``ShardChanged`` for an object
    that changed, :class:`ObjectStoreError` with the store's answer for one it refuses;
    None where there is no object to ask about."""
    objects = [s for s in shards if s.uri is not None and is_pinned(s.uri)]
    if not objects:
        return None
    why = runai_reason(failure)
    for shard in objects:
        assert shard.uri is not None
        found, refused = _ask(shard.uri, access)
        if refused is not None:
            gone = _gone(shard.uri, refused, shard.version)
            if gone is not None:
                return ShardChanged(gone)
            return ObjectStoreError(
                f"{files.show_path(shard.uri)}: the Run:ai Model Streamer could not read the "
                f"draft's tensors ({why}); asked again, {refused.answer}"
            )
        if found is not None and shard.version is not None and not _same(shard.version, found):
            return ShardChanged(_changed(shard, found, "while the draft's tensors were read"))
    shown = ", ".join(files.show_path(s.uri or s.location) for s in objects)
    return ObjectStoreError(
        f"{shown}: the Run:ai Model Streamer could not read the draft's tensors ({why}) "
        f"within its {access.retries} retries of each request; asked again, the object store "
        "answers, and the object is unchanged"
    )


def failed_read(paths: Sequence[str], access: Access) -> records.FailedRead | None:
    """After a load of ``paths`` (the shards it opened) failed in its own loader's words:
    the first of them that cannot be read whole, and why. An object is asked about as
    :func:`explain` asks (one read of its first byte: the store's answer, its status and
    code), then its header is read again, one attempt, and its size checked against it (a
    truncated object); a local file's header is read again and checked the same way. An
    answer (a refusal, a truncated shard) is preferred to no answer in time or no
    connection, which a store under load gives for a shard that is whole. None where every
    one answers well, or there is none."""
    if not paths:
        return None
    once = Access(access.timeout, retries=0)
    pool = ThreadPoolExecutor(max_workers=min(READERS, len(paths)))
    try:
        found = list(pool.map(lambda p: _whole(p, once), paths))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    answered = [read for read, sure in found if read is not None and sure]
    unanswered = [read for read, sure in found if read is not None and not sure]
    return next(iter(answered or unanswered), None)


def _whole(path: str, access: Access) -> tuple[records.FailedRead | None, bool]:
    """Why ``path`` (an object or a local file) is not a whole shard (None: it is), and
    whether that is an answer (False: no answer in time, or no connection)."""
    shown = files.show_path(path)
    if figures.is_object_uri(path):
        if not is_pinned(path):
            return None, True
        _found, refused = _ask(path, access)
        if refused is not None:
            read = records.FailedRead(
                address=shown, answer=refused.answer, status=refused.status, code=refused.code
            )
            return read, refused.answered
    try:
        if figures.is_object_uri(path):
            _read_header(path, _Stores(access))
        else:
            checkpoint.read_shard(path)
    except (checkpoint.CheckpointError, _Again) as exc:
        answered = not isinstance(exc, ObjectStoreError) or exc.answered
        return records.FailedRead(address=shown, answer=str(exc)), answered
    except OSError as exc:
        return records.FailedRead(address=shown, answer=f"{shown}: {exc.strerror or exc}"), True
    return None, True


def runai_reason(failure: BaseException) -> str:
    """Run:ai's own words in its error (``... due to: b'File access error'``)."""
    text = str(failure)
    found = re.search(r"due to: b?'([^']*)'", text)
    return found.group(1) if found else files.one_line(text, 200)


@contextlib.contextmanager
def runai_limits(access: Access) -> Iterator[None]:
    """The Run:ai Model Streamer's S3 client bounded by ``access`` while it is open: each
    request retried ``retries`` times (``RUNAI_STREAMER_S3_MAX_RETRIES``) and cut once it
    receives less than a byte a second for ``timeout`` seconds
    (``RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS``, which its GCS client reads too, in whole
    seconds). Run:ai reads them as a stream opens its client (in its own threads), so they
    stay set for the stream's life; one already set in the environment (the user's own) is
    left as it is."""
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
