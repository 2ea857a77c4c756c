"""Settings: the environment, then the TOML file, then the defaults (docs/contract.md).

Each value keeps where it came from (``env``, ``file`` or ``default``) so that events and
``hybrid-draft config`` can say it. Every failure of a source raises :class:`ConfigError`,
which names the source (the variable, or the file and line) and the accepted values: a file
that is not a regular file (a FIFO, ``/dev/zero``, a directory), one over
:data:`CONFIG_LIMIT`, one nested too deeply to parse, as much as an unknown key. The hook
catches exactly that class, so no bad source can switch the layer off in silence. Reading
is cheap (one small file, never a blocking open), so callers read afresh at each load.

A Ray worker on another host than the driver also gets the driver's effective settings in
``HYBRID_DRAFT_DRIVER_SETTINGS`` (``adapter/ray_env.py`` puts them there when vLLM starts
its workers). There they take the place of that host's own file and defaults, so that every
rank of one server decides alike; a variable set in the worker's own environment still wins.
On the driver's own host the variable is ignored: the file there is the driver's file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from hybrid_draft import files

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the image and the tests run 3.11+
    import tomli as tomllib

MODES = ("auto", "safetensors", "instanttensor", "selective")
#: What the layer does about the draft when vLLM reloads the target's weights in place:
#: ``auto`` reloads it in the same call, ``off`` leaves it to vLLM (which reloads none).
RELOADS = ("auto", "off")
LEVELS = ("debug", "info", "warning", "error")

DEFAULT_CONFIG_PATH = "/etc/hybrid-draft.toml"
#: The largest config file read (bytes); the documented file is well under 2 kB.
CONFIG_LIMIT = 1 << 20
ENV_CONFIG = "HYBRID_DRAFT_CONFIG"
ENV_MODE = "INSTANTTENSOR_DRAFT_LOADER"
ENV_LEVEL = "HYBRID_DRAFT_LOG_LEVEL"
ENV_EVENTS_FILE = "HYBRID_DRAFT_EVENTS_FILE"
ENV_HOLD_BUDGET = "HYBRID_DRAFT_HOLD_BUDGET"
ENV_SKIP_REPLACED = "HYBRID_DRAFT_SKIP_REPLACED"
ENV_DRIVER = "HYBRID_DRAFT_DRIVER_SETTINGS"
ENV_KEEP_FORMATS = "HYBRID_DRAFT_KEEP_FORMATS"
ENV_OBJECT_TIMEOUT = "HYBRID_DRAFT_OBJECT_TIMEOUT"
ENV_OBJECT_RETRIES = "HYBRID_DRAFT_OBJECT_RETRIES"
ENV_RELOAD = "HYBRID_DRAFT_RELOAD"
ENV_PROGRESS_SECONDS = "HYBRID_DRAFT_PROGRESS_SECONDS"
ENV_STALL_SECONDS = "HYBRID_DRAFT_STALL_SECONDS"
ENV_LOAD_TIMEOUT = "HYBRID_DRAFT_LOAD_TIMEOUT"
#: The target load formats whose drafts the layer can read filtered (``policy.TARGET_FORMATS``,
#: repeated here: settings sits below the policy); ``keep_formats`` keeps any untouched.
TARGET_FORMATS = ("instanttensor", "fastsafetensors", "runai_streamer")
SOURCES = ("env", "file", "default")

#: The settings that change what a load decides or reads: the fingerprint covers exactly
#: these. The log level and the events file change only what is reported (and an events
#: file is often a per-host path), so ranks that load alike keep one fingerprint. It covers
#: ``keep_formats`` and ``reload`` too, when set to other than their defaults.
DECISION_SETTINGS = ("mode", "hold_budget", "skip_replaced")
#: The settings the fingerprint covers only where they are not these defaults: the
#: fingerprints of settings that do not name them stay what earlier releases gave.
DECISION_SETTINGS_IF_SET: Mapping[str, Any] = MappingProxyType(
    {"keep_formats": (), "reload": "auto"}
)

#: What the target's InstantTensor pass may keep in memory for the draft (docs/design.md).
DEFAULT_HOLD_BUDGET = 8 << 30
#: Each request to object storage: seconds without a byte of its answer before it is cut
#: (and retried), and how many times a failed one is retried (docs/contract.md).
DEFAULT_OBJECT_TIMEOUT = 10.0
DEFAULT_OBJECT_RETRIES = 5
#: The accepted ranges of those two.
OBJECT_TIMEOUT_RANGE = (0.0, 3600.0)
OBJECT_RETRIES_RANGE = (1, 20)
#: How a long load is watched ([load]): a progress event every ``progress_seconds`` (0: none),
#: a stall named after ``stall_seconds`` without a byte, a stalled load failed after
#: ``load_timeout`` (off by default). Each at most a day.
DEFAULT_PROGRESS_SECONDS = 30.0
DEFAULT_STALL_SECONDS = 60.0
WATCH_RANGE = (0.0, 86400.0)
#: The words that turn ``load_timeout`` off.
OFF = ("off", "none")
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
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)")

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
    #: Target formats whose drafts the layer leaves as vLLM loads them (``keep_formats``).
    keep_formats: Value = field(default_factory=lambda: Value((), "default", "default"))
    #: Each request to object storage: its timeout (seconds) and how often it is retried.
    object_timeout: Value = field(
        default_factory=lambda: Value(DEFAULT_OBJECT_TIMEOUT, "default", "default")
    )
    object_retries: Value = field(
        default_factory=lambda: Value(DEFAULT_OBJECT_RETRIES, "default", "default")
    )
    #: Whether a reload of the target's weights reloads the draft too (``auto``, ``off``).
    reload: Value = field(default_factory=lambda: Value("auto", "default", "default"))
    #: A long load watched: progress every so many seconds (0: none), a stall named after
    #: so many without a byte, a stalled load failed after so many (None: never).
    progress_seconds: Value = field(
        default_factory=lambda: Value(DEFAULT_PROGRESS_SECONDS, "default", "default")
    )
    stall_seconds: Value = field(
        default_factory=lambda: Value(DEFAULT_STALL_SECONDS, "default", "default")
    )
    load_timeout: Value = field(default_factory=lambda: Value(None, "default", "default"))
    #: The host whose settings were carried here (``HYBRID_DRAFT_DRIVER_SETTINGS``), if any.
    carried_from: str | None = None

    def values(self) -> dict[str, Value]:
        """Every setting by name, in the order of the config file."""
        return {key.name: getattr(self, key.name) for key in KEYS}

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape ``hybrid-draft config --json`` prints."""
        out: dict[str, Any] = {
            "config_file": {"path": self.config_path, "exists": self.config_exists},
            "settings": {
                name: {"value": v.value, "source": v.source, "origin": v.origin}
                for name, v in self.values().items()
            },
            "settings_fingerprint": self.fingerprint(),
        }
        if self.carried_from is not None:
            out["carried_from"] = self.carried_from
        return out

    @property
    def sink(self) -> tuple[str, str | None]:
        """Where this snapshot's events go: (level, events file)."""
        return (str(self.level.value), self.events_file.value)

    def fingerprint(self) -> str:
        """A short hash of the values in :data:`DECISION_SETTINGS`: equal on every rank and
        host whose settings load alike, whichever source each value came from."""
        values = {name: getattr(self, name).value for name in DECISION_SETTINGS}
        for name, default in DECISION_SETTINGS_IF_SET.items():
            value = getattr(self, name).value
            if value != default:
                values[name] = list(value) if isinstance(value, tuple) else value
        data = json.dumps(values, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(data.encode()).hexdigest()[:12]

    def carry(self, node: str) -> str:
        """These settings as the value of ``HYBRID_DRAFT_DRIVER_SETTINGS``, from ``node``."""
        return json.dumps(
            {
                "node": node,
                "config_file": {"path": self.config_path, "exists": self.config_exists},
                "settings": {
                    name: {"value": v.value, "source": v.source, "origin": v.origin}
                    for name, v in self.values().items()
                },
            },
            sort_keys=True,
        )


@dataclass(frozen=True)
class Key:
    """One setting: its TOML key, its variable, its default and what it accepts."""

    name: str
    table: str
    key: str
    env: str
    default: Any
    kind: Literal[
        "choice", "path", "size", "bool", "formats", "seconds", "count", "period", "limit"
    ]
    choices: tuple[str, ...] = ()
    #: A number of seconds' range, the lower end excluded (``seconds``, ``limit``) or
    #: included as "none" (``period``: 0 turns it off).
    bounds: tuple[float, float] = OBJECT_TIMEOUT_RANGE

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
            "formats": "accepted: a comma-separated list (a TOML array) of "
            f"{', '.join(self.choices)}; empty for none",
            "seconds": "accepted: a number of seconds above "
            f"{self.bounds[0]:g} and at most {self.bounds[1]:g}",
            "period": f"accepted: a number of seconds from 0 (none) to {self.bounds[1]:g}",
            "limit": f"accepted: {' or '.join(OFF)}, or a number of seconds above "
            f"{self.bounds[0]:g} and at most {self.bounds[1]:g}",
            "count": "accepted: a whole number from "
            f"{OBJECT_RETRIES_RANGE[0]} to {OBJECT_RETRIES_RANGE[1]}",
        }[self.kind]

    def parse(self, raw: Any, source: str) -> Any:
        """The value of ``raw`` (a variable's text, or a TOML value) or a ConfigError."""
        what = f"{self.dotted!r}" if source != self.env else self.name

        def bad() -> ConfigError:
            shown = files.show(raw if isinstance(raw, str) else f"{type(raw).__name__} {raw!r}")
            return ConfigError(source, f"{shown} is not a valid {what}; {self.accepted()}")

        if self.kind == "bool":
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
                return raw.strip().lower() in _TRUE
            raise bad()
        if self.kind == "formats":
            items = raw.split(",") if isinstance(raw, str) else raw
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise bad()
            names = [i.strip().lower() for i in items if i.strip()]
            if any(n not in self.choices for n in names):
                raise bad()
            return tuple(sorted(set(names)))
        if self.kind == "limit" and (
            raw is None or (isinstance(raw, str) and raw.strip().lower() in OFF)
        ):
            return None
        if self.kind in ("seconds", "limit", "period"):
            return _number(raw, False, bad, self.bounds, zero=self.kind == "period")
        if self.kind == "count":
            return _number(raw, True, bad)
        if self.kind == "size":
            if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
                return raw
            m = (  # stripped first: no two patterns here can share a character (linear)
                _SIZE.fullmatch(raw.strip()) if isinstance(raw, str) and len(raw) < 200 else None
            )
            if m is None or m.group(2).lower() not in _UNITS:
                raise bad()
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if not isinstance(raw, str):
            kind = (
                f"a string naming one of {', '.join(self.choices)}" if self.choices else ("a path")
            )
            raise ConfigError(
                source, f"{what} must be {kind}, got {type(raw).__name__} {files.show(raw)}"
            )
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
    Key("keep_formats", "draft", "keep_formats", ENV_KEEP_FORMATS, (), "formats", TARGET_FORMATS),
    Key(
        "object_timeout",
        "object_storage",
        "timeout",
        ENV_OBJECT_TIMEOUT,
        DEFAULT_OBJECT_TIMEOUT,
        "seconds",
    ),
    Key(
        "object_retries",
        "object_storage",
        "retries",
        ENV_OBJECT_RETRIES,
        DEFAULT_OBJECT_RETRIES,
        "count",
    ),
    Key("reload", "draft", "reload", ENV_RELOAD, "auto", "choice", RELOADS),
    Key(
        "progress_seconds",
        "load",
        "progress_seconds",
        ENV_PROGRESS_SECONDS,
        DEFAULT_PROGRESS_SECONDS,
        "period",
        bounds=WATCH_RANGE,
    ),
    Key(
        "stall_seconds",
        "load",
        "stall_seconds",
        ENV_STALL_SECONDS,
        DEFAULT_STALL_SECONDS,
        "seconds",
        bounds=WATCH_RANGE,
    ),
    Key(
        "load_timeout", "load", "load_timeout", ENV_LOAD_TIMEOUT, None, "limit", bounds=WATCH_RANGE
    ),
)
_KEYS = {(k.table, k.key): k for k in KEYS}
_ACCEPTED_KEYS = ", ".join(k.dotted for k in KEYS)


def _number(
    raw: Any,
    whole: bool,
    bad: Any,
    bounds: tuple[float, float] = OBJECT_TIMEOUT_RANGE,
    zero: bool = False,
) -> float | int:
    """A number of seconds (in ``bounds``, the lower end excluded; with ``zero``, 0 too) or
    a ``count`` (a whole number in :data:`OBJECT_RETRIES_RANGE`), from a variable's text or
    a TOML number; ``bad()`` (a ConfigError) for anything else."""
    value: float | int
    if isinstance(raw, bool):
        raise bad()
    if isinstance(raw, (int, float)):
        value = raw
    elif isinstance(raw, str) and len(raw) < 40:
        text = raw.strip()
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            raise bad() from None
    else:
        raise bad()
    if whole:
        low, high = OBJECT_RETRIES_RANGE
        if not isinstance(value, int) or not low <= value <= high:
            raise bad()
        return value
    low_s, high_s = bounds
    if zero and float(value) == 0:
        return 0.0
    if not (low_s < float(value) <= high_s):  # NaN fails too
        raise bad()
    return float(value)


def this_node() -> str:
    """This host's name: what ``node`` says in events, and what carried settings compare."""
    return socket.gethostname()


def carry_error(exc: ConfigError, node: str) -> str:
    """An invalid driver configuration, carried so that its workers fail the same way."""
    return json.dumps(
        {"node": node, "error": {"source": exc.source, "detail": exc.detail}}, sort_keys=True
    )


def config_path(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(ENV_CONFIG) or DEFAULT_CONFIG_PATH


_HEADER = re.compile(r"\s*\[([^\[\]]*)\]\s*(?:#.*)?")
_TABLE_NAME = re.compile(r"[A-Za-z0-9_.\-\"' ]+")


def _key_line(text: str, table: str, key: str | None) -> int | None:
    """The 1-based line of ``[table]`` / ``key =`` in a TOML text (None if not found).

    Linear in the text: no pattern here can backtrack over a long line.
    """
    current = ""
    for number, line in enumerate(text.splitlines(), 1):
        m = _HEADER.fullmatch(line)
        if m and _TABLE_NAME.fullmatch(m.group(1).strip()):
            current = m.group(1).strip().replace('"', "").replace("'", "")
            current = ".".join(part.strip() for part in current.split("."))
            if key is None and current == table:
                return number
            continue
        stripped = line.strip()
        if key is None or not stripped or stripped.startswith("#"):
            continue
        name = stripped.partition("=")[0].strip().strip("\"'")
        if (current == table and name == key) or (current == "" and name == f"{table}.{key}"):
            return number
    return None


def _where(path: str, text: str, table: str, key: str | None = None) -> str:
    line = _key_line(text, table, key)
    shown = files.show_path(path)
    return f"{shown}:{line}" if line else shown


def _choice(raw: str, accepted: tuple[str, ...], source: str, what: str) -> str:
    value = raw.strip().lower()
    if value not in accepted:
        raise ConfigError(
            source,
            f"{files.show(raw)} is not a valid {what}; accepted values: {', '.join(accepted)}",
        )
    return value


def _read_file(path: str) -> tuple[dict[str, Any], str] | None:
    """The parsed file and its text, or None when there is no file at ``path``.

    Only a regular file of at most :data:`CONFIG_LIMIT` bytes is read, and never with an
    open that can block; every way the file can fail is a :class:`ConfigError`.
    """
    try:
        text = files.read_text(path, CONFIG_LIMIT)
    except FileNotFoundError:
        return None
    except files.FileProblem as exc:
        raise ConfigError(
            files.show_path(path), f"cannot read the config file: {exc.detail}"
        ) from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"line (\d+)", str(exc))
        shown = files.show_path(path)
        where = f"{shown}:{m.group(1)}" if m else shown
        raise ConfigError(where, f"invalid TOML: {files.one_line(str(exc))}") from None
    except RecursionError:
        raise ConfigError(
            files.show_path(path), "invalid TOML: nested too deeply to parse"
        ) from None
    except MemoryError:
        raise ConfigError(
            files.show_path(path), "invalid TOML: too large to parse in memory"
        ) from None


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
            raise ConfigError(
                where, f"unknown key {files.show(table)}; accepted keys: {_ACCEPTED_KEYS}"
            )
        if not isinstance(content, dict):
            raise ConfigError(
                _where(path, text, "", table),
                f"{files.show(table)} must be a table ([{table}]); accepted keys: {_ACCEPTED_KEYS}",
            )
        for key, raw in content.items():
            where = _where(path, text, table, key)
            if (table, key) not in _KEYS:
                raise ConfigError(
                    where,
                    f"unknown key {files.show(f'{table}.{key}')}; accepted keys: {_ACCEPTED_KEYS}",
                )
            spec = _KEYS[(table, key)]
            values[spec.name] = Value(spec.parse(raw, where), "file", where)
    return values


_CARRIED_SHAPE = (
    "must be the JSON object hybrid-draft writes on a Ray driver "
    '({"node": ..., "settings": {...}}); unset it to use this host\'s own settings'
)


def _carried(env: Mapping[str, str], node: str) -> tuple[dict[str, Value], str, bool, str] | None:
    """The driver's settings carried in ``HYBRID_DRAFT_DRIVER_SETTINGS`` (values, config
    path, whether it existed, the driver's host), or None where none apply: the variable is
    unset, or this is the driver's own host."""
    raw = env.get(ENV_DRIVER, "")
    if not raw.strip():
        return None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(ENV_DRIVER, f"not JSON ({exc}); {_CARRIED_SHAPE}") from exc
    driver = data.get("node") if isinstance(data, dict) else None
    if not isinstance(driver, str) or not driver:
        raise ConfigError(ENV_DRIVER, _CARRIED_SHAPE)
    if driver == node:
        return None
    error = data.get("error")
    if error is not None:
        source = error.get("source") if isinstance(error, dict) else None
        detail = error.get("detail") if isinstance(error, dict) else None
        raise ConfigError(f"{ENV_DRIVER} (the driver on {driver}: {source})", str(detail))
    carried = data.get("settings")
    config = data.get("config_file")
    if not isinstance(carried, dict) or not isinstance(config, dict):
        raise ConfigError(ENV_DRIVER, _CARRIED_SHAPE)
    values: dict[str, Value] = {}
    for spec in KEYS:
        item = carried.get(spec.name)
        if not isinstance(item, dict):
            raise ConfigError(ENV_DRIVER, f"no setting {spec.name!r}; {_CARRIED_SHAPE}")
        value, source, origin = item.get("value"), item.get("source"), item.get("origin")
        where = f"{ENV_DRIVER} ({spec.name} from {driver})"
        if source not in SOURCES or not isinstance(origin, str):
            raise ConfigError(where, f"source must be one of {', '.join(SOURCES)}")
        if value is not None or spec.default is not None:
            value = spec.parse(value, where)
        values[spec.name] = Value(value, source, f"{origin} on {driver} (via {ENV_DRIVER})")
    return values, str(config.get("path")), bool(config.get("exists")), driver


def load(environ: Mapping[str, str] | None = None, *, node: str | None = None) -> Settings:
    """The effective settings; raises :class:`ConfigError`, and nothing else, for any
    invalid source (the one class the hook catches to stop a load).

    Per setting: this process's environment variable, then the driver's carried settings
    (on a host other than ``node``, this host's name by default), then the file, then the
    default. Where the driver's settings are carried, this host's file is not read.
    """
    env = os.environ if environ is None else environ
    path = config_path(env)
    driver: str | None = None
    try:
        carried = _carried(env, this_node() if node is None else node)
        if carried is not None:
            from_file, path, exists, driver = carried
        else:
            parsed = _read_file(path)
            exists = parsed is not None
            from_file = _file_values(path, *parsed) if parsed else {}
    except ConfigError:
        raise
    except Exception as exc:  # a failure no check above foresaw is still the source's
        source = ENV_DRIVER if env.get(ENV_DRIVER, "").strip() else files.show_path(path)
        raise ConfigError(
            source,
            f"cannot use these settings: {type(exc).__name__}: {files.one_line(str(exc))}",
        ) from None
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
    return Settings(config_path=path, config_exists=exists, carried_from=driver, **result)


def load_lenient(
    environ: Mapping[str, str] | None = None, *, node: str | None = None
) -> tuple[Settings | None, ConfigError | None]:
    """Like :func:`load`, but returns the error instead of raising it."""
    try:
        return load(environ, node=node), None
    except ConfigError as exc:
        return None, exc


def process_sink(environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """Where an event outside any load goes (the layer's activation, a part switched off):
    the settings' sink, else whatever of it is still valid. Read once by its caller."""
    current, _ = load_lenient(environ)
    return current.sink if current is not None else event_sink(environ)


def event_sink(environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """Level and events file for reporting a config error: whatever is still valid."""
    env = os.environ if environ is None else environ
    level = env.get(ENV_LEVEL, "").strip().lower()
    return (level if level in LEVELS else "info"), (env.get(ENV_EVENTS_FILE) or None)
