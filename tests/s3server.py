"""A real S3-compatible server on loopback that counts the bytes it serves.

Tests that stream from S3 (Run:ai Model Streamer's C++ client, boto3) need a server that speaks
real HTTP, so the client under test runs unchanged, and a record of what it pulled: which
object, which byte range, how many body bytes. ``S3Server`` runs moto's S3 backend in a
subprocess (this file, run as a script) behind a WSGI middleware that appends one JSON line per
request to a log file, flushed as it happens, which the test process reads back.

    with S3Server() as s3:
        uri = s3.upload_dir(checkpoint_dir, "models", "draft")
        subprocess.run([...], env=s3.client_env(), check=True)
        assert s3.bytes_by_key()["draft/model.safetensors"] == expected

A second middleware injects one fault at a time into the requests it matches (:class:`Fault`:
a 503 SlowDown for K requests, a connection closed mid-body, an object replaced or truncated
after N requests, a 403 or 404, a delay or a stall), armed from the test process
(``S3Server.arm``) through a control path no S3 client uses (``/_faults``):

    s3.arm(Fault.status(key, 503, "SlowDown", times=2))
    ...  # a load; the two first GETs of ``key`` are answered 503, the third by moto
    assert s3.fault_state()["applied"] == 2

Path-style addressing only (``http://127.0.0.1:PORT/bucket/key``): a virtual host like
``bucket.127.0.0.1`` does not resolve, hence ``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0``
in ``env``.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from http import HTTPStatus
from pathlib import Path
from types import TracebackType
from typing import Any

HOST = "127.0.0.1"
ACCESS_KEY_ID = "testing"
SECRET_ACCESS_KEY = "testing"
REGION = "us-east-1"
START_TIMEOUT_S = 30.0
SETTLE_TIMEOUT_S = 10.0
#: Where the server writes its threads' stacks on SIGUSR1, in its folder.
STACKS = "stacks.txt"
_PIECE = 64 * 1024

# What a client process must not inherit: each would steer it away from this server (another
# endpoint, profile or credentials) or through a proxy.
_CLIENT_ENV_DROP = (
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_USE_DUALSTACK_ENDPOINT",
    "AWS_USE_FIPS_ENDPOINT",
    "RUNAI_STREAMER_S3_UNSIGNED",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
)


@dataclass(frozen=True)
class Served:
    """One request the server answered, as the middleware saw it.

    ``sent`` is the number of body bytes written to the client's socket (0 for HEAD; equal to
    ``content_length`` for a whole answer); ``complete`` is False when the client went away
    before the body was all written (then ``sent`` is exact to within 64 KiB).
    """

    seq: int
    method: str
    bucket: str
    key: str
    query: str
    range: str | None
    status: int
    sent: int
    content_length: int | None
    complete: bool
    started: float
    ended: float
    #: The kind of the fault injected into this request (None: moto answered it as it is).
    fault: str | None = None

    @property
    def is_object_get(self) -> bool:
        """A GET of an object (not a listing, not a HEAD), whatever its status."""
        return self.method == "GET" and bool(self.key)

    @property
    def ok(self) -> bool:
        """A 2xx answer: its body is the object's bytes, not an error document."""
        return 200 <= self.status < 300

    @property
    def span(self) -> tuple[int, int] | None:
        """The requested ``(first, last)`` byte, inclusive, of a ``bytes=a-b`` Range."""
        if not self.range or not self.range.startswith("bytes="):
            return None
        first, _, last = self.range[len("bytes=") :].partition("-")
        if not first or not last or "," in last:
            return None
        return int(first), int(last)


#: The control path of the fault middleware (no bucket name starts with ``_``).
FAULTS_PATH = "/_faults"


@dataclass(frozen=True)
class Fault:
    """One fault, injected into the requests it matches: ``method`` in ``methods``, object
    ``key`` (exactly; ``""``: any object) in ``bucket`` (None: any).

    Matching requests are counted from 1 as they arrive. The fault lets the first ``after``
    through, then applies to the next ``times`` (None: every one after), by ``kind``:

    - ``status``: answered ``status`` with an S3 error document of ``code`` (no body for HEAD);
    - ``reset``: moto's answer, its connection shut down after ``sent`` body bytes;
    - ``replace``: before the first request it applies to is answered, the object's bytes
      become those of the local file ``body`` (a PUT through moto: a new ETag), once;
    - ``delay``: answered by moto after ``seconds``;
    - ``stall``: moto's headers and ``sent`` body bytes, then nothing for ``seconds``, then the
      connection is shut down.

    ``disarm`` (or arming another) ends a delay or a stall at once.
    """

    kind: str
    key: str
    bucket: str | None = None
    methods: tuple[str, ...] = ("GET",)
    after: int = 0
    times: int | None = None
    status: int = 503
    code: str = "SlowDown"
    seconds: float = 0.0
    body: str | None = None
    sent: int = 0

    KINDS = ("status", "reset", "replace", "delay", "stall")

    @classmethod
    def error(cls, key: str, status: int, code: str, **kw: Any) -> Fault:
        return cls("status", key, status=status, code=code, **kw)

    @classmethod
    def throttle(cls, key: str, times: int | None, **kw: Any) -> Fault:
        """503 SlowDown, as S3 throttles."""
        return cls("status", key, status=503, code="SlowDown", times=times, **kw)

    @classmethod
    def deny(cls, key: str, **kw: Any) -> Fault:
        """403 AccessDenied, on every request it matches unless ``times`` says otherwise."""
        return cls("status", key, status=403, code="AccessDenied", **kw)

    @classmethod
    def missing(cls, key: str, **kw: Any) -> Fault:
        """404 NoSuchKey."""
        return cls("status", key, status=404, code="NoSuchKey", **kw)

    @classmethod
    def reset(cls, key: str, sent: int = 0, times: int | None = 1, **kw: Any) -> Fault:
        return cls("reset", key, sent=sent, times=times, **kw)

    @classmethod
    def replace_with(cls, key: str, body: Path | str, after: int = 0, **kw: Any) -> Fault:
        return cls("replace", key, body=str(body), after=after, times=1, **kw)

    @classmethod
    def delay(cls, key: str, seconds: float, times: int | None = None, **kw: Any) -> Fault:
        return cls("delay", key, seconds=seconds, times=times, **kw)

    @classmethod
    def stall(cls, key: str, seconds: float, sent: int = 0, **kw: Any) -> Fault:
        return cls("stall", key, seconds=seconds, sent=sent, times=None, **kw)

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["methods"] = list(self.methods)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fault:
        fault = cls(**{**data, "methods": tuple(data.get("methods", ("GET",)))})
        if fault.kind not in cls.KINDS:
            raise ValueError(f"unknown fault kind {fault.kind!r}; one of {', '.join(cls.KINDS)}")
        if fault.kind == "replace" and not fault.body:
            raise ValueError("a replace fault needs body, a local file")
        return fault


class S3ServerError(RuntimeError):
    """The server did not start, or died, or its log did not settle."""


class FaultServer:
    """A server on ``127.0.0.1`` run as a subprocess of the test, recording every request
    and injecting the armed fault: what every store's test server shares (this module's
    :class:`S3Server`, ``objectservers.py``'s GCS and Azure ones).

    A context manager: ``__enter__`` starts it and waits until it answers, ``__exit__`` stops
    it (terminate, then kill) and removes its temporary folder (log included).
    """

    def __init__(self, start_timeout: float = START_TIMEOUT_S) -> None:
        self.start_timeout = start_timeout
        self.startup_s: float | None = None
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._mark = 0

    def start(self) -> FaultServer:
        raise NotImplementedError

    def _spawn(self, argv: list[str], env: Mapping[str, str]) -> Path:
        """Start ``argv`` (a server that writes its port to ``--port-file``) in a new
        temporary folder, its output into ``server.out``; returns the port file's path."""
        if self._proc is not None:
            raise S3ServerError("already started")
        self._dir = Path(tempfile.mkdtemp(prefix="s3server-"))
        port_file = self._dir / "port"
        out = (self._dir / "server.out").open("wb")
        try:
            self._proc = subprocess.Popen(
                [
                    *argv,
                    "--log",
                    str(self.log_path),
                    "--port-file",
                    str(port_file),
                    "--parent",
                    str(os.getpid()),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
            )
        finally:
            out.close()
        return port_file

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self, keep_files: bool = False) -> None:
        """Terminate, kill after 5 s, and remove the temporary folder (unless ``keep_files``)."""
        proc, self._proc = self._proc, None
        _end(proc)
        if self._dir is not None and not keep_files:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None
        self._port = None

    @property
    def log_path(self) -> Path:
        """The JSONL the server appends to: a ``start`` and an ``end`` line per request."""
        if self._dir is None:
            raise S3ServerError("not started")
        return self._dir / "requests.jsonl"

    @property
    def output_path(self) -> Path:
        """The server's own stdout and stderr (werkzeug's access log, tracebacks)."""
        if self._dir is None:
            raise S3ServerError("not started")
        return self._dir / "server.out"

    @property
    def port(self) -> int:
        if self._port is None:
            raise S3ServerError("not started")
        return self._port

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def mark(self) -> int:
        """The log's current end, for ``requests(since=...)``; settles first."""
        return len(self._settle().encode())

    def reset(self) -> None:
        """Forget what was served so far: later reads count from here."""
        self._mark = self.mark()

    def requests(self, since: int | None = None) -> list[Served]:
        """Every request answered since ``since`` (a ``mark()``; default: the last
        ``reset()``), in the order they ended. Waits until each request the server has
        started has ended, so a client that has just finished is counted whole."""
        text = self._settle()
        offset = self._mark if since is None else since
        out = []
        for line in text.encode()[offset:].decode().splitlines():
            rec = json.loads(line)
            if rec.pop("event") == "end":
                out.append(Served(**rec))
        return out

    def object_gets(self, since: int | None = None) -> list[Served]:
        """``requests()`` less listings, HEADs and uploads (errors kept: see ``Served.ok``)."""
        return [r for r in self.requests(since) if r.is_object_get]

    def bytes_by_key(self, since: int | None = None, bucket: str | None = None) -> dict[str, int]:
        """Object bytes sent per key: the bodies of 2xx GETs (an error document is no data)."""
        out: dict[str, int] = defaultdict(int)
        for r in self.object_gets(since):
            if r.ok and (bucket is None or r.bucket == bucket):
                out[r.key] += r.sent
        return dict(out)

    def bytes_by_range(
        self, since: int | None = None
    ) -> dict[tuple[str, str], list[tuple[str | None, int]]]:
        """Per ``(bucket, key)``, each 2xx GET's ``(Range header, bytes sent)``, in the order
        the requests ended (concurrent parts may end out of order)."""
        out: dict[tuple[str, str], list[tuple[str | None, int]]] = defaultdict(list)
        for r in self.object_gets(since):
            if r.ok:
                out[(r.bucket, r.key)].append((r.range, r.sent))
        return dict(out)

    def arm(self, fault: Fault) -> None:
        """Inject ``fault`` from now on (in place of any armed before; counts start at 0)."""
        self._control("POST", fault.as_json())

    def disarm(self) -> dict[str, Any]:
        """No fault from now on (a delay or stall under way ends); what the last one did."""
        return self._control("DELETE")

    def fault_state(self) -> dict[str, Any]:
        """``{"fault": armed or None, "matched": N, "applied": M}``: the requests the armed
        fault matched so far, and those it changed."""
        return self._control("GET")

    def _control(self, method: str, body: Any = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.endpoint}{FAULTS_PATH}", data=data, method=method)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=10) as resp:
            result: dict[str, Any] = json.loads(resp.read())
        return result

    def _settle(self, timeout: float = SETTLE_TIMEOUT_S) -> str:
        """The log's text once every started request has ended (bounded wait)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.log_path.read_text() if self.log_path.exists() else ""
            open_: dict[int, str] = {}
            for line in text.splitlines():
                rec = json.loads(line)
                if rec["event"] == "start":
                    open_[rec["seq"]] = rec.get("what", "")
                else:
                    open_.pop(rec["seq"], None)
            if not open_:
                return text
            if time.monotonic() > deadline:
                raise S3ServerError(
                    f"requests {sorted(open_.items())} still open after {timeout:.0f} s; "
                    f"see {self.log_path}; where the server's threads are:\n{self._stacks()}"
                )
            time.sleep(0.02)

    def _stacks(self) -> str:
        """The server's threads' stacks (faulthandler, on SIGUSR1): where an open request
        waits."""
        if self._proc is None or self._proc.poll() is not None or self._dir is None:
            return "(the server is not running)"
        stacks = self._dir / STACKS
        self._proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        return stacks.read_text()[-6000:] if stacks.exists() else "(no stacks written)"

    def _wait_for_port(self, port_file: Path, began: float) -> int:
        assert self._proc is not None
        while True:
            if port_file.exists():
                return int(port_file.read_text())
            self._check_alive_and_time(began)
            time.sleep(0.05)

    def _check_alive_and_time(self, began: float) -> None:
        assert self._proc is not None and self._dir is not None
        if self._proc.poll() is not None:
            raise S3ServerError(
                f"S3 server exited with {self._proc.returncode} while starting; "
                f"see {self._dir / 'server.out'}:\n{_tail(self._dir / 'server.out')}"
            )
        if time.monotonic() - began > self.start_timeout:
            raise S3ServerError(
                f"S3 server did not answer within {self.start_timeout:g} s; "
                f"see {self._dir / 'server.out'}:\n{_tail(self._dir / 'server.out')}"
            )


def _end(proc: subprocess.Popen[bytes] | None) -> None:
    """Terminate ``proc`` (its whole session), kill it after 5 s."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


class S3Server(FaultServer):
    """Moto's S3 in a subprocess on ``127.0.0.1`` on a free port, recording every request."""

    def start(self) -> S3Server:
        """Start the subprocess; it binds port 0 itself and reports the port, so no race."""
        began = time.monotonic()
        port_file = self._spawn([sys.executable, str(Path(__file__).resolve())], _server_env())
        try:
            self._port = self._wait_for_port(port_file, began)
            self._wait_until_answering(began)
        except BaseException:
            self.stop(keep_files=True)  # the error names server.out: leave it to be read
            raise
        self.startup_s = time.monotonic() - began
        self.reset()  # the readiness probe is no client's read
        return self

    @property
    def env(self) -> dict[str, str]:
        """What a client needs set to reach this server: boto3 and Run:ai's C++ client alike.

        AWS_ENDPOINT_URL is read by both; path-style addressing is Run:ai's
        RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0 (its default, 1, would put the bucket in the
        host name); the instance-metadata lookup is switched off so no credential probe leaves
        the machine; the credentials are dummies (moto does not check signatures).
        """
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "NO_PROXY": f"{HOST},localhost",
            "no_proxy": f"{HOST},localhost",
        }

    def client_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """A whole environment for a client subprocess: ``base`` (default ``os.environ``) less
        what would steer it elsewhere, plus ``env``. Shared AWS config and credentials files
        point at absent paths, so a profile on the host cannot override the dummies."""
        ours = self.env
        assert self._dir is not None
        merged = dict(os.environ if base is None else base)
        for name in _CLIENT_ENV_DROP:
            merged.pop(name, None)
        merged["AWS_CONFIG_FILE"] = str(self._dir / "absent-aws-config")
        merged["AWS_SHARED_CREDENTIALS_FILE"] = str(self._dir / "absent-aws-credentials")
        merged.update(ours)
        return merged

    def client(self) -> Any:
        """A boto3 S3 client for this server (path style, dummy credentials)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY_ID,
            aws_secret_access_key=SECRET_ACCESS_KEY,
            region_name=REGION,
            config=Config(s3={"addressing_style": "path"}),
        )

    def upload_dir(self, local_dir: Path | str, bucket: str, prefix: str = "") -> str:
        """Create ``bucket`` (if new) and upload every file under ``local_dir`` to
        ``prefix/<relative path>``; returns ``s3://bucket/prefix``. Uploads are recorded
        too: call ``reset()`` after, to count only what a client then reads."""
        root = Path(local_dir)
        s3 = self.client()
        existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
        if bucket not in existing:
            s3.create_bucket(Bucket=bucket)
        prefix = prefix.strip("/")
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = path.relative_to(root).as_posix()
            key = f"{prefix}/{rel}" if prefix else rel
            # put_object, one request per file: upload_file would go multipart past 8 MiB.
            with path.open("rb") as f:
                s3.put_object(Bucket=bucket, Key=key, Body=f)
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def _wait_until_answering(self, began: float) -> None:
        url = f"http://{HOST}:{self._port}/moto-api/"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while True:
            try:
                with opener.open(url, timeout=2) as resp:
                    resp.read()
                    return
            except urllib.error.HTTPError:
                return  # an HTTP answer of any status: it is serving
            except OSError:
                pass
            self._check_alive_and_time(began)
            time.sleep(0.05)


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _server_env() -> dict[str, str]:
    """The server's environment: no AWS settings of the host's leak into moto."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY_ID,
        AWS_SECRET_ACCESS_KEY=SECRET_ACCESS_KEY,
        AWS_DEFAULT_REGION=REGION,
        PYTHONUNBUFFERED="1",
    )
    return env


# -- the subprocess ---------------------------------------------------------------------------


class _Recorder:
    """WSGI middleware: a ``start`` line when a request arrives, an ``end`` line (the
    ``Served`` fields) once its body has been handed over or abandoned."""

    def __init__(
        self,
        app: Callable[..., Iterable[bytes]],
        log_path: Path,
        faults: _Faults | None = None,
        dialect: Dialect | None = None,
    ) -> None:
        self._app = app
        self._dialect = dialect or S3Dialect()
        self._lock = threading.Lock()
        self._seq = 0
        self._log = log_path.open("a", encoding="utf-8")
        self._faults = faults

    def write(self, rec: dict[str, Any]) -> None:
        with self._lock:
            self._log.write(json.dumps(rec) + "\n")
            self._log.flush()

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        if self._faults is not None and environ.get("PATH_INFO") == FAULTS_PATH:
            return self._faults.control(environ, start_response)  # not an S3 request
        with self._lock:
            self._seq += 1
            seq = self._seq
        method, bucket, key = self._dialect.where(environ)
        self.write({"event": "start", "seq": seq, "what": f"{method} {bucket}/{key}"})
        rec: dict[str, Any] = {
            "event": "end",
            "seq": seq,
            "method": method,
            "bucket": bucket,
            "key": key,
            "query": environ.get("QUERY_STRING", ""),
            "range": environ.get("HTTP_RANGE") or environ.get("HTTP_X_MS_RANGE"),
            "status": 0,
            "sent": 0,
            "content_length": None,
            "complete": False,
            "started": time.time(),
            "ended": 0.0,
        }

        def counting_start_response(
            status: str, headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Callable[[bytes], Any]:
            rec["status"] = int(status.split(" ", 1)[0])
            for name, value in headers:
                if name.lower() == "content-length":
                    rec["content_length"] = int(value)
            write = start_response(status, headers, exc_info)

            def counting_write(data: bytes) -> Any:
                rec["sent"] += len(data)
                return write(data)

            return counting_write

        try:
            body = self._app(environ, counting_start_response)
        except BaseException:
            rec["ended"] = time.time()
            rec["fault"] = environ.get(_FAULT_KEY)
            self.write(rec)
            raise
        rec["fault"] = environ.get(_FAULT_KEY)
        return _Counted(body, rec, self.write)


#: Where the fault middleware notes, in a request's environ, the fault it injected.
_FAULT_KEY = "s3server.fault"


class _Faults:
    """The armed fault (one at a time), its counts, and the control path's handler."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.fault: Fault | None = None
        self.matched = 0
        self.applied = 0
        self.release = threading.Event()

    def control(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "")
        status = "200 OK"
        with self._lock:
            before = self.state()
            try:
                if method == "POST":
                    size = int(environ.get("CONTENT_LENGTH") or 0)
                    fault = Fault.from_json(json.loads(environ["wsgi.input"].read(size)))
                    self._reset(fault)
                elif method == "DELETE":
                    self._reset(None)
                elif method != "GET":
                    raise ValueError(f"{method} {FAULTS_PATH}: GET, POST or DELETE")
                out = before if method == "DELETE" else self.state()
            except (ValueError, TypeError, KeyError) as exc:
                status, out = "400 Bad Request", {"error": f"{type(exc).__name__}: {exc}"}
        data = json.dumps(out).encode()
        start_response(
            status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
        )
        return [data]

    def _reset(self, fault: Fault | None) -> None:
        self.release.set()  # a delay or stall under way ends now
        self.release = threading.Event()
        self.fault, self.matched, self.applied = fault, 0, 0

    def state(self) -> dict[str, Any]:
        return {
            "fault": self.fault.as_json() if self.fault is not None else None,
            "matched": self.matched,
            "applied": self.applied,
        }

    def match(self, method: str, bucket: str, key: str) -> tuple[Fault, threading.Event] | None:
        """The armed fault if it applies to this request (counted), else None."""
        with self._lock:
            fault = self.fault
            if (
                fault is None
                or not key
                or method not in fault.methods
                or (fault.key and key != fault.key)
                or (fault.bucket is not None and bucket != fault.bucket)
            ):
                return None
            self.matched += 1
            n = self.matched - fault.after
            if n < 1 or (fault.times is not None and n > fault.times):
                return None
            self.applied += 1
            return fault, self.release


class _Faulty:
    """WSGI middleware: the armed :class:`Fault` injected into the requests it matches."""

    def __init__(
        self,
        app: Callable[..., Iterable[bytes]],
        faults: _Faults,
        dialect: Dialect | None = None,
    ) -> None:
        self._app = app
        self._faults = faults
        self._dialect = dialect or S3Dialect()

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        method, bucket, key = self._dialect.where(environ)
        found = self._faults.match(method, bucket, key)
        if found is None:
            return self._app(environ, start_response)
        fault, release = found
        environ[_FAULT_KEY] = fault.kind
        if fault.kind == "status":
            return self._dialect.error(start_response, fault, method, bucket, key)
        if fault.kind == "replace":
            self._dialect.put(self._app, environ, bucket, key, Path(fault.body or "").read_bytes())
            return self._app(environ, start_response)
        if fault.kind == "delay":
            release.wait(fault.seconds)
            return self._app(environ, start_response)
        body = self._app(environ, start_response)
        return _cut(body, environ, fault, release)


class Dialect:
    """How one store's requests read, for the middlewares: which operation on which object
    a request is, a refusal in the store's words, and an object replaced in the store."""

    def where(self, environ: dict[str, Any]) -> tuple[str, str, str]:
        """``(method, bucket, key)``: the request's method as S3 names its operations
        (``GET`` an object's bytes, ``HEAD`` its metadata, ``PUT``...), and its object
        (``key`` empty for a request of no one object)."""
        raise NotImplementedError

    def error(
        self,
        start_response: Callable[..., Any],
        fault: Fault,
        method: str,
        bucket: str,
        key: str,
    ) -> Iterable[bytes]:
        raise NotImplementedError

    def put(
        self,
        app: Callable[..., Iterable[bytes]],
        environ: dict[str, Any],
        bucket: str,
        key: str,
        data: bytes,
    ) -> None:
        raise NotImplementedError


def path_of(environ: dict[str, Any]) -> str:
    """The request's path, decoded: PATH_INFO is percent-decoded as latin-1 (PEP 3333);
    keys are UTF-8."""
    return str(environ.get("PATH_INFO", "")).encode("latin-1").decode("utf-8", "replace")


def reason_of(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # a status HTTP does not name
        return "Error"


class S3Dialect(Dialect):
    """S3's path-style requests (``/bucket/key``), served by moto in the same process."""

    def where(self, environ: dict[str, Any]) -> tuple[str, str, str]:
        bucket, _, key = path_of(environ).lstrip("/").partition("/")
        return str(environ.get("REQUEST_METHOD", "")), bucket, key

    def put(
        self,
        app: Callable[..., Iterable[bytes]],
        environ: dict[str, Any],
        bucket: str,
        key: str,
        data: bytes,
    ) -> None:
        """The object's bytes replaced through moto itself (a PUT in this request's name)."""
        from werkzeug.test import EnvironBuilder

        headers = {
            name[5:].replace("_", "-").title(): value
            for name, value in environ.items()
            if name in ("HTTP_HOST", "HTTP_AUTHORIZATION")
        }
        put = EnvironBuilder(
            path=f"/{bucket}/{key}", method="PUT", data=data, headers=headers
        ).get_environ()
        statuses: list[str] = []
        body = app(put, lambda status, _headers, _exc=None: statuses.append(status))
        for _ in body:
            pass
        close = getattr(body, "close", None)
        if close is not None:
            close()
        if not statuses or not statuses[0].startswith("200"):
            raise S3ServerError(f"replacing {bucket}/{key} failed: {statuses}")

    def error(
        self,
        start_response: Callable[..., Any],
        fault: Fault,
        method: str,
        bucket: str,
        key: str,
    ) -> Iterable[bytes]:
        """An S3 error answer: its XML document (none for HEAD)."""
        return xml_error(
            start_response,
            fault,
            method,
            f"<Key>{key}</Key><BucketName>{bucket}</BucketName><RequestId>s3server-fault</RequestId>",
            [("x-amz-request-id", "s3server-fault")],
        )


def xml_error(
    start_response: Callable[..., Any],
    fault: Fault,
    method: str,
    more: str,
    headers: list[tuple[str, str]],
) -> Iterable[bytes]:
    """An error answer as S3 and Azure word it: ``fault``'s status, and an XML ``Error``
    document of its code, ``more`` and a message (no body for HEAD), with ``headers``."""
    doc = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{fault.code}</Code><Message>injected by the test server</Message>"
        f"{more}</Error>"
    ).encode()
    data = b"" if method == "HEAD" else doc
    start_response(
        f"{fault.status} {reason_of(fault.status)}",
        [("Content-Type", "application/xml"), ("Content-Length", str(len(data))), *headers],
    )
    return [data]


def _cut(
    body: Iterable[bytes], environ: dict[str, Any], fault: Fault, release: threading.Event
) -> Iterator[bytes]:
    """``body``, shut down after ``fault.sent`` bytes (a stall first waits ``seconds``)."""
    left = fault.sent
    try:
        for chunk in body:
            if len(chunk) < left:
                left -= len(chunk)
                yield chunk
                continue
            if left:
                yield chunk[:left]
            break
        if fault.kind == "stall":
            release.wait(fault.seconds)
        sock = environ.get("werkzeug.socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        raise ConnectionResetError(f"s3server: connection closed by a {fault.kind} fault")
    finally:
        close = getattr(body, "close", None)
        if close is not None:
            close()


class _Counted:
    """The app's body, counted as werkzeug writes it out; the record is written once the body
    is handed over or abandoned, or on ``close()``, whichever comes first: werkzeug drains
    the connection before it calls ``close()``, and a read that fails there (a TLS client
    that sends again, then waits past the handler's timeout) skips the call."""

    def __init__(
        self, body: Iterable[bytes], rec: dict[str, Any], write: Callable[[dict[str, Any]], None]
    ) -> None:
        self._body = body
        self._rec = rec
        self._write = write
        self._done = False

    def __iter__(self) -> Iterator[bytes]:
        try:
            for chunk in self._body:
                # Moto hands over a whole range as one bytes object. In pieces, each counted
                # once werkzeug's write (a blocking sendall) has returned and asked for the
                # next, so a client that goes away mid-body is counted to within a piece.
                for at in range(0, len(chunk), _PIECE):
                    piece = chunk[at : at + _PIECE] if len(chunk) > _PIECE else chunk
                    yield piece
                    self._rec["sent"] += len(piece)
            self._rec["complete"] = True
        finally:  # handed over, or abandoned (the generator closed when werkzeug drops it)
            self.close()

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            self._rec["ended"] = time.time()
            self._write(self._rec)


def _orphan_watch(parent: int) -> None:
    """Exit once the test process is gone (killed before it could stop us): no stray server."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _serve(log_path: Path, port_file: Path, parent: int | None) -> None:
    """Moto's S3, recorded and with faults: :func:`serve`."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )

    serve(
        DomainDispatcherApplication(create_backend_app),
        S3Dialect(),
        log_path,
        port_file,
        parent,
        request_handler=MotoRequestHandler,
    )


def serve(
    store: Callable[..., Iterable[bytes]],
    dialect: Dialect,
    log_path: Path,
    port_file: Path,
    parent: int | None,
    port: int = 0,
    **options: Any,
) -> None:
    """``store`` behind the fault and recording middlewares: bind 127.0.0.1:``port`` (0: a
    free one), report the port (atomically), serve until killed (or the test process is
    gone)."""
    from werkzeug.serving import make_server

    stacks = (port_file.parent / STACKS).open("w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faults = _Faults()
    app = _Recorder(_Faulty(store, faults, dialect), log_path, faults, dialect)
    server = make_server(HOST, port, app, threaded=True, **options)
    if parent is not None:
        threading.Thread(target=_orphan_watch, args=(parent,), daemon=True).start()
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(server.server_port))
    tmp.replace(port_file)
    server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--parent", type=int, default=None)
    args = parser.parse_args(argv)
    _serve(args.log, args.port_file, args.parent)


if __name__ == "__main__":
    main()
