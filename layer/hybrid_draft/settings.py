"""Settings: the environment, then the TOML file, then the defaults (CONTRACT.md's table).

Each value keeps where it came from (``env``, ``file`` or ``default``) so that events and
``hybrid-draft config`` can say it. Bad input raises :class:`ConfigError`, which names the
source (the variable, or the file and line) and the accepted values. Reading is cheap
(one small file), so callers read afresh at each model load.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the image and the tests run 3.11+
    import tomli as tomllib

MODES = ("auto", "safetensors", "instanttensor", "selective")
LEVELS = ("debug", "info", "warning", "error")

DEFAULT_CONFIG_PATH = "/etc/hybrid-draft.toml"
ENV_CONFIG = "HYBRID_DRAFT_CONFIG"
ENV_MODE = "INSTANTTENSOR_DRAFT_LOADER"
ENV_LEVEL = "HYBRID_DRAFT_LOG_LEVEL"
ENV_EVENTS_FILE = "HYBRID_DRAFT_EVENTS_FILE"
ENV_HOLD_BUDGET = "HYBRID_DRAFT_HOLD_BUDGET"
ENV_SKIP_REPLACED = "HYBRID_DRAFT_SKIP_REPLACED"

#: What the target's InstantTensor pass may keep in memory for the draft (README, "One pass").
DEFAULT_HOLD_BUDGET = 8 << 30
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 1000,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 1000**2,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 1000**3,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 1000**4,
}
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")

Source = Literal["env", "file", "default"]


class ConfigError(ValueError):
    """An invalid setting; ``source`` names where it came from, ``detail`` says what is wrong."""

    def __init__(self, source: str, detail: str) -> None:
        super().__init__(f"{source}: {detail}")
        self.source = source
        self.detail = detail


@dataclass(frozen=True)
class Value:
    """One effective setting and its origin (``origin`` is the variable or ``file:line``)."""

    value: Any
    source: Source
    origin: str


@dataclass(frozen=True)
class Settings:
    mode: Value
    level: Value
    events_file: Value
    hold_budget: Value
    skip_replaced: Value
    config_path: str
    config_exists: bool

    def values(self) -> dict[str, Value]:
        """Every setting by name, in the order of the config file."""
        return {key.name: getattr(self, key.name) for key in KEYS}

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape ``hybrid-draft config --json`` prints."""
        return {
            "config_file": {"path": self.config_path, "exists": self.config_exists},
            "settings": {
                name: {"value": v.value, "source": v.source, "origin": v.origin}
                for name, v in self.values().items()
            },
        }


@dataclass(frozen=True)
class Key:
    """One setting: its TOML key, its variable, its default and what it accepts."""

    name: str
    table: str
    key: str
    env: str
    default: Any
    kind: Literal["choice", "path", "size", "bool"]
    choices: tuple[str, ...] = ()

    @property
    def dotted(self) -> str:
        return f"{self.table}.{self.key}"

    def accepted(self) -> str:
        return {
            "choice": f"accepted values: {', '.join(self.choices)}",
            "path": "accepted: a non-empty path",
            "size": "accepted: a byte count (an integer, or a number with a unit such as "
            "512MiB, 8GiB, 2GB; 0 turns it off)",
            "bool": f"accepted values: {', '.join(_TRUE + _FALSE)}",
        }[self.kind]

    def parse(self, raw: Any, source: str) -> Any:
        """The value of ``raw`` (a variable's text, or a TOML value) or a ConfigError."""
        what = f"{self.dotted!r}" if source != self.env else self.name

        def bad() -> ConfigError:
            shown = raw if isinstance(raw, str) else f"{type(raw).__name__} {raw!r}"
            return ConfigError(source, f"{shown!r} is not a valid {what}; {self.accepted()}")

        if self.kind == "bool":
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
                return raw.strip().lower() in _TRUE
            raise bad()
        if self.kind == "size":
            if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
                return raw
            m = (
                re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", raw)
                if isinstance(raw, str)
                else None
            )
            if m is None or m.group(2).lower() not in _UNITS:
                raise bad()
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if not isinstance(raw, str):
            kind = (
                f"a string naming one of {', '.join(self.choices)}" if self.choices else ("a path")
            )
            raise ConfigError(source, f"{what} must be {kind}, got {type(raw).__name__} {raw!r}")
        if self.kind == "choice":
            return _choice(raw, self.choices, source, what)
        if raw == "":
            raise ConfigError(
                source, f"{what} must be a non-empty path (leave the key out for no events file)"
            )
        return raw


KEYS = (
    Key("mode", "draft", "mode", ENV_MODE, "auto", "choice", MODES),
    Key("hold_budget", "draft", "hold_budget", ENV_HOLD_BUDGET, DEFAULT_HOLD_BUDGET, "size"),
    Key("skip_replaced", "draft", "skip_replaced", ENV_SKIP_REPLACED, True, "bool"),
    Key("level", "log", "level", ENV_LEVEL, "info", "choice", LEVELS),
    Key("events_file", "log", "events_file", ENV_EVENTS_FILE, None, "path"),
)
_KEYS = {(k.table, k.key): k for k in KEYS}
_ACCEPTED_KEYS = ", ".join(k.dotted for k in KEYS)


def config_path(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(ENV_CONFIG) or DEFAULT_CONFIG_PATH


def _key_line(text: str, table: str, key: str | None) -> int | None:
    """The 1-based line of ``[table]`` / ``key =`` in a TOML text (None if not found)."""
    current = ""
    header = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]\s*(#.*)?$")
    for number, line in enumerate(text.splitlines(), 1):
        m = header.match(line)
        if m:
            current = m.group(1).replace('"', "").replace("'", "")
            if key is None and current == table:
                return number
            continue
        stripped = line.strip()
        if key is None or not stripped or stripped.startswith("#"):
            continue
        name = re.split(r"\s*=", stripped, maxsplit=1)[0].strip().strip("\"'")
        if (current == table and name == key) or (current == "" and name == f"{table}.{key}"):
            return number
    return None


def _where(path: str, text: str, table: str, key: str | None = None) -> str:
    line = _key_line(text, table, key)
    return f"{path}:{line}" if line else path


def _choice(raw: str, accepted: tuple[str, ...], source: str, what: str) -> str:
    value = raw.strip().lower()
    if value not in accepted:
        raise ConfigError(
            source, f"{raw!r} is not a valid {what}; accepted values: {', '.join(accepted)}"
        )
    return value


def _read_file(path: str) -> tuple[dict[str, Any], str] | None:
    """The parsed file and its text, or None when there is no file at ``path``."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(path, f"cannot read the config file: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
        return tomllib.loads(text), text
    except UnicodeDecodeError as exc:
        raise ConfigError(path, f"not UTF-8 text: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"line (\d+)", str(exc))
        where = f"{path}:{m.group(1)}" if m else path
        raise ConfigError(where, f"invalid TOML: {exc}") from exc


def _file_values(path: str, data: dict[str, Any], text: str) -> dict[str, Value]:
    values: dict[str, Value] = {}
    tables = {t for t, _ in _KEYS}
    for table, content in data.items():
        if table not in tables:
            where = (
                _where(path, text, table)
                if isinstance(content, dict)
                else _where(path, text, "", table)
            )
            raise ConfigError(where, f"unknown key {table!r}; accepted keys: {_ACCEPTED_KEYS}")
        if not isinstance(content, dict):
            raise ConfigError(
                _where(path, text, "", table),
                f"{table!r} must be a table ([{table}]); accepted keys: {_ACCEPTED_KEYS}",
            )
        for key, raw in content.items():
            where = _where(path, text, table, key)
            if (table, key) not in _KEYS:
                raise ConfigError(
                    where, f"unknown key '{table}.{key}'; accepted keys: {_ACCEPTED_KEYS}"
                )
            spec = _KEYS[(table, key)]
            values[spec.name] = Value(spec.parse(raw, where), "file", where)
    return values


def load(environ: Mapping[str, str] | None = None) -> Settings:
    """The effective settings; raises :class:`ConfigError` on any invalid source."""
    env = os.environ if environ is None else environ
    path = config_path(env)
    parsed = _read_file(path)
    from_file = _file_values(path, *parsed) if parsed else {}
    result: dict[str, Value] = {}
    for spec in KEYS:
        raw = env.get(spec.env, "")
        if raw.strip():
            value = raw if spec.kind == "path" else spec.parse(raw, spec.env)
            result[spec.name] = Value(value, "env", spec.env)
        elif spec.name in from_file:
            result[spec.name] = from_file[spec.name]
        else:
            result[spec.name] = Value(spec.default, "default", "default")
    return Settings(config_path=path, config_exists=parsed is not None, **result)


def load_lenient(
    environ: Mapping[str, str] | None = None,
) -> tuple[Settings | None, ConfigError | None]:
    """Like :func:`load`, but returns the error instead of raising it."""
    try:
        return load(environ), None
    except ConfigError as exc:
        return None, exc


def event_sink(environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """Level and events file for reporting a config error: whatever is still valid."""
    env = os.environ if environ is None else environ
    level = env.get(ENV_LEVEL, "").strip().lower()
    return (level if level in LEVELS else "info"), (env.get(ENV_EVENTS_FILE) or None)
