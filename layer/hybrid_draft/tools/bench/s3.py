"""The benchmark checkpoint's copy in object storage, for the ``runai_s3_*`` strategies.

``--s3-endpoint URL`` names an S3-compatible endpoint; the credentials come from the
environment, as boto3 and Run:ai's S3 client both read them (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``...). :func:`upload` checks that the endpoint
answers (a bounded wait: a bad endpoint is one line, exit 2, before any worker starts),
creates the bucket if it is missing and puts each file of the checkpoint once, one
``put_object`` per file, leaving those already there with the same size. Path-style
addressing (``http://host:port/bucket/key``), which S3-compatible servers accept and AWS
still serves; Run:ai's client is told the same (``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0``
unless set).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

#: One connection attempt's bound, and the attempts, for every request the upload makes.
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 120
ATTEMPTS = 2


class S3Error(ValueError):
    """The endpoint, the bucket or the upload failed: one line saying which."""


def check_endpoint(url: str) -> str:
    """``url`` if it is an ``http(s)://host[:port]`` address, else :class:`S3Error`."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise S3Error(f"--s3-endpoint {url!r}: not an http:// or https:// address")
    try:
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError:
        raise S3Error(f"--s3-endpoint {url!r}: the port is not a number") from None
    return url.rstrip("/")


def client_environment(endpoint: str) -> dict[str, str]:
    """What the workers' Run:ai client (and vLLM) need set to reach ``endpoint``."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": os.environ.get(
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0"
        ),
    }


def _client(endpoint: str) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise S3Error(
            "--s3-endpoint needs boto3 to upload the checkpoint: pip install boto3"
        ) from None
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        config=Config(
            connect_timeout=CONNECT_TIMEOUT_S,
            read_timeout=READ_TIMEOUT_S,
            retries={"max_attempts": ATTEMPTS, "mode": "standard"},
            s3={"addressing_style": "path"},
        ),
    )


def _why(exc: BaseException) -> str:
    from hybrid_draft import files

    return files.one_line(str(exc)) or type(exc).__name__


class Bucket:
    """A bucket at an endpoint that answered: :meth:`upload` puts the checkpoint there."""

    def __init__(self, endpoint: str, bucket: str) -> None:
        """Reach ``endpoint`` and make sure ``bucket`` is there (created if missing): one
        line (:class:`S3Error`) for an endpoint that does not answer, credentials it
        refuses, or a bucket that cannot be created; at most :data:`ATTEMPTS` connection
        attempts of :data:`CONNECT_TIMEOUT_S` seconds each."""
        self.endpoint = endpoint
        self.bucket = bucket
        self.client = _client(endpoint)

        def ensure() -> None:
            from botocore.exceptions import ClientError

            try:
                self.client.head_bucket(Bucket=bucket)
            except ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                if code not in ("404", "NoSuchBucket", "NotFound"):
                    raise
                region = self.client.meta.region_name
                extra = (
                    {"CreateBucketConfiguration": {"LocationConstraint": region}}
                    if region and region != "us-east-1"
                    else {}
                )
                self.client.create_bucket(Bucket=bucket, **extra)

        self._calling(ensure)

    def _calling(self, call: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        where = f"--s3-endpoint {self.endpoint}"
        try:
            return call()
        except NoCredentialsError:
            raise S3Error(
                f"{where}: no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or another source boto3 reads)"
            ) from None
        except ClientError as exc:
            raise S3Error(f"{where}: bucket {self.bucket!r}: {_why(exc)}") from None
        except BotoCoreError as exc:
            raise S3Error(f"{where}: {_why(exc)}") from None
        except ValueError as exc:  # botocore's check of the endpoint address
            raise S3Error(f"{where}: {_why(exc)}") from None

    def upload(self, prefix: str, directory: Path) -> dict[str, Any]:
        """Put every file of ``directory`` under ``s3://bucket/prefix/`` (those already
        there with the same size left as they are); return where, and what was sent."""
        return dict(
            self._calling(lambda: _upload(self.client, self.bucket, prefix, directory)),
            endpoint=self.endpoint,
        )


def _upload(client: Any, bucket: str, prefix: str, directory: Path) -> dict[str, Any]:
    there: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/"
    ):
        for item in page.get("Contents", []):
            there[item["Key"]] = int(item["Size"])
    sent_files = sent_bytes = 0
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        key = f"{prefix}/{path.name}"
        size = path.stat().st_size
        if there.get(key) == size:
            continue
        # put_object, one request per file (upload_file would go multipart past 8 MiB).
        with path.open("rb") as f:
            client.put_object(Bucket=bucket, Key=key, Body=f)
        sent_files += 1
        sent_bytes += size
    return {
        "bucket": bucket,
        "uri": f"s3://{bucket}/{prefix}",
        "uploaded_files": sent_files,
        "uploaded_bytes": sent_bytes,
    }
