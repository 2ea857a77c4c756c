"""Settings: precedence (environment, file, default) and every kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybrid_draft import settings
from hybrid_draft.settings import ConfigError

pytestmark = pytest.mark.once  # the same on every vLLM release (docs/testing.md)

ACCEPTED_MODES = "auto, safetensors, instanttensor, selective"


def load(env: dict[str, str], toml: str | None = None, tmp: Path | None = None):
    if toml is not None:
        assert tmp is not None
        path = tmp / "hybrid-draft.toml"
        path.write_text(toml)
        env = {"HYBRID_DRAFT_CONFIG": str(path), **env}
    return settings.load(env)


def test_defaults_without_a_file(tmp_path: Path) -> None:
    s = settings.load({"HYBRID_DRAFT_CONFIG": str(tmp_path / "nothing.toml")})
    assert (s.mode.value, s.mode.source) == ("auto", "default")
    assert (s.level.value, s.events_file.value) == ("info", None)
    assert not s.config_exists


def test_default_path_is_etc() -> None:
    assert settings.config_path({}) == "/etc/hybrid-draft.toml"


def test_file_then_environment(tmp_path: Path) -> None:
    toml = '[draft]\nmode = "Safetensors "\n[log]\nlevel = "DEBUG"\nevents_file = "/x/e.jsonl"\n'
    s = load({}, toml, tmp_path)
    assert (s.mode.value, s.mode.source, s.mode.origin) == (
        "safetensors",
        "file",
        f"{tmp_path / 'hybrid-draft.toml'}:2",
    )
    assert (s.level.value, s.events_file.value) == ("debug", "/x/e.jsonl")
    s = load(
        {
            "INSTANTTENSOR_DRAFT_LOADER": " InstantTensor\n",
            "HYBRID_DRAFT_EVENTS_FILE": " /y/e.jsonl",
        },
        toml,
        tmp_path,
    )
    assert (s.mode.value, s.mode.source, s.mode.origin) == (
        "instanttensor",
        "env",
        "INSTANTTENSOR_DRAFT_LOADER",
    )
    assert s.events_file.value == " /y/e.jsonl"  # paths are taken as given
    assert s.level.source == "file"


def test_empty_environment_variable_counts_as_unset(tmp_path: Path) -> None:
    s = load(
        {"INSTANTTENSOR_DRAFT_LOADER": "", "HYBRID_DRAFT_LOG_LEVEL": "  "},
        '[draft]\nmode = "selective"\n',
        tmp_path,
    )
    assert (s.mode.value, s.mode.source) == ("selective", "file")
    assert s.level.source == "default"


def test_object_storage_bounds(tmp_path: Path) -> None:
    s = load({}, "[object_storage]\ntimeout = 2.5\nretries = 3\n", tmp_path)
    assert (s.object_timeout.value, s.object_timeout.source) == (2.5, "file")
    assert (s.object_retries.value, s.object_retries.origin) == (
        3,
        f"{tmp_path / 'hybrid-draft.toml'}:3",
    )
    s = load(
        {"HYBRID_DRAFT_OBJECT_TIMEOUT": " 30 ", "HYBRID_DRAFT_OBJECT_RETRIES": "1"}, "", tmp_path
    )
    assert (s.object_timeout.value, s.object_retries.value) == (30.0, 1)
    assert s.object_timeout.source == s.object_retries.source == "env"
    defaults = settings.load({"HYBRID_DRAFT_CONFIG": str(tmp_path / "none.toml")})
    assert (defaults.object_timeout.value, defaults.object_retries.value) == (10.0, 5)
    # Not among the settings that change what a load decides or reads.
    assert s.fingerprint() == defaults.fingerprint() == "43ce3f8a6513"


def test_the_reload_setting(tmp_path: Path) -> None:
    s = load({}, '[draft]\nreload = "OFF"\n', tmp_path)
    assert (s.reload.value, s.reload.source) == ("off", "file")
    s = load({"HYBRID_DRAFT_RELOAD": " auto "}, '[draft]\nreload = "off"\n', tmp_path)
    assert (s.reload.value, s.reload.source, s.reload.origin) == (
        "auto",
        "env",
        "HYBRID_DRAFT_RELOAD",
    )
    # It changes what a reload decides: off is in the fingerprint; the default keeps the
    # fingerprint of settings that do not name it.
    assert s.fingerprint() == "43ce3f8a6513"
    assert load({"HYBRID_DRAFT_RELOAD": "off"}, "", tmp_path).fingerprint() != s.fingerprint()


def test_dotted_keys_and_comments(tmp_path: Path) -> None:
    s = load({}, '# comment\ndraft.mode = "safetensors"  # trailing\n', tmp_path)
    assert s.mode.origin.endswith(":2")


@pytest.mark.parametrize(
    ("env", "source", "fragment"),
    [
        ({"INSTANTTENSOR_DRAFT_LOADER": "fast"}, "INSTANTTENSOR_DRAFT_LOADER", ACCEPTED_MODES),
        (
            {"HYBRID_DRAFT_LOG_LEVEL": "loud"},
            "HYBRID_DRAFT_LOG_LEVEL",
            "debug, info, warning, error",
        ),
        *(
            (
                {"HYBRID_DRAFT_OBJECT_TIMEOUT": bad},
                "HYBRID_DRAFT_OBJECT_TIMEOUT",
                "accepted: a number of seconds above 0 and at most 3600",
            )
            for bad in ("0", "-1", "nan", "inf", "3601", "10s", "")
            if bad
        ),
        ({"HYBRID_DRAFT_RELOAD": "no"}, "HYBRID_DRAFT_RELOAD", "accepted values: auto, off"),
        *(
            (
                {"HYBRID_DRAFT_PROGRESS_SECONDS": bad},
                "HYBRID_DRAFT_PROGRESS_SECONDS",
                "accepted: a number of seconds from 0 (none) to 86400",
            )
            for bad in ("-1", "off", "86401", "nan", "30s")
        ),
        *(
            (
                {"HYBRID_DRAFT_STALL_SECONDS": bad},
                "HYBRID_DRAFT_STALL_SECONDS",
                "accepted: a number of seconds above 0 and at most 86400",
            )
            for bad in ("0", "-2", "off", "inf")
        ),
        *(
            (
                {"HYBRID_DRAFT_LOAD_TIMEOUT": bad},
                "HYBRID_DRAFT_LOAD_TIMEOUT",
                "accepted: off or none, or a number of seconds above 0 and at most 86400",
            )
            for bad in ("0", "soon", "-5", "1e9")
        ),
        *(
            (
                {"HYBRID_DRAFT_OBJECT_RETRIES": bad},
                "HYBRID_DRAFT_OBJECT_RETRIES",
                "accepted: a whole number from 1 to 20",
            )
            for bad in ("0", "21", "2.0", "many")
        ),
    ],
)
def test_bad_environment_values(
    env: dict[str, str], source: str, fragment: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as info:
        settings.load({"HYBRID_DRAFT_CONFIG": str(tmp_path / "none.toml"), **env})
    assert info.value.source == source
    assert fragment in info.value.detail and repr(next(iter(env.values()))) in info.value.detail


@pytest.mark.parametrize(
    ("toml", "line", "fragment"),
    [
        ('[draft]\nmode = "fast"\n', 2, ACCEPTED_MODES),
        ("[draft]\nmode = 3\n", 2, "must be a string naming one of auto, safetensors"),
        (
            '[draft]\nmode = "auto"\nloader = "x"\n',
            3,
            "unknown key 'draft.loader'; accepted keys: draft.mode, draft.hold_budget, "
            "draft.skip_replaced, log.level, log.events_file, draft.keep_formats, "
            "object_storage.timeout, object_storage.retries, draft.reload, "
            "load.progress_seconds, load.stall_seconds, load.load_timeout",
        ),
        ('[draft]\nreload = "never"\n', 2, "accepted values: auto, off"),
        ("[object_storage]\ntimeout = true\n", 2, "accepted: a number of seconds above 0"),
        ("[object_storage]\nretries = 2.5\n", 2, "accepted: a whole number from 1 to 20"),
        ("[load]\nload_timeout = true\n", 2, "accepted: off or none, or a number of seconds"),
        ('[load]\nstall_seconds = "a minute"\n', 2, "accepted: a number of seconds above 0"),
        ("[load]\nprogress_seconds = -30\n", 2, "from 0 (none) to 86400"),
        ('[draft]\nmode = "auto"\n\n[cache]\nsize = 1\n', 4, "unknown key 'cache'"),
        ('[log]\nevents_file = ""\n', 2, "non-empty path"),
        ('[log]\nlevel = ["info"]\n', 2, "must be a string naming one of debug"),
        ('draft = "auto"\n', 1, "'draft' must be a table"),
        ('[draft]\nmode = "auto\n', 2, "invalid TOML"),
    ],
)
def test_bad_file_values_name_the_file_and_line(
    toml: str, line: int, fragment: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as info:
        load({}, toml, tmp_path)
    assert info.value.source == f"{tmp_path / 'hybrid-draft.toml'}:{line}"
    assert fragment in info.value.detail


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file") as info:
        settings.load({"HYBRID_DRAFT_CONFIG": str(tmp_path)})  # a directory
    assert info.value.source == str(tmp_path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(b'[draft]\nmode = "\xff"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        settings.load({"HYBRID_DRAFT_CONFIG": str(path)})


def test_an_environment_value_does_not_hide_a_broken_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        load({"INSTANTTENSOR_DRAFT_LOADER": "auto"}, "[draft]\nmoed = 'auto'\n", tmp_path)


def test_shipped_config_documents_every_key_with_its_default() -> None:
    import tomllib

    shipped = Path(__file__).resolve().parents[1] / "config" / "hybrid-draft.toml"
    text = shipped.read_text()
    data = tomllib.loads(text)
    s = settings.load({"HYBRID_DRAFT_CONFIG": str(shipped)})
    assert data == {
        "draft": {"mode": "auto", "hold_budget": "8GiB", "skip_replaced": True, "reload": "auto"},
        "log": {"level": "info"},
        "object_storage": {"timeout": 10, "retries": 5},
        "load": {"progress_seconds": 30, "stall_seconds": 60},
    }
    assert {name: v.value for name, v in s.values().items()} == {
        spec.name: spec.default for spec in settings.KEYS
    }
    for spec in settings.KEYS:
        assert spec.dotted.split(".")[1] in text and spec.env in text
    for key in (
        "INSTANTTENSOR_DRAFT_LOADER",
        "HYBRID_DRAFT_LOG_LEVEL",
        "HYBRID_DRAFT_EVENTS_FILE",
        "HYBRID_DRAFT_CONFIG",
    ):
        assert key in text
    for mode in ACCEPTED_MODES.split(", "):
        assert mode in text


def test_config_command(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[draft]\nmode = "selective"\n')
    env = {"PATH": "", "HYBRID_DRAFT_CONFIG": str(path), "HYBRID_DRAFT_LOG_LEVEL": "warning"}
    cli = [sys.executable, "-m", "hybrid_draft", "config"]
    out = subprocess.run([*cli, "--json"], env=env, capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert data["settings"]["mode"] == {
        "value": "selective",
        "source": "file",
        "origin": f"{path}:2",
    }
    assert data["settings"]["level"]["source"] == "env"
    assert data["config_file"] == {"path": str(path), "exists": True}
    human = subprocess.run(cli, env=env, capture_output=True, text=True, check=True).stdout
    assert "selective" in human and f"{path}:2" in human
    bad = subprocess.run(
        cli, env={**env, "INSTANTTENSOR_DRAFT_LOADER": "nope"}, capture_output=True, text=True
    )
    assert bad.returncode != 0
    assert "INSTANTTENSOR_DRAFT_LOADER" in bad.stderr and ACCEPTED_MODES in bad.stderr


def _fifo(p: Path) -> Path:
    os.mkfifo(p)
    return p


def _dev_zero(p: Path) -> Path:
    p.symlink_to("/dev/zero")
    return p


def _huge(p: Path) -> Path:
    with open(p, "wb") as f:
        f.truncate(settings.CONFIG_LIMIT + 1)
    return p


def _deep(p: Path) -> Path:
    p.write_text("[draft]\nmode = " + "[" * 100_000 + "]" * 100_000 + "\n")
    return p


def _under_a_file(p: Path) -> Path:
    p.write_text("")
    return p / "hybrid-draft.toml"


@pytest.mark.parametrize(
    ("make", "detail"),
    [
        (_fifo, "cannot read the config file: a FIFO, not a regular file"),
        (_dev_zero, "cannot read the config file: a character device, not a regular file"),
        (_huge, "over the limit of 1,048,576 bytes"),
        (_deep, "invalid TOML: nested too deeply to parse"),
        (_under_a_file, "cannot read the config file: Not a directory"),
    ],
)
def test_every_failure_of_the_file_is_a_config_error_naming_it(
    make: Any, detail: str, tmp_path: Path
) -> None:
    path = make(tmp_path / "c.toml")
    with pytest.raises(ConfigError) as info:
        settings.load({"HYBRID_DRAFT_CONFIG": str(path)})
    assert info.value.source == str(path) and detail in info.value.detail
    assert "\n" not in str(info.value)


def test_a_long_or_odd_value_is_shown_short_and_on_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        settings.load(
            {
                "HYBRID_DRAFT_CONFIG": str(tmp_path / "none.toml"),
                "INSTANTTENSOR_DRAFT_LOADER": "x\n" * 10_000,
            }
        )
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_the_watch_of_a_long_load_by_environment_and_file(tmp_path: Path) -> None:
    """``[load]``: the values a user writes, each from where it was set; 0 turns progress off,
    ``off``/``none`` (any case) the bound; none of them changes what a load decides (the
    fingerprint)."""
    s = load({"HYBRID_DRAFT_LOAD_TIMEOUT": " OFF "}, "[load]\nprogress_seconds = 0\n", tmp_path)
    assert (s.progress_seconds.value, s.progress_seconds.source) == (0.0, "file")
    assert (s.load_timeout.value, s.load_timeout.source) == (None, "env")
    assert (s.stall_seconds.value, s.stall_seconds.source) == (60.0, "default")
    s = load(
        {"HYBRID_DRAFT_STALL_SECONDS": "2.5"},
        '[load]\nload_timeout = 600\nstall_seconds = 9\nprogress_seconds = "0.5"\n',
        tmp_path,
    )
    assert (s.stall_seconds.value, s.stall_seconds.source) == (2.5, "env")
    assert (s.load_timeout.value, s.progress_seconds.value) == (600.0, 0.5)
    assert s.fingerprint() == "43ce3f8a6513"
