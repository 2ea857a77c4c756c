"""The project's build files read as their tools read them: pins.txt, the Dockerfile's ARGs,
docker-bake.hcl (as ``docker buildx bake`` resolves a target) and compose.yaml (YAML, then
``${}`` interpolation, as Compose does).

Shared by the static checks (tests/test_image.py) and the buildah image test (tests/image),
so both read the same files the same way. Imports nothing of the project, vLLM or torch:
the image test runs it from a plain environment with PyYAML and python-hcl2.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


def pins() -> dict[str, str]:
    """``name==version`` lines of pins.txt (the one place for pins)."""
    out = {}
    for line in (REPO / "pins.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def vllm_releases() -> list[str]:
    """The supported vLLM releases of the CUDA image, oldest first: pins.txt's
    ``# vllm-releases:`` line (the newest is the image's default base)."""
    for line in (REPO / "pins.txt").read_text().splitlines():
        if line.startswith("# vllm-releases:"):
            releases = line.split(":", 1)[1].split()
            if releases:
                return releases
    raise ValueError(f"{REPO / 'pins.txt'}: no '# vllm-releases: X.Y.Z ...' line")


def image_vllm() -> str:
    """The vLLM release the image builds on by default: the newest supported one."""
    return vllm_releases()[-1]


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose/bake-style ``${VAR}`` and ``${VAR:-default}`` (defaults may nest ``${}``)."""
    pattern = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^${}]*))?\}")
    while True:
        new = pattern.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), text)
        if new == text:
            return new
        text = new


def dockerfile_args(path: Path = REPO / "Dockerfile") -> dict[str, str | None]:
    """Every ``ARG`` of a Dockerfile and its default (None: no default)."""
    args: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^ARG\s+([A-Z_]+)(?:=(\S+))?", line)
        if m and (m.group(2) is not None or m.group(1) not in args):
            args[m.group(1)] = m.group(2)
    return args


def bake() -> dict[str, Any]:
    """docker-bake.hcl's variables, groups and targets, string values unquoted."""
    import hcl2

    with open(REPO / "docker-bake.hcl") as f:
        raw = hcl2.load(f)

    def unquote(v: Any) -> Any:
        if isinstance(v, str):
            return v[1:-1] if len(v) >= 2 and v[0] == v[-1] == '"' else v
        if isinstance(v, list):
            return [unquote(x) for x in v]
        if isinstance(v, dict):
            return {unquote(k): unquote(x) for k, x in v.items() if k != "__is_block__"}
        return v

    out: dict[str, Any] = {}
    for kind in ("variable", "group", "target"):
        out[kind] = {k: v for block in unquote(raw.get(kind, [])) for k, v in block.items()}
    return out


def resolved_target(b: dict[str, Any], name: str) -> dict[str, Any]:
    """A bake target with what it inherits merged in (its own keys win), not interpolated."""
    target = dict(b["target"][name])
    merged: dict[str, Any] = {}
    for parent in target.pop("inherits", []):
        merged.update(resolved_target(b, parent))
    merged["args"] = {**merged.get("args", {}), **target.pop("args", {})}
    merged.update(target)
    return merged


def bake_defaults(b: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, str]:
    """The bake variables' values: from ``env`` when set there (as bake reads the
    environment), else their defaults, which may refer to each other."""
    env = env or {}
    values: dict[str, str] = {}
    for _ in range(3):
        values = {
            k: env.get(k) or interpolate(v["default"], values) for k, v in b["variable"].items()
        }
    return values


def bake_args(target: str = "local", env: dict[str, str] | None = None) -> dict[str, str]:
    """The build args ``docker buildx bake TARGET`` passes, with ``env`` as bake's
    environment (e.g. ``{"BASE_IMAGE": ...}``)."""
    b = bake()
    values = bake_defaults(b, env)
    return {k: interpolate(v, values) for k, v in resolved_target(b, target)["args"].items()}


def bake_tags(target: str = "local", env: dict[str, str] | None = None) -> list[str]:
    b = bake()
    values = bake_defaults(b, env)
    return [interpolate(t, values) for t in resolved_target(b, target)["tags"]]


def compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml as Compose resolves it: YAML first, then ``${}`` in string values."""

    def walk(node: Any) -> Any:
        if isinstance(node, str):
            return interpolate(node, env or {})
        if isinstance(node, list):
            return [walk(x) for x in node]
        if isinstance(node, dict):
            return {walk(k): walk(v) for k, v in node.items()}
        return node

    return walk(yaml.safe_load((REPO / "compose.yaml").read_text()))
