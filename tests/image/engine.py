"""A Docker Engine of the image test's own, and the two user commands run against it:
``docker buildx bake TARGET`` and ``docker compose -f compose.yaml -f cpu-compose.yaml up
--exit-code-from smoke``.

dockerd runs as root in a network namespace of its own (``ip netns``, loopback only), so no
container, build step or published port can reach beyond this machine; it is started with
``nsenter --net`` (``ip netns exec`` would remount /sys and hide the cgroup mounts dockerd
needs). Its data (overlay2: vfs would copy every layer) is under build/docker-engine/ and
is removed when the engine stops, as is the namespace. No registry is reachable from it: the
bases come from buildah's storage (:meth:`Engine.load`).

Its programs are Debian trixie's Docker Engine 26, buildx and Compose v2, which
scripts/system-setup unpacks into build/system-tools (:data:`TOOLS`) and never installs
(bookworm has none of them; installed, trixie's packages upgrade the host's libc): each is run
from there by its path, never found on PATH.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import buildah
import hostcpu
from buildfiles import REPO

ROOT = REPO / "build" / "docker-engine"
#: Where the engine's programs are (scripts/system-setup, HYBRID_DRAFT_SYSTEM_TOOLS): bin/ holds
#: docker, dockerd and what dockerd runs (containerd, containerd-shim-runc-v2, docker-init,
#: docker-proxy), cli-plugins/ docker-buildx and docker-compose. runc and iptables are the
#: host's own (bookworm's).
TOOLS = Path(os.environ.get("HYBRID_DRAFT_SYSTEM_TOOLS", REPO / "build" / "system-tools"))
BIN = TOOLS / "bin"
DOCKER = BIN / "docker"
DOCKERD = BIN / "dockerd"
CLI_PLUGINS = TOOLS / "cli-plugins"
NETNS = f"{buildah.PREFIX}docker"
CPU_COMPOSE = Path(__file__).with_name("cpu-compose.yaml")
#: The compose project compose.yaml names (``name:``): its volumes are PROJECT_NAME.
PROJECT = "hybrid-draft"
SCRATCH = Path(os.environ.get("HYBRID_DRAFT_IMAGE_TEST_TMP", "/var/tmp"))
UP_TIMEOUT_S = float(os.environ.get("HYBRID_DRAFT_IMAGE_TEST_HEALTH_TIMEOUT", "900")) + 120
#: compose.yaml's variables as a user of a CPU host sets them (tests/image/cpu-compose.yaml).
CPU_VARIABLES = {
    "CHECKPOINT_ARCH": "deepseek_v3",
    "CHECKPOINT_PRESET": "cpu",
    "MAX_MODEL_LEN": "1024",
    "CPU_DTYPE": hostcpu.serving_dtype(),  # tests/hostcpu.py: bfloat16 where AMX_MLA serves
}

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class Up:
    """One ``docker compose up``: its exit status, its output, the events volume's files."""

    returncode: int
    output: str
    events_dir: Path

    def service(self, name: str) -> str:
        """The lines of one service's output (compose prefixes each with ``name-N  | ``)."""
        prefix = re.compile(rf"^{re.escape(name)}-\d+\s+\| ?")
        # compose 2.26 starts each log line with an erase-line code even with --ansi never
        lines = (ANSI.sub("", ln) for ln in self.output.splitlines())
        return "\n".join(prefix.sub("", ln) for ln in lines if prefix.match(ln))

    def events(self, name: str = "hybrid-draft.jsonl") -> list[dict[str, Any]]:
        path = self.events_dir / name
        if not path.exists():
            return []
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def passed(result: Up) -> str:
    """The smoke service's output of an ``up`` that passed, its draft judged by acceptance
    against the floor of a checkpoint whose draft agrees with its target (the generated one)."""
    smoke = result.service("smoke")
    assert result.returncode == 0, result.output[-8000:]
    assert "FAIL" not in smoke and re.search(r"^smoke: \d+ passed, 0 failed$", smoke, re.M), smoke
    assert re.search(
        r"^PASS draft acceptance: 1\.000 \(.*\), at least the floor 0\.9 \(the checkpoint says "
        r"its draft agrees with its target: /model/model\.safetensors\.index\.json\)$",
        smoke,
        re.M,
    ), smoke
    return smoke


def stood_in_reads(result: Up) -> list[dict[str, Any]]:
    """The loads that went through the stand-in for InstantTensor's GPU read."""
    return [e for e in result.events("standin.jsonl") if e.get("event") == "call"]


@dataclass
class Engine:
    """A dockerd with its data under ``root``, in the network namespace ``netns``."""

    root: Path = ROOT
    netns: str = NETNS

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def pidfile(self) -> Path:
        return self.root / "dockerd.pid"

    @property
    def config(self) -> Path:
        """The docker CLI's configuration (DOCKER_CONFIG): its plugins, buildx's state."""
        return self.root / "docker-config"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a docker command: this engine, its own CLI configuration, and
        nothing of a user's compose or bake variables but ``extra``."""
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TERM")}
        return {
            **keep,
            "DOCKER_HOST": f"unix://{self.socket}",
            "DOCKER_CONFIG": str(self.config),
            **(extra or {}),
        }

    def docker(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        check: bool = True,
        timeout: float | None = 1800,
    ) -> subprocess.CompletedProcess[str]:
        """``docker ARGS`` against this engine; with ``log``, its output goes there too."""
        out = subprocess.run(
            [str(DOCKER), *args],
            cwd=REPO,
            env=self.env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        if log is not None:
            log.write_text(out.stdout)
        if check and out.returncode != 0:
            raise RuntimeError(
                f"docker {' '.join(args)} exited {out.returncode}:\n{out.stdout[-4000:]}"
            )
        return out

    def start(self) -> None:
        self.stop()  # a run that was killed half-way leaves its engine behind
        self.root.mkdir(parents=True)
        self.config.mkdir()
        (self.config / "cli-plugins").symlink_to(CLI_PLUGINS)
        # dockerd finds containerd, its shim, docker-init and docker-proxy on its PATH, the
        # host's runc and iptables after them.
        path = os.pathsep.join([str(BIN), os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
        subprocess.run(["ip", "netns", "add", self.netns], check=True)
        subprocess.run(
            ["ip", "netns", "exec", self.netns, "ip", "link", "set", "lo", "up"], check=True
        )
        with open(self.root / "dockerd.log", "w") as log:
            subprocess.Popen(
                [
                    "nsenter",
                    f"--net=/run/netns/{self.netns}",
                    str(DOCKERD),
                    "--data-root",
                    str(self.root / "data"),
                    "--exec-root",
                    f"/run/{self.netns}",
                    "--pidfile",
                    str(self.pidfile),
                    "-H",
                    f"unix://{self.socket}",
                    "--storage-driver",
                    "overlay2",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PATH": path},
            )
        deadline = time.monotonic() + 60
        while self.docker("info", check=False, timeout=10).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "dockerd did not start:\n" + (self.root / "dockerd.log").read_text()[-4000:]
                )
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop dockerd (its containers with it) and remove its data and namespace."""
        with contextlib.suppress(FileNotFoundError, ValueError):
            pid = int(self.pidfile.read_text())
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
                for _ in range(300):
                    os.kill(pid, 0)
                    time.sleep(0.1)
                os.kill(pid, signal.SIGKILL)
        # overlay2 mounts dockerd left (a killed engine unmounts nothing)
        mounts = Path("/proc/mounts").read_text().splitlines()
        for line in reversed(mounts):
            where = line.split()[1]
            if where.startswith(str(self.root)) or where.startswith(f"/run/{self.netns}"):
                subprocess.run(["umount", "-l", where], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(f"/run/{self.netns}", ignore_errors=True)
        subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True)

    def disk_bytes(self) -> int:
        out = subprocess.run(["du", "-sb", str(self.root)], capture_output=True, text=True)
        return int(out.stdout.split()[0]) if out.returncode == 0 else -1

    def load(self, image: str) -> str:
        """An image of buildah's storage, copied into this engine under the same name.

        As a docker-archive stream (``buildah push IMAGE docker-archive:FIFO``, read by
        ``docker load``), through a named pipe rather than a file: a base is 3.5 GB, which a
        file would hold on the disk beside both stores. buildah's ``docker-daemon:``
        transport (buildah 1.28) breaks off against this engine ("read/write on closed
        pipe")."""
        if self.docker("image", "inspect", image, check=False).returncode == 0:
            return image
        with tempfile.TemporaryDirectory(prefix="hybrid-draft-load-", dir=SCRATCH) as tmp:
            fifo = Path(tmp) / "image.tar"
            os.mkfifo(fifo)
            load = subprocess.Popen(
                [str(DOCKER), "load", "--quiet", "--input", str(fifo)],
                cwd=REPO,
                env=self.env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            push = None
            try:
                push = buildah.buildah(
                    "push", "--quiet", image, f"docker-archive:{fifo}:{image}", check=False
                )
            finally:
                if push is None or push.returncode != 0:
                    load.kill()  # the pipe may never have been opened: nothing ends the read
            loaded, _ = load.communicate(timeout=1800)
            if push.returncode != 0 or load.returncode != 0:
                raise RuntimeError(
                    f"loading {image} into the engine: buildah push exited {push.returncode}"
                    f" ({push.stderr.strip()[-2000:]}), docker load {load.returncode}"
                    f" ({loaded.strip()[-2000:]})"
                )
        return image

    def clear(self) -> None:
        """Remove every container, image and build cache entry, keeping the volumes (the
        compose flow's checkpoint): the bases of one kind go before those of another come."""
        self.docker("container", "prune", "--force")
        self.docker("image", "prune", "--all", "--force")
        self.docker("builder", "prune", "--all", "--force")

    def bake(
        self, target: str, variables: dict[str, str], log: Path
    ) -> subprocess.CompletedProcess[str]:
        """``VAR=... docker buildx bake TARGET``, as the README gives it, from the repository;
        bake's environment is ``variables`` only."""
        return self.docker(
            "buildx", "bake", "--progress", "plain", target, env=variables, log=log, check=False
        )

    def image_labels(self, ref: str) -> dict[str, str]:
        out = self.docker("image", "inspect", "--format", "{{json .Config.Labels}}", ref)
        return json.loads(out.stdout) or {}

    # --- compose ---------------------------------------------------------------------------

    def compose(
        self,
        *args: str,
        variables: dict[str, str],
        log: Path | None = None,
        check: bool = True,
        timeout: float | None = 600,
    ) -> subprocess.CompletedProcess[str]:
        return self.docker(
            "compose",
            "--ansi",
            "never",
            "-f",
            "compose.yaml",
            "-f",
            str(CPU_COMPOSE.relative_to(REPO)),
            *args,
            env=variables,
            log=log,
            check=check,
            timeout=timeout,
        )

    def up(self, variables: dict[str, str], log: Path) -> subprocess.CompletedProcess[str]:
        """``docker compose -f compose.yaml -f cpu-compose.yaml up --exit-code-from smoke``;
        the stack's containers are stopped when it returns (the volumes are kept)."""
        try:
            return self.compose(
                "up",
                "--exit-code-from",
                "smoke",
                variables=variables,
                log=log,
                check=False,
                timeout=UP_TIMEOUT_S,
            )
        finally:
            self.compose("stop", variables=variables, check=False)

    def volume_path(self, volume: str) -> Path:
        """Where compose's named volume ``volume`` of the project lies on this machine."""
        out = self.docker("volume", "inspect", "--format", "{{.Mountpoint}}", f"{PROJECT}_{volume}")
        return Path(out.stdout.strip())

    def remove_volume(self, volume: str, variables: dict[str, str]) -> None:
        self.compose("rm", "--force", "--stop", variables=variables, check=False)
        self.docker("volume", "rm", "--force", f"{PROJECT}_{volume}", check=False)
