"""compose.yaml's services, run with ``buildah run`` in one container: the mod test's server
and smoke (tests/image/test_mod.py). spark-vllm-docker applies the mod to a running
container and then runs ``vllm serve`` in it with ``docker exec``; the mod test does the
same in a buildah working container, with compose.yaml's commands. Compose itself runs in
the test's Docker Engine for the image flows (tests/image/engine.py, test_compose_flow.py).

What it reads from compose.yaml, as ``docker compose up`` would: each service's entrypoint
and command (the image's where the service sets none, with Compose's rule that a service
entrypoint drops the image's command), environment, volumes (named volumes are host
folders that a new one's first container gives the owner and mode of the image's folder
there, as Docker does; binds are resolved against the project folder), health checks and
``depends_on`` order; every service runs as its image's user. The only additions are the
CPU run's, from cpu-run.yaml, and the stand-in for InstantTensor's GPU read, bind-mounted
for the run only.

All services share one private network namespace (``buildah run`` with chroot isolation
joins the caller's), and each container's ``/etc/hosts`` names every service (buildah's
``--add-host``), as Compose's network does: the server listens on compose's port 8000, the
smoke service reaches it as ``server``, and nothing clashes with a server on the host.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import buildah
import hostcpu
from buildfiles import REPO, compose

CPU_RUN = Path(__file__).with_name("cpu-run.yaml")
#: Service keys this runner carries out (the others must be listed in cpu-run.yaml's
#: ``not_applied``, with why).
HANDLED = {
    "image",
    "entrypoint",
    "command",
    "environment",
    "volumes",
    "healthcheck",
    "depends_on",
    "restart",
    "init",
}
HEALTH_CAP_S = float(os.environ.get("HYBRID_DRAFT_IMAGE_TEST_HEALTH_TIMEOUT", "900"))


def cpu_run() -> dict[str, Any]:
    return yaml.safe_load(CPU_RUN.read_text())


def duration(text: str | int | float | None, default: float) -> float:
    """A Compose duration (``1m30s``, ``10s``, ``60m``) in seconds."""
    if text is None:
        return default
    if isinstance(text, int | float):
        return float(text)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Compose duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def as_list(value: str | list[str] | None) -> list[str] | None:
    if value is None:
        return None
    return ["sh", "-c", value] if isinstance(value, str) else list(value)


def as_env(value: dict[str, Any] | list[str] | None) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in value)
    return {k: "" if v is None else str(v) for k, v in value.items()}


@dataclass
class Service:
    """One compose service, resolved for a ``buildah run``."""

    name: str
    image: str
    argv: list[str]
    env: dict[str, str]
    volumes: list[str]
    depends_on: dict[str, str]
    health: list[str] | None = None
    health_interval: float = 5
    health_timeout: float = 30
    health_deadline: float = 300
    container: buildah.Container | None = None
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    named_mounts: list[tuple[Path, str]] = field(default_factory=list)  # (volume dir, target)


def argv_of(svc: dict[str, Any], image_cfg: dict[str, Any]) -> list[str]:
    """Entrypoint + command as Docker runs them: a service ``entrypoint`` replaces the
    image's and drops its default command; a service ``command`` replaces the image's."""
    if "entrypoint" in svc:
        entry = as_list(svc["entrypoint"]) or []
        command = as_list(svc.get("command")) or []
    else:
        entry = list(image_cfg.get("Entrypoint") or [])
        command = as_list(svc["command"]) if "command" in svc else list(image_cfg.get("Cmd") or [])
    return [*entry, *(command or [])]


def named_mounts(svc: dict[str, Any], named: dict[str, Path]) -> list[tuple[Path, str]]:
    """(host folder, target) of each of the service's named volumes."""
    out = []
    for vol in svc.get("volumes", []):
        if isinstance(vol, str):
            src, dst = vol.split(":")[:2]
            if not src.startswith((".", "/", "~")):
                out.append((named[src], dst))
        elif vol["type"] == "volume":
            out.append((named[vol["source"]], vol["target"]))
    return out


def populate_new_volume(host: Path, image_root: Path, target: str) -> None:
    """What Docker does when a new, empty named volume is mounted where the image has a
    folder: the volume takes that folder's owner and mode (its content too; the image's
    mount points are empty). A volume that holds anything already is left alone."""
    inside = image_root / target.lstrip("/")
    if any(host.iterdir()) or not inside.is_dir():
        return
    st = inside.stat()
    os.chown(host, st.st_uid, st.st_gid)
    host.chmod(st.st_mode & 0o7777)


def volume_args(svc: dict[str, Any], named: dict[str, Path]) -> list[str]:
    """``--volume SRC:DST[:ro]`` for each of the service's volumes (short or long syntax)."""
    out = []
    for vol in svc.get("volumes", []):
        if isinstance(vol, str):
            src, dst, *mode = vol.split(":")
            read_only = mode == ["ro"]
            kind = "bind" if src.startswith((".", "/", "~")) else "volume"
        else:
            src, dst, read_only = vol["source"], vol["target"], bool(vol.get("read_only"))
            kind = vol["type"]
        if kind == "volume":
            host = named[src]
        elif kind == "bind":
            host = (REPO / os.path.expanduser(src)).resolve()
            if not host.exists():
                raise FileNotFoundError(f"bind source {src} of a volume does not exist")
        else:
            raise ValueError(f"volume type {kind!r} is not handled by the image test")
        out.append(f"{host}:{dst}{':ro' if read_only else ''}")
    return out


@dataclass
class FlowResult:
    exit_service: str
    returncode: int
    logs: dict[str, Path]
    volumes: dict[str, Path]
    seconds: dict[str, float] = field(default_factory=dict)

    def output(self, service: str) -> str:
        return self.logs[service].read_text(errors="replace")

    def events(self, relpath: str = "hybrid-draft.jsonl", volume: str = "events") -> list[dict]:
        path = self.volumes[volume] / relpath
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@contextmanager
def network_namespace(name: str) -> Iterator[str]:
    """A private network namespace (``ip netns``) with its loopback up."""
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def remove_leftover_namespaces() -> None:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(buildah.PREFIX):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def resolve(
    variables: dict[str, str],
    named: dict[str, Path],
    standin: dict[str, str],
    image_cfg: dict[str, dict[str, Any]],
) -> list[Service]:
    """compose.yaml's services under ``variables``, in ``depends_on`` order, with the CPU
    run's additions."""
    cpu = cpu_run()
    spec = compose({**cpu["variables"], **variables})
    services: dict[str, Service] = {}
    for name, svc in spec["services"].items():
        extra = cpu.get("services", {}).get(name, {})
        unknown = set(svc) - HANDLED - set(extra.get("not_applied", {}))
        if unknown:
            raise ValueError(
                f"compose.yaml's service {name} has {sorted(unknown)}, which the "
                f"image test neither runs nor lists in {CPU_RUN.name} "
                "(not_applied)"
            )
        cfg = image_cfg[svc["image"]]
        appended = [
            str(a).format(dtype=hostcpu.serving_dtype()) for a in extra.get("append_command", [])
        ]
        argv = argv_of(svc, cfg) + appended
        env = {**as_env(svc.get("environment")), **as_env(extra.get("environment"))}
        volumes = volume_args(svc, named)
        if extra.get("standin"):
            env.update(as_env(cpu["standin"]["environment"]))
            volumes += [f"{src}:{dst}:ro" for src, dst in standin.items()]
        deps = svc.get("depends_on", {})
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        s = Service(
            name=name,
            image=svc["image"],
            argv=argv,
            env=env,
            volumes=volumes,
            depends_on={d: c.get("condition", "service_started") for d, c in deps.items()},
            named_mounts=named_mounts(svc, named),
        )
        hc = svc.get("healthcheck")
        if hc and not hc.get("disable"):
            test = hc["test"]
            s.health = (
                (["sh", "-c", test[1]] if test[0] == "CMD-SHELL" else test[1:])
                if isinstance(test, list)
                else ["sh", "-c", test]
            )
            interval = duration(hc.get("interval"), 30)
            s.health_interval = duration(hc.get("start_interval"), interval)
            s.health_timeout = duration(hc.get("timeout"), 30)
            s.health_deadline = min(
                duration(hc.get("start_period"), 0) + interval * int(hc.get("retries", 3)),
                HEALTH_CAP_S,
            )
        services[name] = s
    order: list[Service] = []
    while len(order) < len(services):
        ready = [
            s
            for s in services.values()
            if s not in order and all(services[d] in order for d in s.depends_on)
        ]
        if not ready:
            raise ValueError("compose.yaml's depends_on has a cycle")
        order += ready
    return order


def wait_healthy(s: Service, netns: str) -> float:
    """Run the service's health check (in its container, with its mounts) until it passes."""
    assert s.container is not None and s.health is not None
    start = time.monotonic()
    while True:
        if s.proc is not None and s.proc.poll() is not None:
            raise RuntimeError(
                f"service {s.name} exited ({s.proc.returncode}) before it was "
                f"healthy:\n{tail(s.log)}"
            )
        try:
            out = s.container.run(
                s.health, env=s.env, netns=netns, volumes=s.volumes, timeout=s.health_timeout
            )
            if out.returncode == 0:
                return time.monotonic() - start
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() - start > s.health_deadline:
            raise TimeoutError(
                f"service {s.name} not healthy after {s.health_deadline:.0f} s:\n{tail(s.log)}"
            )
        time.sleep(s.health_interval)


def tail(path: Path | None, lines: int = 60) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def up(
    variables: dict[str, str],
    *,
    work: Path,
    named: dict[str, Path],
    standin: dict[str, str],
    image_cfg: dict[str, dict[str, Any]],
    exit_timeout: float = 900,
) -> FlowResult:
    """``docker compose up --exit-code-from X`` for the one service nothing depends on, X.

    Every container and process it starts is stopped and removed before it returns."""
    services = resolve(variables, named, standin, image_cfg)
    needed = {d for s in services for d in s.depends_on}
    (exit_service,) = [s for s in services if s.name not in needed]
    work.mkdir(parents=True, exist_ok=True)
    netns = f"{buildah.PREFIX}{os.getpid()}"
    result = FlowResult(
        exit_service.name, -1, {s.name: work / f"{s.name}.log" for s in services}, named
    )
    t0 = time.monotonic()
    hosts = {s.name: "127.0.0.1" for s in services}
    with network_namespace(netns):
        try:
            for s in services:
                for condition in s.depends_on.values():
                    if condition not in ("service_started", "service_healthy"):
                        raise ValueError(f"depends_on condition {condition} is not handled")
                s.log = result.logs[s.name]
                s.container = buildah.Container(s.image, f"{s.name}-{os.getpid()}", hosts)
                for host, target in s.named_mounts:
                    populate_new_volume(host, s.container.mount(), target)
                s.proc = s.container.start(
                    s.argv, env=s.env, volumes=s.volumes, netns=netns, log=s.log
                )
                if s is exit_service:
                    try:
                        result.returncode = s.proc.wait(timeout=exit_timeout)
                    except subprocess.TimeoutExpired:
                        raise TimeoutError(
                            f"service {s.name} still running after "
                            f"{exit_timeout:.0f} s:\n{tail(s.log)}"
                        ) from None
                elif s.health is not None and any(
                    t.depends_on.get(s.name) == "service_healthy" for t in services
                ):
                    result.seconds[f"{s.name}_healthy_s"] = wait_healthy(s, netns)
                result.seconds[f"{s.name}_done_s"] = time.monotonic() - t0
        finally:
            for s in reversed(services):
                if s.container is not None:
                    s.container.remove()
    return result
