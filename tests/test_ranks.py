"""One decision across ranks and nodes: the settings fingerprint, the driver's settings
carried to Ray workers (through vLLM's own env-copy functions, wrapped by the installed
layer), node and rank on every decision and load, and ``report``'s ``inconsistent``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import Events, Recorder, engine_config, load_target_and_draft
from hybrid_draft import settings
from hybrid_draft.settings import ConfigError
from hybrid_draft.tools import report

DRIVER = "driver-host"
WORKER = "worker-host"


def _file(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


# --- the fingerprint ------------------------------------------------------------------------


def test_the_fingerprint_covers_what_loads_whatever_its_source(tmp_path: Path) -> None:
    toml = _file(tmp_path, "a.toml", '[draft]\nmode = "selective"\n[log]\nlevel = "debug"\n')
    from_file = settings.load({"HYBRID_DRAFT_CONFIG": toml})
    from_env = settings.load(
        {
            "HYBRID_DRAFT_CONFIG": str(tmp_path / "none.toml"),
            "INSTANTTENSOR_DRAFT_LOADER": "Selective",
            "HYBRID_DRAFT_EVENTS_FILE": "/elsewhere/events.jsonl",
        }
    )
    default = settings.load({"HYBRID_DRAFT_CONFIG": str(tmp_path / "none.toml")})
    assert from_file.fingerprint() == from_env.fingerprint()
    assert len(from_file.fingerprint()) == 12
    assert default.fingerprint() != from_file.fingerprint()
    every = {settings.load({"INSTANTTENSOR_DRAFT_LOADER": m}).fingerprint() for m in settings.MODES}
    assert len(every) == len(settings.MODES)
    assert from_file.as_dict()["settings_fingerprint"] == from_file.fingerprint()
    budget = settings.load({"HYBRID_DRAFT_CONFIG": toml, "HYBRID_DRAFT_HOLD_BUDGET": "1GiB"})
    skip = settings.load({"HYBRID_DRAFT_CONFIG": toml, "HYBRID_DRAFT_SKIP_REPLACED": "no"})
    assert len({from_file.fingerprint(), budget.fingerprint(), skip.fingerprint()}) == 3


# --- the driver's settings on another host --------------------------------------------------


def _driver_value(tmp_path: Path, toml: str, **env: str) -> str:
    path = _file(tmp_path, "driver.toml", toml)
    return settings.load({"HYBRID_DRAFT_CONFIG": path, **env}, node=DRIVER).carry(DRIVER)


def test_a_worker_on_another_host_decides_with_the_drivers_file_not_its_own(
    tmp_path: Path,
) -> None:
    carried = _driver_value(tmp_path, '[draft]\nmode = "safetensors"\n')
    own = _file(tmp_path, "worker.toml", '[draft]\nmode = "instanttensor"\n[log]\nlevel = "bad"\n')
    env = {settings.ENV_DRIVER: carried, "HYBRID_DRAFT_CONFIG": own}
    worker = settings.load(env, node=WORKER)
    assert (worker.mode.value, worker.mode.source) == ("safetensors", "file")
    assert worker.mode.origin == (
        f"{tmp_path / 'driver.toml'}:2 on {DRIVER} (via HYBRID_DRAFT_DRIVER_SETTINGS)"
    )
    assert (worker.level.value, worker.level.source) == ("info", "default")
    assert worker.carried_from == DRIVER and worker.config_path == str(tmp_path / "driver.toml")
    assert worker.as_dict()["carried_from"] == DRIVER
    driver = settings.load({"HYBRID_DRAFT_CONFIG": str(tmp_path / "driver.toml")}, node=DRIVER)
    assert worker.fingerprint() == driver.fingerprint()


def test_the_workers_own_variable_still_wins_and_the_drivers_host_reads_its_own_file(
    tmp_path: Path,
) -> None:
    carried = _driver_value(tmp_path, '[draft]\nmode = "safetensors"\n')
    env = {settings.ENV_DRIVER: carried, "INSTANTTENSOR_DRAFT_LOADER": "selective"}
    assert settings.load(env, node=WORKER).mode.value == "selective"
    own = _file(tmp_path, "same-host.toml", '[draft]\nmode = "instanttensor"\n')
    here = settings.load({settings.ENV_DRIVER: carried, "HYBRID_DRAFT_CONFIG": own}, node=DRIVER)
    assert (here.mode.value, here.carried_from) == ("instanttensor", None)


def test_the_drivers_variables_are_carried_with_their_source(tmp_path: Path) -> None:
    carried = _driver_value(
        tmp_path, "", INSTANTTENSOR_DRAFT_LOADER="auto", HYBRID_DRAFT_EVENTS_FILE="/e.jsonl"
    )
    worker = settings.load({settings.ENV_DRIVER: carried}, node=WORKER)
    assert (worker.mode.value, worker.mode.source) == ("auto", "env")
    assert worker.events_file.value == "/e.jsonl"


def test_an_invalid_driver_configuration_fails_the_workers_load_the_same_way(
    tmp_path: Path,
) -> None:
    path = _file(tmp_path, "bad.toml", '[draft]\nmode = "fastest"\n')
    _, error = settings.load_lenient({"HYBRID_DRAFT_CONFIG": path}, node=DRIVER)
    assert error is not None
    env = {settings.ENV_DRIVER: settings.carry_error(error, DRIVER)}
    with pytest.raises(ConfigError) as info:
        settings.load(env, node=WORKER)
    assert info.value.source == f"HYBRID_DRAFT_DRIVER_SETTINGS (the driver on {DRIVER}: {path}:2)"
    assert info.value.detail == error.detail and "'fastest'" in error.detail


@pytest.mark.parametrize(
    "value",
    [
        "{not json",
        "[]",
        '{"node": ""}',
        '{"node": "h", "settings": {}}',
        '{"node": "h", "config_file": {}, "settings": {"mode": {"value": "fast", '
        '"source": "env", "origin": "x"}}}',
    ],
)
def test_a_malformed_carried_value_is_a_config_error_naming_the_variable(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings.load({settings.ENV_DRIVER: value}, node=WORKER)
    assert info.value.source.startswith("HYBRID_DRAFT_DRIVER_SETTINGS")


def test_config_command_shows_the_fingerprint_and_the_driver(tmp_path: Path) -> None:
    carried = _driver_value(tmp_path, '[draft]\nmode = "selective"\n')
    env = {"PATH": "", "HYBRID_DRAFT_CONFIG": str(tmp_path / "none.toml")}
    cli = [sys.executable, "-m", "hybrid_draft", "config"]
    out = subprocess.run(cli, env=env, capture_output=True, text=True, check=True).stdout
    fingerprint = settings.load(env).fingerprint()
    covered = "mode, hold_budget, skip_replaced"
    assert f"fingerprint  {fingerprint} (settings_fingerprint, of: {covered})" in out
    remote = {**env, settings.ENV_DRIVER: carried}
    data = json.loads(
        subprocess.run(
            [*cli, "--json"], env=remote, capture_output=True, text=True, check=True
        ).stdout
    )
    assert data["carried_from"] == DRIVER and data["settings"]["mode"]["value"] == "selective"
    assert data["settings_fingerprint"] != fingerprint


# --- vLLM's env-copy functions, as the installed layer wraps them ---------------------------


@pytest.fixture
def driver_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A driver whose mode comes from its file; the carried variable is cleaned up after."""
    path = _file(tmp_path, "driver.toml", '[draft]\nmode = "safetensors"\n')
    monkeypatch.setenv("HYBRID_DRAFT_CONFIG", path)
    monkeypatch.delenv(settings.ENV_DRIVER, raising=False)
    monkeypatch.setenv("HYBRID_DRAFT_LOG_LEVEL", "debug")
    return path


def test_vllms_copy_names_the_layers_variables_and_the_drivers_settings(
    driver_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.ray.ray_env as ray_env
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

    monkeypatch.setenv("VLLM_RAY_EXTRA_ENV_VARS_TO_COPY", "MY_OWN_VAR")
    monkeypatch.setenv("MY_OWN_VAR", "1")
    copied = ray_env.get_env_vars_to_copy(
        exclude_vars=WORKER_SPECIFIC_ENV_VARS, destination="workers"
    )
    assert {"HYBRID_DRAFT_CONFIG", "HYBRID_DRAFT_LOG_LEVEL", "MY_OWN_VAR"} <= copied
    assert {"INSTANTTENSOR_DRAFT_LOADER", settings.ENV_DRIVER} <= copied
    assert os.environ["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"] == "MY_OWN_VAR"  # untouched
    carried = json.loads(os.environ[settings.ENV_DRIVER])
    assert carried["node"] == socket.gethostname()
    assert carried["settings"]["mode"] == {
        "value": "safetensors",
        "source": "file",
        "origin": f"{driver_env}:2",
    }
    # vLLM's own exclusions still apply to the layer's names.
    excluded = ray_env.get_env_vars_to_copy(exclude_vars={"HYBRID_DRAFT_CONFIG"})
    assert "HYBRID_DRAFT_CONFIG" not in excluded and settings.ENV_DRIVER in excluded


def test_vllms_driver_env_carries_the_drivers_settings(driver_env: str) -> None:
    from vllm.v1.executor.ray_env_utils import get_driver_env_vars

    env = get_driver_env_vars(worker_specific_vars=set())
    worker = settings.load(env, node=WORKER)
    assert (worker.mode.value, worker.carried_from) == ("safetensors", socket.gethostname())


def test_a_worker_passes_its_drivers_settings_on_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data-parallel engine actor on another node starts its own workers: they get the
    first driver's settings, not the actor's host's."""
    from hybrid_draft.adapter import ray_env

    carried = _driver_value(tmp_path, '[draft]\nmode = "selective"\n')
    env = {settings.ENV_DRIVER: carried, "HYBRID_DRAFT_CONFIG": str(tmp_path / "x.toml")}
    assert ray_env.export(env) == carried


def test_the_hooks_leave_vllm_alone_when_the_layer_is_disabled(tmp_path: Path) -> None:
    code = (
        "import vllm.ray.ray_env as r, vllm.v1.executor.ray_env_utils as u;"
        "print(hasattr(r.get_env_vars_to_copy, '__hybrid_draft_wrapped__'),"
        "hasattr(u.get_driver_env_vars, '__hybrid_draft_wrapped__'))"
    )
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path)}
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    off = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "HYBRID_DRAFT_DISABLE": "1"},
        capture_output=True,
        text=True,
    )
    assert on.stdout.split()[-2:] == ["True", "True"], on.stderr
    assert off.stdout.split()[-2:] == ["False", "False"], off.stderr


# --- node, rank and fingerprint on every decision and load ----------------------------------


@pytest.mark.vllm
def test_every_decision_and_load_says_where_and_with_which_settings(
    deepseek: Path, events: Events, instanttensor_standin: Recorder
) -> None:
    load_target_and_draft(engine_config(deepseek))
    fingerprint = settings.load().fingerprint()
    mine = events.decisions() + events.named("hybrid_draft.loaded")
    assert len(mine) == 4
    for e in mine:
        assert (e["node"], e["rank"], e["settings_fingerprint"]) == (
            socket.gethostname(),
            0,  # the session's one-process world
            fingerprint,
        )
        assert "settings_from" not in e


def test_where_says_no_rank_outside_a_distributed_group() -> None:
    code = (
        "import json\n"
        "from hybrid_draft import records, settings\n"
        "from hybrid_draft.adapter import load\n"
        "print(json.dumps(records.render(load.where_of(settings.load()))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    fields = json.loads(out.splitlines()[-1])
    assert fields["rank"] is None and fields["node"] == socket.gethostname()
    assert fields["settings_fingerprint"] == settings.load().fingerprint()


# --- report: ranks that decided differently -------------------------------------------------


def _decision(rank: Any, role: str = "draft", fmt: str = "safetensors", **kw: Any) -> str:
    fields = {
        "event": "hybrid_draft.decision",
        "pid": 100 + (rank if isinstance(rank, int) else 0),
        "role": role,
        "model": "/m",
        "chosen_format": fmt,
        "action": "kept" if fmt == "instanttensor" else "switched",
        "reason": "mode_instanttensor" if fmt == "instanttensor" else "forced_safetensors",
        "settings_fingerprint": "aaaaaaaaaaaa" if fmt != "instanttensor" else "bbbbbbbbbbbb",
        "rank": rank,
        "node": f"n{rank}",
        **kw,
    }
    return json.dumps(fields)


def _report(tmp_path: Path, lines: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cli = [sys.executable, "-m", "hybrid_draft", "report", str(path), *args]
    return subprocess.run(cli, capture_output=True, text=True, timeout=120)


def test_report_flags_the_rank_that_decided_differently(tmp_path: Path) -> None:
    lines = [
        _decision(0, "target", "instanttensor", reason="target_model"),
        _decision(1, "target", "instanttensor", reason="target_model"),
        _decision(2, "target", "instanttensor", reason="target_model"),
        _decision(0),
        _decision(1),
        _decision(2, fmt="instanttensor"),
    ]
    out = _report(tmp_path, lines, "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["ranks"] == [0, 1, 2]
    (entry,) = summary["inconsistent"]
    assert (entry["model"], entry["role"], entry["ranks"]) == ("/m", "draft", [2])
    assert entry["detail"] == (
        "rank(s) 0, 1: chosen_format=safetensors, action=switched, reason=forced_safetensors, "
        "settings_fingerprint=aaaaaaaaaaaa; rank(s) 2: chosen_format=instanttensor, "
        "action=kept, reason=mode_instanttensor, settings_fingerprint=bbbbbbbbbbbb"
    )
    text = _report(tmp_path, lines).stdout.splitlines()
    assert text[0].startswith("no model loads in these events")
    assert text[1] == f"INCONSISTENT draft /m: rank(s) 2 decided differently ({entry['detail']})"


def test_report_says_the_ranks_agreed(tmp_path: Path) -> None:
    lines = [_decision(0), _decision(1), _decision(None), _decision(1)]
    summary = json.loads(_report(tmp_path, lines, "--json").stdout)
    assert summary["inconsistent"] == [] and summary["ranks"] == [0, 1]
    assert "ranks 0, 1: every rank decided alike" in _report(tmp_path, lines).stdout
    alone = json.loads(_report(tmp_path, [_decision(0)], "--json").stdout)
    assert alone["inconsistent"] == []
    assert "every rank" not in _report(tmp_path, [_decision(0)]).stdout


def test_report_compares_ranks_whatever_the_field_types(tmp_path: Path) -> None:
    """Wrong types never break the comparison: a rank that is not an integer is not a
    rank, and any other value is compared as it is written."""
    lines = [
        _decision(0, model=["/m"]),
        _decision(1, model=["/m"], settings_fingerprint={"x": 1}),
        _decision("2"),
        _decision(True),
        _decision(3.0),
        json.dumps({"event": "hybrid_draft.decision", "rank": 4}),
        json.dumps(["not", "an", "object"]),
    ]
    out = _report(tmp_path, lines, "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["ranks"] == [0, 1, 4]
    (entry,) = summary["inconsistent"]
    assert entry["ranks"] == [1] and entry["model"] == '["/m"]'
    assert report.inconsistent(iter([json.loads(x) for x in lines[:2]]))[0]["ranks"] == [1]


def test_report_compares_each_ranks_sessions_in_order(tmp_path: Path) -> None:
    """A server's ranks update their weights together: each rank's n-th session's decision is
    compared with the others' n-th, never with its own first load's."""
    session = {"trigger": "weight_update", "backend": "nccl", "session": "target"}
    taken = {**session, "chosen_format": "weight_transfer", "reason": "weight_update"}
    kept = {**session, "action": "kept", "reason": "no_draft_tensors"}
    lines = [
        *(_decision(rank) for rank in (0, 1)),
        *(_decision(rank, **taken) for rank in (0, 1)),
        *(_decision(rank, **kept) for rank in (0, 1)),
    ]
    assert json.loads(_report(tmp_path, lines, "--json").stdout)["inconsistent"] == []
    lines.append(_decision(0, **taken))
    lines.append(_decision(1, **kept))  # the third session: rank 1 kept its draft's weights
    (entry,) = json.loads(_report(tmp_path, lines, "--json").stdout)["inconsistent"]
    assert entry["ranks"] == [1]
    assert entry["detail"].startswith("weight_update 3: rank(s) 0: ")
