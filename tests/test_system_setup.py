"""The host is set up before any test starts, never changes under a running test, and the
test command changes it only by new packages of its own release.

scripts/system-setup installs every system package the suite and the image test need from the
host's own release, unpacks into build/system-tools what that release lacks (Docker Engine 26,
buildx, Compose v2), and records what it left; scripts/test runs it before the virtual
environment, the image test and pytest, and records the host's state before it. These tests
read dpkg's own log and the records: nothing installed or upgraded since this session started,
every recorded version still the one installed, the unpacked tools not installed, and since
the test command started nothing upgraded or removed, nothing from another release, /etc/apt,
/etc/debian_version and python3 as they were. Run outside scripts/test, the records' checks
skip, saying so; dpkg's log is checked all the same (tests/conftest.py checks it again when
the session ends, scripts/test once the image test is done too, and compares the whole host
with its first record as its last step).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

import systemsetup
from systemsetup import HostState, Package

pytestmark = pytest.mark.once  # the same on every vLLM release (docs/testing.md)

REPO = Path(__file__).resolve().parents[1]
SETUP = REPO / "scripts" / "system-setup"
SCRIPT = REPO / "tests" / "systemsetup.py"


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


def test_the_host_changed_only_by_new_packages_of_its_release_since_the_command_started() -> None:
    """What scripts/test checks as its last step, checked here as far as the run has come:
    since its first step nothing was upgraded, removed, or taken from another release, and
    /etc/apt, /etc/debian_version, python3 and what ``apt list --upgradable`` shows are as
    they were."""
    path = systemsetup.record_path(systemsetup.HOST_RECORD_ENV)
    if path is None:
        pytest.skip(f"{systemsetup.HOST_RECORD_ENV} unset: pytest was not started by scripts/test")
    before = systemsetup.read_state(path)
    changes = systemsetup.compare(before, systemsetup.host_state())
    assert changes.violations == []


# --- the comparison ------------------------------------------------------------------------

BEFORE = HostState(
    release="bookworm",
    debian_version="12.11",
    pythons={"python3": "3.11.7", "/usr/bin/python3": "3.11.2"},
    etc_apt={
        "/etc/apt/sources.list.d": "dir",
        "/etc/apt/sources.list.d/debian.sources": "a" * 64,
        "/etc/apt/preferences.d/nodejs": "b" * 64,
    },
    packages={
        "libc6:amd64": Package("2.36-9+deb12u10", "bookworm"),
        "perl": Package("5.36.0-7+deb12u2", "bookworm"),
        "nodejs": Package("20.20.2-1nodesource1", systemsetup.LOCAL),
    },
)


def _with(state: HostState, **packages: Package | None) -> HostState:
    new = dict(state.packages)
    for name, package in packages.items():
        if package is None:
            del new[name]
        else:
            new[name] = package
    return replace(state, packages=new)


def test_new_packages_of_the_hosts_own_release_are_all_that_may_differ() -> None:
    after = _with(
        BEFORE,
        buildah=Package("1.28.2+ds1-3+deb12u1+b3", "bookworm"),
        libgpgme11=Package("1.18.0-3+deb12u1", "bookworm"),  # bookworm-security's
    )
    changes = systemsetup.compare(BEFORE, after)
    assert changes.violations == []
    assert changes.added == ["buildah 1.28.2+ds1-3+deb12u1+b3", "libgpgme11 1.18.0-3+deb12u1"]
    assert systemsetup.compare(BEFORE, BEFORE) == systemsetup.HostChanges([], [])


def test_an_upgrade_a_removal_and_another_releases_package_are_each_reported() -> None:
    after = _with(
        BEFORE,
        **{"libc6:amd64": Package("2.41-12", "trixie")},
        perl=None,
        docker_io=Package("26.1.5+dfsg1-9", "trixie"),
        mystery=Package("1.0", systemsetup.LOCAL),
    )
    changes = systemsetup.compare(BEFORE, after)
    assert changes.added == []
    assert changes.violations == [
        "docker_io 26.1.5+dfsg1-9 installed from trixie, not bookworm",
        "libc6:amd64 2.36-9+deb12u10 -> 2.41-12",
        "mystery 1.0 installed from no release's lists, not bookworm",
        "perl 5.36.0-7+deb12u2 removed",
    ]


def test_a_changed_etc_apt_debian_version_and_python_are_each_reported() -> None:
    apt = dict(BEFORE.etc_apt)
    apt["/etc/apt/sources.list.d/hybrid-draft-trixie.sources"] = "c" * 64
    apt["/etc/apt/preferences.d/nodejs"] = "d" * 64
    del apt["/etc/apt/sources.list.d/debian.sources"]
    after = replace(
        BEFORE,
        debian_version="13.1",
        pythons={"python3": "3.11.7", "/usr/bin/python3": "3.13.5"},
        etc_apt=apt,
    )
    assert systemsetup.compare(BEFORE, after).violations == [
        "/etc/debian_version 12.11 -> 13.1",
        "/usr/bin/python3 --version 3.11.2 -> 3.13.5",
        "/etc/apt/preferences.d/nodejs changed",
        "/etc/apt/sources.list.d/debian.sources removed",
        "/etc/apt/sources.list.d/hybrid-draft-trixie.sources added",
    ]


def test_the_summary_is_one_line_that_counts_what_it_does_not_name() -> None:
    upgraded = {f"lib{n}": Package(f"{n}.1", "trixie") for n in range(20)}
    before = replace(BEFORE, packages={n: Package(f"{n[3:]}.0", "bookworm") for n in upgraded})
    changes = systemsetup.compare(before, replace(before, packages=upgraded))
    line = systemsetup.summary(changes, Path("build/host-before.txt"), "bookworm")
    assert "\n" not in line
    assert line.startswith("the host changed since build/host-before.txt beyond new packages")
    assert "lib0 0.0 -> 0.1" in line and line.endswith(f"; and {20 - systemsetup.SHOWN} more")


POLICY = """\
libc6:
  Installed: 2.36-9+deb12u10
  Candidate: 2.36-9+deb12u13
  Version table:
     2.36-9+deb12u13 500
        500 http://deb.debian.org/debian bookworm/main amd64 Packages
 *** 2.36-9+deb12u10 500
        500 http://deb.debian.org/debian-security bookworm-security/main amd64 Packages
        100 /var/lib/dpkg/status
docker.io:
  Installed: 26.1.5+dfsg1-9
  Candidate: 26.1.5+dfsg1-9
  Version table:
 *** 26.1.5+dfsg1-9 100
        100 http://deb.debian.org/debian trixie/main amd64 Packages
        100 /var/lib/dpkg/status
libfoo:i386:
  Installed: 1.0-1
  Candidate: 1.0-1
  Version table:
 *** 1.0-1 100
        100 /var/lib/dpkg/status
"""


def test_a_packages_origin_is_the_release_whose_lists_hold_its_installed_version() -> None:
    assert systemsetup.installed_origins(POLICY) == {
        "libc6": "bookworm",  # from bookworm-security, not the newer bookworm version's list
        "docker.io": "trixie",
        "libfoo:i386": systemsetup.LOCAL,
    }


def test_what_apt_list_upgradable_shows_is_read_from_the_same_policy() -> None:
    assert systemsetup.upgradable_in(POLICY) == {"libc6": "2.36-9+deb12u13"}


def test_a_refreshed_package_index_is_reported() -> None:
    """The host's lists refreshed (``apt-get update`` on them): ``apt list --upgradable``
    shows what it did not, though no package changed."""
    before = replace(BEFORE, upgradable={"perl": "5.36.0-7+deb12u3"})
    after = replace(BEFORE, upgradable={"libc6:amd64": "2.36-9+deb12u13"})
    assert systemsetup.compare(before, after).violations == [
        "apt list --upgradable: libc6:amd64 now upgradable to 2.36-9+deb12u13",
        "apt list --upgradable: perl now not upgradable",
    ]
    assert systemsetup.compare(after, after).violations == []


def test_a_host_record_reads_back_as_written_and_a_bad_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "host.txt"
    state = replace(BEFORE, upgradable={"libc6:amd64": "2.36-9+deb12u13"})
    systemsetup.write_state(state, path)
    assert systemsetup.read_state(path) == state
    path.write_text(path.read_text() + "package half-a-line\n")
    with pytest.raises(ValueError, match=r"host\.txt:\d+: not a line of a host record"):
        systemsetup.read_state(path)


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="no dpkg on this host")
def test_the_command_reports_a_changed_host_in_one_line_and_exits_1(tmp_path: Path) -> None:
    """The record of this very host, one package's version and one /etc/apt file's made
    different in it: as after an upgrade and a removed source, scripts/test's last step
    fails naming both."""
    record = tmp_path / "before.txt"
    assert _script("record", str(record)).returncode == 0
    state = systemsetup.read_state(record)
    name, package = next(iter(state.packages.items()))
    apt = {**state.etc_apt, "/etc/apt/sources.list.d/gone.sources": "e" * 64}
    packages = {**state.packages, name: Package("0~older", package.origin)}
    systemsetup.write_state(replace(state, packages=packages, etc_apt=apt), record)
    out = _script("compare", str(record))
    assert out.returncode == 1, out
    assert out.stdout == ""
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert f"{name} 0~older -> {package.version}" in out.stderr
    assert "/etc/apt/sources.list.d/gone.sources added" not in out.stderr
    assert "/etc/apt/sources.list.d/gone.sources removed" in out.stderr


def test_the_command_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "bad.txt").write_text("release bookworm\nnot a record\n")
    for args in (
        ["compare", str(tmp_path / "bad.txt")],
        ["compare", str(tmp_path / "absent")],
        ["since", "yesterday"],
        ["upgrade"],
    ):
        out = _script(*args)
        assert out.returncode == 2, (args, out)
        assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr


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


_TMP_BASES = (tempfile.gettempdir(), "/tmp", "/var/tmp")


def _others_can_enter(folder: str) -> bool:
    """Whether a user of no group reaches into folder: each folder on its path lets others in."""
    path = Path(folder).resolve()
    return path.is_dir() and all(p.stat().st_mode & 0o001 for p in (path, *path.parents))


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to become another"
)
def test_not_root_it_installs_nothing_and_says_what_to_run_in_one_line() -> None:
    # pytest's tmp_path and the run's TMPDIR (scripts/test) are root's alone.
    base = next((d for d in _TMP_BASES if _others_can_enter(d)), None)
    if base is None:
        pytest.skip(f"no temporary folder another user can enter among {_TMP_BASES}")
    with tempfile.TemporaryDirectory(prefix="hybrid-draft-setup-", dir=base) as tmp:
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


def test_scripts_test_records_the_host_first_sets_it_up_next_and_compares_it_last() -> None:
    """The order in the command itself: the host's record, then the set-up step, before the
    venv, the image test and pytest; the comparison with the record the very last step."""
    code = _code("scripts/test")
    text = "\n".join(code)
    record = text.index('tests/systemsetup.py record "$HYBRID_DRAFT_HOST_RECORD"')
    # Before it only settings and functions: no command that runs anything.
    runs = [ln for ln in code if not re.match(r"^(\s|set |cd |export |\w+=|\w+\(\) \{|\})", ln)]
    assert runs[0].endswith('tests/systemsetup.py record "$HYBRID_DRAFT_HOST_RECORD"'), runs[0]
    setup = text.index("bash scripts/system-setup\n")
    assert record < setup
    for later in ('"$PYTHON" -m venv', "bash scripts/image-test", '"$PY" -m pytest'):
        assert setup < text.index(later), later
    compare = code.index(
        '"$PYTHON" tests/systemsetup.py compare "$HYBRID_DRAFT_HOST_RECORD" || status=1'
    )
    assert text.index('"$PY" -m pytest') < text.index(code[compare])
    # After it only the temporary folder's report, on the listing taken before the run's own
    # folder was made, and the exit.
    assert code[-1] == 'exit "$status"'
    assert all("HOST_TMP" in line or "new_tmp" in line for line in code[compare + 1 : -1])
    assert text.index('HOST_TMP_BEFORE=$(ls -A "$HOST_TMP")') < text.index("RUN_TMP=$(mktemp")
    for script in ("scripts/test", "scripts/image-test", "scripts/cpu-env.sh"):
        assert not [line for line in _code(script) if "apt-get" in line], script


def _traps(script: str) -> dict[str, list[str]]:
    """Each ``trap '...' SIGNALS`` of ``script``, by its signals."""
    found: dict[str, list[str]] = {}
    for line in _code(script):
        if m := re.match(r"^\s*trap '(.*)' ([A-Z ]+?)(\s+#.*)?$", line):
            found.setdefault(m.group(2), []).append(m.group(1))
    return found


def test_the_commands_exit_status_is_its_steps_whatever_its_traps_meet(tmp_path: Path) -> None:
    """scripts/test runs under ``set -e``: its traps (ending its jobs, removing the run's
    folder) must neither fail a passed run nor pass a failed one, whether its jobs still run,
    ended (waited on or not) or never started; a job still running is ended, and no pid of a
    job that ended is signalled (the system may have given it to another process). Each trap
    of the command, run as the command runs it (a script file, ``kill`` watched): the end's
    keeps the steps' exit status, an INT or TERM's ends the run with 143."""
    traps = _traps("scripts/test")
    assert len(traps["EXIT"]) == 1 and len(traps["INT TERM"]) == 2, traps
    cases = [("EXIT", traps["EXIT"][0], status) for status in (0, 3)]
    cases += [("INT TERM", body, 143) for body in traps["INT TERM"]]
    for n, (signals, body, expected) in enumerate(cases):
        for jobs in ("running", "ended", "ended, never waited on", "none"):
            case = tmp_path / f"case-{n}-{jobs.replace(' ', '-').replace(',', '')}"
            case.mkdir()
            run_tmp = case / "run"
            run_tmp.mkdir()
            (run_tmp / "left").write_text("x")
            started = {
                "running": f"sleep 60 & echo $! > {case}/pid;",
                "ended": "true & wait $!;",
                "ended, never waited on": f"sleep 0.1 & echo $! > {case}/pid; sleep 1;",
                "none": "",
            }[jobs]
            end = f"exit {expected}" if signals == "EXIT" else "kill -TERM $$; sleep 5; exit 9"
            script = case / "script.sh"
            script.write_text(
                "set -euo pipefail\n"
                f'kill() {{ echo "$@" >> {case}/signalled; command kill "$@"; }}\n'
                f"RUN_TMP={run_tmp}\n{started}\n"
                f"trap {shlex.quote(body)} {signals}\n{end}\n"
            )
            proc = subprocess.run(  # a job left running holds the output open: past 90 s, a failure
                ["bash", str(script)], capture_output=True, text=True, timeout=90
            )
            assert proc.returncode == expected, (signals, body, jobs, proc.stderr)
            if signals == "EXIT":
                assert not run_tmp.exists(), (body, jobs)
            signalled = (case / "signalled").read_text() if (case / "signalled").exists() else ""
            if jobs == "running":
                pid = int((case / "pid").read_text())
                assert str(pid) in signalled.split(), (signals, body, signalled)
                deadline = time.monotonic() + 10
                while _alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not _alive(pid), (signals, body, "the job still runs")
            elif jobs == "ended, never waited on":
                pid = int((case / "pid").read_text())
                assert str(pid) not in signalled.split(), (signals, body, signalled)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by init, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def test_the_set_up_step_adds_no_apt_source_and_installs_from_no_other_release() -> None:
    """Another release's packages are fetched with apt's sources, lists and state of the
    step's own, never with the host's /etc/apt or ``apt-get -t``."""
    code = "\n".join(_code("scripts/system-setup"))
    assert "/etc/apt" not in code
    assert "Default-Release" not in code
    assert not re.search(r"apt-get[^\n]* (-t|--target-release)\b", code)
    # The host's own install: nothing upgraded by source package, and its lists and cache
    # private, so the host's package index (`apt list --upgradable`) is never refreshed.
    host = code.split("host_install() {", 1)[1].split("\n}", 1)[0]
    assert "-o APT::Get::Upgrade-By-Source-Package=false" in host
    assert '-o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache"' in host
    assert "apt-get update" not in host and 'apt-get -qq "${options[@]}" update' in host
    installs = re.findall(r"^(?!.*\becho\b).*\bapt-get\b.*\binstall\b.*$", code, re.M)
    assert len(installs) == 2 and all('"${options[@]}"' in ln for ln in installs), installs


def test_a_new_package_at_a_version_only_the_set_up_steps_lists_hold_is_the_releases() -> None:
    """scripts/system-setup installs by the host's own sources, fetched afresh into lists of
    its own: a security update published since the host's lists were fetched is the release's
    all the same. A version neither holds stays from no release's lists."""
    host = {"libgpgme11": systemsetup.LOCAL, "perl": "bookworm", "nodejs": systemsetup.LOCAL}
    setup = {"libgpgme11": "bookworm", "nodejs": systemsetup.LOCAL}
    assert systemsetup.merged_origins(host, setup) == {
        "libgpgme11": "bookworm",
        "perl": "bookworm",
        "nodejs": systemsetup.LOCAL,
    }
    after = HostState(
        release="bookworm",
        debian_version=BEFORE.debian_version,
        pythons=BEFORE.pythons,
        etc_apt=BEFORE.etc_apt,
        packages={
            **BEFORE.packages,
            "libgpgme11:amd64": Package("1.18.0-3+deb12u1", "bookworm"),
        },
    )
    changes = systemsetup.compare(BEFORE, after)
    assert changes.violations == [] and changes.added == ["libgpgme11:amd64 1.18.0-3+deb12u1"]
