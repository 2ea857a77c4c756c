"""The host is set up before any test starts, and never changes under a running test.

scripts/system-setup installs every system package the suite and the image test need from the
host's own release, unpacks into build/system-tools what that release lacks (Docker Engine 26,
buildx, Compose v2), and records what it left; scripts/test runs it before the virtual
environment, the image test and pytest. These tests read dpkg's own log and the record:
nothing installed or upgraded since this session started, every recorded version still the
one installed, the unpacked tools not installed. Run outside scripts/test, the record's
checks skip, saying so; dpkg's log is checked all the same (tests/conftest.py checks it again
when the session ends, scripts/test once the image test is done too).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
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


#: Each unpacked package the record lists, and the program of it whose version says so.
TOOL_PROGRAMS = {
    "docker.io": ["bin/dockerd", "--version"],
    "docker-cli": ["bin/docker", "--version"],
    "docker-buildx": ["cli-plugins/docker-buildx", "version"],
    "docker-compose": ["cli-plugins/docker-compose", "version"],
    "containerd": ["bin/containerd", "--version"],
    "tini": ["bin/docker-init", "--version"],
    "qemu-user": ["bin/qemu-aarch64", "--version"],
}


def test_the_unpacked_tools_are_the_recorded_ones_and_none_is_installed_in_the_host() -> None:
    """Docker Engine 26, buildx and Compose v2 come from a release the host is not: each runs
    from build/system-tools at the version recorded, and dpkg has none of them."""
    path = systemsetup.record_path()
    if path is None:
        pytest.skip(f"{systemsetup.RECORD_ENV} unset: pytest was not started by scripts/test")
    tools = systemsetup.read_record(path).tools
    if not tools:
        pytest.skip(f"{path} lists no unpacked tools (HYBRID_DRAFT_IMAGE_TEST=0, or not root)")
    assert {"docker.io", "docker-cli", "docker-buildx", "docker-compose"} <= set(tools)
    root = Path(os.environ.get("HYBRID_DRAFT_SYSTEM_TOOLS", REPO / "build" / "system-tools"))
    for name, (version, _release) in tools.items():
        program, *args = TOOL_PROGRAMS[name]
        out = subprocess.run([root / program, *args], capture_output=True, text=True, timeout=60)
        upstream = re.match(r"[\d.]+", version.split(":")[-1])
        assert upstream is not None and upstream.group().rstrip(".") in out.stdout, (name, out)
    if shutil.which("dpkg-query") is not None:
        installed = systemsetup.installed_versions(sorted(tools))
        assert installed == dict.fromkeys(tools, "none"), "installed into the host"


# --- scripts/system-setup ------------------------------------------------------------------


def _setup(
    *args: str, path: str, tools: Path, user: list[str] | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*(user or []), shutil.which("bash") or "bash", str(SETUP), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": path, "HYBRID_DRAFT_SYSTEM_TOOLS": str(tools), **env},
    )


def _bin_without(tmp_path: Path, *left_out: str) -> Path:
    """A PATH folder with every command of this one but ``left_out``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for folder in [*os.environ.get("PATH", "").split(os.pathsep), "/usr/sbin", "/sbin"]:
        if not os.path.isdir(folder):
            continue
        for entry in os.scandir(folder):
            link = bin_dir / entry.name
            if entry.name not in left_out and not link.exists() and os.access(entry, os.X_OK):
                link.symlink_to(entry.path)
    return bin_dir


def test_the_check_names_what_is_missing_in_one_line(tmp_path: Path) -> None:
    """The image test only checks (`--check`): with nothing on PATH it says what to run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "dpkg-query", "grep", "sed"):
        found = shutil.which(tool)
        if found is not None:
            (bin_dir / tool).symlink_to(found)
    tools = tmp_path / "tools"
    out = _setup("--check", path=str(bin_dir), tools=tools, HYBRID_DRAFT_IMAGE_TEST="1")
    assert out.returncode == 2, out
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    for name in ("strace", "buildah", "debootstrap", "iproute2", "docker.io", "docker-compose"):
        assert name in lines[0]
    assert f"unpacked into {tools}" in lines[0]
    assert "sudo bash scripts/system-setup" in lines[0]
    # Without the image test, only what pytest needs.
    quick = _setup("--check", path=str(bin_dir), tools=tools, HYBRID_DRAFT_IMAGE_TEST="0")
    assert quick.returncode == 2 and "buildah" not in quick.stderr and "strace" in quick.stderr
    assert "docker" not in quick.stderr


def test_without_apt_it_installs_nothing_and_says_what_to_get_in_one_line(tmp_path: Path) -> None:
    """Not Debian (no apt-get, no dpkg): one line naming what is missing and how to get it;
    the set-up step goes on (the tests that need it skip)."""
    bin_dir = _bin_without(
        tmp_path, "apt-get", "apt", "dpkg", "dpkg-deb", "dpkg-query", "strace", "buildah"
    )
    tools = tmp_path / "tools"
    record = tmp_path / "record.txt"
    out = _setup(
        path=str(bin_dir),
        tools=tools,
        HYBRID_DRAFT_IMAGE_TEST="1",
        HYBRID_DRAFT_SYSTEM_RECORD=str(record),
    )
    assert out.returncode == 0, out
    said = [ln for ln in out.stdout.splitlines() if ln.startswith("system-setup:")]
    assert len(said) == 1, out.stdout
    assert said[0].startswith("system-setup: no apt-get (not Debian): nothing installed; missing:")
    for name in ("strace", "buildah", "Docker Engine 26", f"in {tools}/bin", "docker-compose"):
        assert name in said[0]
    assert "this system's package manager" in said[0]
    assert not tools.exists()
    assert "package strace none" in record.read_text()


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to become another"
)
def test_not_root_it_installs_nothing_and_says_what_to_run_in_one_line() -> None:
    with tempfile.TemporaryDirectory() as tmp:  # pytest's tmp_path is root's alone
        Path(tmp).chmod(0o777)
        tools = Path(tmp) / "tools"
        out = _setup(
            path=os.environ.get("PATH", ""),
            tools=tools,
            HYBRID_DRAFT_IMAGE_TEST="1",
            HYBRID_DRAFT_SYSTEM_RECORD=str(Path(tmp) / "record.txt"),
            user=["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"],
        )
        assert not tools.exists()
    assert out.returncode == 0, out
    said = [ln for ln in out.stdout.splitlines() if ln.startswith("system-setup:")]
    assert len(said) == 1, out.stdout
    assert said[0].startswith("system-setup: not root: nothing installed; missing: ")
    assert "Debian trixie's docker.io docker-cli docker-buildx docker-compose" in said[0]
    assert "run `sudo bash scripts/system-setup`" in said[0]


def test_a_bad_argument_is_one_line_and_status_2() -> None:
    out = subprocess.run(
        ["bash", str(SETUP), "--install-everything"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "system-setup: unknown argument '--install-everything' (accepted: --check)"
    ]


def _code(script: str) -> list[str]:
    lines = (REPO / script).read_text().splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_scripts_test_sets_up_the_system_before_anything_else_starts() -> None:
    """The order in the command itself: the set-up step before the venv, image test, pytest."""
    text = (REPO / "scripts" / "test").read_text()
    setup = text.index("bash scripts/system-setup\n")
    for later in ('"$PYTHON" -m venv', "bash scripts/image-test", '"$PY" -m pytest'):
        assert setup < text.index(later), later
    for script in ("scripts/test", "scripts/image-test", "scripts/cpu-env.sh"):
        assert not [line for line in _code(script) if "apt-get" in line], script


def test_the_set_up_step_adds_no_apt_source_and_installs_from_no_other_release() -> None:
    """Another release's packages are fetched with apt's sources, lists and state of the
    step's own, never with the host's /etc/apt or ``apt-get -t``."""
    code = "\n".join(_code("scripts/system-setup"))
    assert "/etc/apt" not in code
    assert "Default-Release" not in code
    assert not re.search(r"apt-get[^\n]* (-t|--target-release)\b", code)
    assert "options=(-o APT::Get::Upgrade-By-Source-Package=false)" in code
    installs = re.findall(r"^(?!.*\becho\b).*\bapt-get\b.*\binstall\b.*$", code, re.M)
    assert len(installs) == 2 and all('"${options[@]}"' in ln for ln in installs), installs
