"""The host is set up before any test starts, and never changes under a running test.

scripts/system-setup installs every system package the suite and the image test need and
records what it left; scripts/test runs it before the virtual environment, the image test
and pytest. These tests read dpkg's own log and the record: nothing installed or upgraded
since this session started, every recorded version still the one installed. Run outside
scripts/test, the record's checks skip, saying so; dpkg's log is checked all the same
(tests/conftest.py checks it again when the session ends, scripts/test once the image test
is done too).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import systemsetup

REPO = Path(__file__).resolve().parents[1]
SETUP = REPO / "scripts" / "system-setup"


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def test_an_install_or_upgrade_after_the_start_is_found_and_nothing_before() -> None:
    start = time.time()
    before, same, after = _stamp(start - 60), _stamp(start), _stamp(start + 2)
    log = "\n".join(
        [
            f"{before} install strace:amd64 <none> 6.1-0.1",
            f"{same} upgrade libc6:amd64 2.36-9 2.41-12",  # the set-up step's last second
            f"{after} startup archives unpack",
            f"{after} upgrade libssl3t64:amd64 3.0.19 3.5.1-1",
            f"{after} status installed libssl3t64:amd64 3.5.1-1",
            f"{after} configure docker.io:amd64 26.1.5 <none>",
            f"{after} install docker.io:amd64 <none> 26.1.5+dfsg1-9",
            "",
        ]
    )
    assert systemsetup.changes_since(log, start) == [
        f"{after} upgrade libssl3t64:amd64 3.0.19 3.5.1-1",
        f"{after} install docker.io:amd64 <none> 26.1.5+dfsg1-9",
    ]
    assert systemsetup.changes_since(log, start + 5) == []


def test_the_command_form_fails_when_dpkg_changed_something(tmp_path: Path) -> None:
    log = tmp_path / "dpkg.log"
    log.write_text(f"{_stamp(time.time() + 5)} install docker.io:amd64 <none> 26.1.5\n")
    assert systemsetup.dpkg_changes_since(time.time(), log) == [log.read_text().strip()]
    assert systemsetup.dpkg_changes_since(time.time(), tmp_path / "absent.log") == []


def test_nothing_was_installed_since_this_session_started(session_started: float) -> None:
    assert systemsetup.dpkg_changes_since(session_started) == []


def test_the_set_up_step_finished_before_this_session_and_its_versions_still_hold(
    session_started: float,
) -> None:
    path = systemsetup.record_path()
    if path is None:
        pytest.skip(f"{systemsetup.RECORD_ENV} unset: pytest was not started by scripts/test")
    record = systemsetup.read_record(path)
    assert record.finished <= session_started, (
        f"scripts/system-setup finished at {record.finished}, after pytest started"
    )
    assert {"libc6", "libssl3", "strace"} <= set(record.packages)
    if shutil.which("dpkg-query") is None:
        pytest.skip("no dpkg-query on this host: the versions cannot be read again")
    assert systemsetup.installed_versions(sorted(record.packages)) == record.packages


def _check(env_path: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [shutil.which("bash") or "bash", str(SETUP), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": env_path, **env},
    )


def test_the_check_names_what_is_missing_in_one_line(tmp_path: Path) -> None:
    """The image test only checks (`--check`): with nothing on PATH it says what to run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "dpkg-query", "grep"):
        found = shutil.which(tool)
        if found is not None:
            (bin_dir / tool).symlink_to(found)
    out = _check(str(bin_dir), HYBRID_DRAFT_IMAGE_TEST="1")
    assert out.returncode == 2, out
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    for name in ("strace", "buildah", "debootstrap", "iproute2", "docker.io", "docker-compose"):
        assert name in lines[0]
    assert "sudo bash scripts/system-setup" in lines[0]
    # Without the image test, only what pytest needs.
    quick = _check(str(bin_dir), HYBRID_DRAFT_IMAGE_TEST="0")
    assert quick.returncode == 2 and "buildah" not in quick.stderr and "strace" in quick.stderr


def test_a_bad_argument_is_one_line_and_status_2() -> None:
    out = subprocess.run(
        ["bash", str(SETUP), "--install-everything"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "system-setup: unknown argument '--install-everything' (accepted: --check)"
    ]


def test_scripts_test_sets_up_the_system_before_anything_else_starts() -> None:
    """The order in the command itself: the set-up step before the venv, image test, pytest."""
    text = (REPO / "scripts" / "test").read_text()
    setup = text.index("bash scripts/system-setup\n")
    for later in ('"$PYTHON" -m venv', "bash scripts/image-test", '"$PY" -m pytest'):
        assert setup < text.index(later), later
    for script in ("scripts/test", "scripts/image-test", "scripts/cpu-env.sh"):
        code = [
            line
            for line in (REPO / script).read_text().splitlines()
            if not line.lstrip().startswith("#")
        ]
        assert not [line for line in code if "apt-get" in line], script
