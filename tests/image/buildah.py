"""buildah as the image test drives it: builds, images, working containers, runs.

Every run uses chroot isolation (no OCI runtime or daemon needed; the process shares the
caller's network namespace). Every container this test makes is named with :data:`PREFIX`,
so a run that was killed half-way leaves nothing the next run does not remove.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: HYBRID_DRAFT_IMAGE_TEST_PREFIX names another, so that two runs on one machine (each in its
#: own checkout) never remove each other's containers or network namespaces.
PREFIX = os.environ.get("HYBRID_DRAFT_IMAGE_TEST_PREFIX", "hybrid-draft-image-test-")
ISOLATION = "chroot"


def buildah(
    *args: str, check: bool = True, timeout: float | None = None, log: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run buildah; with ``log``, stdout and stderr go (together) to that file instead."""
    if log is None:
        out = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    else:
        with open(log, "w") as f:
            out = subprocess.run(
                ["buildah", *args], stdout=f, stderr=subprocess.STDOUT, text=True, timeout=timeout
            )
        out.stdout = log.read_text()
    if check and out.returncode != 0:
        raise RuntimeError(
            f"buildah {' '.join(args)} exited {out.returncode}:\n"
            f"{(out.stdout or '')[-4000:]}{(out.stderr or '')[-4000:]}"
        )
    return out


def image_exists(ref: str) -> bool:
    return buildah("inspect", "--type", "image", ref, check=False).returncode == 0


def inspect_image(ref: str) -> dict[str, Any]:
    return json.loads(buildah("inspect", "--type", "image", ref).stdout)


def image_config(ref: str) -> dict[str, Any]:
    """The OCI image config (Entrypoint, Cmd, Env, Labels, WorkingDir, ...)."""
    return inspect_image(ref)["OCIv1"]["config"]


def image_id(ref: str) -> str:
    return inspect_image(ref)["FromImageID"]


def image_names(repository: str) -> list[str]:
    """Every ``name:tag`` in local storage whose repository is ``repository``."""
    rows = json.loads(buildah("images", "--json").stdout or "null") or []
    return [n for row in rows for n in row.get("names") or [] if n.rsplit(":", 1)[0] == repository]


def remove_image(ref: str) -> None:
    buildah("rmi", ref, check=False)


def build(
    dockerfile: Path,
    context: Path,
    tag: str,
    *,
    build_args: dict[str, str],
    build_contexts: dict[str, Path] | None = None,
    log: Path,
    extra: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """``buildah bud`` with chroot isolation; never raises on a failed build (the caller
    reads the log). Intermediate containers go even when it fails."""
    argv = [
        "bud",
        "--isolation",
        ISOLATION,
        "--force-rm",
        "--layers=false",
        "-f",
        str(dockerfile),
        "-t",
        tag,
        *extra,
    ]
    for k, v in build_args.items():
        argv += ["--build-arg", f"{k}={v}"]
    for k, v in (build_contexts or {}).items():
        argv += ["--build-context", f"{k}={v}"]
    return buildah(*argv, str(context), check=False, log=log)


@dataclass(frozen=True)
class Store:
    """containers-storage as buildah uses it here (``buildah info``)."""

    root: Path
    driver: str

    @classmethod
    def current(cls) -> Store:
        store = json.loads(buildah("info").stdout)["store"]
        return cls(Path(store["GraphRoot"]), store["GraphDriverName"])

    def _layers(self) -> dict[str, dict[str, Any]]:
        path = self.root / f"{self.driver}-layers" / "layers.json"
        return {layer["id"]: layer for layer in json.loads(path.read_text())}

    def layer_chain(self, ref: str) -> list[dict[str, Any]]:
        """An image's layers, top first, as the storage records them (with ``diff-size``)."""
        top = inspect_image(ref)["FromImageID"]
        images = json.loads((self.root / f"{self.driver}-images" / "images.json").read_text())
        layer_id = next(i["layer"] for i in images if i["id"] == top)
        layers, chain = self._layers(), []
        while layer_id:
            chain.append(layers[layer_id])
            layer_id = layers[layer_id].get("parent")
        return chain

    def size_over(self, image: str, base: str) -> tuple[int, int]:
        """(uncompressed bytes, layer count) of ``image``'s layers that ``base`` lacks."""
        below = {layer["id"] for layer in self.layer_chain(base)}
        mine = [layer for layer in self.layer_chain(image) if layer["id"] not in below]
        return sum(int(layer.get("diff-size", 0)) for layer in mine), len(mine)

    def disk_bytes(self) -> int:
        out = subprocess.run(["du", "-sb", str(self.root)], capture_output=True, text=True)
        return int(out.stdout.split()[0]) if out.returncode == 0 else -1


def remove_leftovers() -> None:
    """Containers a killed earlier run left (named with :data:`PREFIX`)."""
    rows = json.loads(buildah("containers", "--json").stdout or "null") or []
    for row in rows:
        if str(row.get("containername", "")).startswith(PREFIX):
            buildah("umount", row["id"], check=False)
            buildah("rm", row["id"], check=False)


@dataclass
class Container:
    """A working container of an image, removed (unmounted first) by :meth:`remove`."""

    image: str
    name: str
    id: str = ""
    mounted: Path | None = None

    def __post_init__(self) -> None:
        self.name = PREFIX + self.name
        buildah("rm", self.name, check=False)
        self.id = buildah(
            "from", "--pull-never", "--name", self.name, "-q", self.image
        ).stdout.strip()

    def mount(self) -> Path:
        if self.mounted is None:
            self.mounted = Path(buildah("mount", self.id).stdout.strip())
        return self.mounted

    def run(
        self, argv: Sequence[str], *, user: str | None = None, timeout: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``buildah run`` of ``argv``, as ``user`` when given, else as the image's user."""
        cmd = ["buildah", "run", "--isolation", ISOLATION]
        if user is not None:
            cmd += ["--user", user]
        return subprocess.run(
            [*cmd, self.id, "--", *argv], capture_output=True, text=True, timeout=timeout
        )

    def remove(self) -> None:
        if self.mounted is not None:
            buildah("umount", self.id, check=False)
            self.mounted = None
        buildah("rm", self.id, check=False)
