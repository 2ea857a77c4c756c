"""What scripts/system-setup installed, and whether the test command changed the host beyond it.

scripts/system-setup installs everything the suite and the image test need from the system
before any test starts, and records the time it finished and the versions it left
(``build/system-setup.txt``, ``$HYBRID_DRAFT_SYSTEM_RECORD``). A package installed or
upgraded while tests run changes the host under them (Debian trixie's Docker packages bring
a newer libc and libssl: every new Python importing hashlib fails until dpkg is done), so
the suite checks dpkg's own log: no ``install`` or ``upgrade`` line after pytest started.

The test command may add packages of the host's own release, and nothing else: no package
upgraded or removed, none from another release, ``/etc/apt``, ``/etc/debian_version`` and
``python3 --version`` as they were (installed with their dependencies, another release's
packages upgrade the host's libc, apt, python3 and a hundred more). scripts/test records the
host's state (:class:`HostState`) as its first step and compares the host with it as its
last (:func:`compare`).

Run as a script, by any python3 (the standard library only):

- ``python3 tests/systemsetup.py record FILE`` writes the host's state to FILE;
- ``python3 tests/systemsetup.py compare FILE`` exits 1, in one line naming each change,
  when the host changed since FILE beyond new packages of its own release;
- ``python3 tests/systemsetup.py since EPOCH`` exits 1, listing them, when dpkg installed or
  upgraded anything after EPOCH.

Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

RECORD_ENV = "HYBRID_DRAFT_SYSTEM_RECORD"
#: The host's state scripts/test wrote as its first step (``record``).
HOST_RECORD_ENV = "HYBRID_DRAFT_HOST_RECORD"
DPKG_LOG = Path("/var/log/dpkg.log")
#: The dpkg log actions that change what is installed (``status`` and ``configure`` lines
#: follow them; ``remove`` and ``purge`` take away, which no step of the suite does).
CHANGES = ("install", "upgrade", "remove", "purge")
ETC_APT = Path("/etc/apt")
DEBIAN_VERSION = Path("/etc/debian_version")
OS_RELEASE = Path("/etc/os-release")
#: The pythons whose version must not change: the one on PATH and the system's own.
PYTHONS = ("python3", "/usr/bin/python3")
#: Suites that carry a release's own updates: ``bookworm-security`` is bookworm.
UPDATE_SUITES = re.compile(r"-(updates|security|proposed-updates)$")
#: An installed version apt finds in no list of its sources.
LOCAL = "local"
#: Where scripts/system-setup keeps the lists it installs by (the host's own sources, fetched
#: afresh into a folder of its own so that the host's package index stays as it was): a
#: package it installed at a version the host's older lists do not hold yet (a security
#: update published since) is found there.
SETUP_LISTS = (
    Path(
        os.environ.get(
            "HYBRID_DRAFT_SYSTEM_TOOLS", Path(__file__).resolve().parents[1] / "build/system-tools"
        )
    )
    / "host-apt/lists"
)
#: How many changes the one line of ``compare`` names before it counts the rest.
SHOWN = 12


@dataclass(frozen=True)
class Record:
    """What scripts/system-setup wrote: when it finished, each host package's version, and
    each package unpacked into build/system-tools (never installed) with its release."""

    finished: float
    packages: dict[str, str] = field(default_factory=dict)
    tools: dict[str, tuple[str, str]] = field(default_factory=dict)


def read_record(path: Path) -> Record:
    """Parse the record; ValueError names the line that is not one the set-up step writes."""
    finished: float | None = None
    packages: dict[str, str] = {}
    tools: dict[str, tuple[str, str]] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        words = line.split()
        if len(words) == 3 and words[0] == "finished":
            finished = float(words[1])
        elif len(words) == 3 and words[0] == "package":
            packages[words[1]] = words[2]
        elif len(words) == 4 and words[0] == "tool":
            tools[words[1]] = (words[2], words[3])
        else:
            raise ValueError(f"{path}:{n}: not a line scripts/system-setup writes: {line!r}")
    if finished is None:
        raise ValueError(f"{path}: no 'finished' line")
    return Record(finished, packages, tools)


def changes_since(log_text: str, since: float) -> list[str]:
    """dpkg log lines that installed, upgraded or removed a package after ``since``.

    dpkg stamps its lines in local time to the second; a line stamped in the very second
    ``since`` falls in counts as before it (the set-up step may end in that second).
    """
    cutoff = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
    found = []
    for line in log_text.splitlines():
        words = line.split()
        if len(words) >= 4 and words[2] in CHANGES and f"{words[0]} {words[1]}" > cutoff:
            found.append(line)
    return found


def dpkg_changes_since(since: float, log: Path = DPKG_LOG) -> list[str]:
    """:func:`changes_since` on dpkg's log; empty where the host has none (not Debian)."""
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    return changes_since(text, since)


def installed_versions(packages: list[str]) -> dict[str, str]:
    """Each package's installed version now, as dpkg-query gives it (``none`` if absent)."""
    out = {}
    for name in packages:
        got = subprocess.run(
            ["dpkg-query", "-W", "-f", "${Version}", name], capture_output=True, text=True
        )
        out[name] = got.stdout.strip() if got.returncode == 0 and got.stdout.strip() else "none"
    return out


def record_path(env: str = RECORD_ENV) -> Path | None:
    """The record scripts/test wrote (its set-up step's, or with ``HOST_RECORD_ENV`` the
    host's state), or None outside scripts/test."""
    value = os.environ.get(env)
    return Path(value) if value else None


# --- the host's state ----------------------------------------------------------------------


@dataclass(frozen=True)
class Package:
    """An installed package: its version, and the releases whose lists hold that version
    (``bookworm``, ``trixie``, comma-joined; :data:`LOCAL` where none does)."""

    version: str
    origin: str


@dataclass(frozen=True)
class HostState:
    """What the test command must leave as it found it, but for new packages of ``release``."""

    release: str
    debian_version: str
    pythons: dict[str, str] = field(default_factory=dict)
    etc_apt: dict[str, str] = field(default_factory=dict)
    packages: dict[str, Package] = field(default_factory=dict)
    #: What ``apt list --upgradable`` lists: each package whose candidate in apt's lists
    #: is another version than the installed one, with that candidate.
    upgradable: dict[str, str] = field(default_factory=dict)


def release_of(suite: str) -> str:
    """The release a suite of apt's sources belongs to (``bookworm-security/main``:
    ``bookworm``)."""
    return UPDATE_SUITES.sub("", suite.split("/", 1)[0])


def installed_origins(policy: str) -> dict[str, str]:
    """Each package's installed-version origin, from ``apt-cache policy NAME...``'s output:
    the releases of the lists under the version marked ``***``."""
    origins: dict[str, str] = {}
    name, installed, releases = "", False, set[str]()

    def done() -> None:
        if name:
            origins[name] = ",".join(sorted(releases)) or LOCAL

    for line in policy.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            done()
            name, installed, releases = line[:-1], False, set()
        elif re.match(r"^ (\*\*\*|   ) \S+ -?\d+$", line):
            installed = line.startswith(" ***")
        elif installed and (words := line.split()) and len(words) >= 4 and words[0].isdigit():
            releases.add(release_of(words[2]))
    done()
    return origins


def installed_packages() -> dict[str, str]:
    """Every package dpkg has installed (``name`` or ``name:arch`` for a foreign one) and its
    version; empty where there is no dpkg."""
    if shutil.which("dpkg-query") is None:
        return {}
    out = subprocess.run(
        ["dpkg-query", "-W", "-f", "${binary:Package}\t${Version}\t${Status}\n"],
        capture_output=True,
        text=True,
    )
    found = {}
    for line in out.stdout.splitlines():
        name, version, status = line.split("\t")
        if status.endswith(" installed"):
            found[name] = version
    return found


def upgradable_in(policy: str) -> dict[str, str]:
    """Each package ``apt-cache policy NAME...``'s output shows with a candidate other than
    its installed version (what ``apt list --upgradable`` lists), and that candidate."""
    found: dict[str, str] = {}
    name, installed = "", ""
    for line in policy.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            name, installed = line[:-1], ""
        elif line.startswith("  Installed: "):
            installed = line.split(": ", 1)[1]
        elif line.startswith("  Candidate: ") and name:
            candidate = line.split(": ", 1)[1]
            if installed not in ("", "(none)") and candidate not in ("(none)", installed):
                found[name] = candidate
    return found


def package_policy(
    names: list[str], lists: Path | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """:func:`installed_origins` and :func:`upgradable_in` for these packages, as apt's
    lists stand now (the host's, or those in ``lists``)."""
    if shutil.which("apt-cache") is None:
        return {}, {}
    origins: dict[str, str] = {}
    upgradable: dict[str, str] = {}
    options = ["-o", f"Dir::State::Lists={lists}"] if lists is not None else []
    for start in range(0, len(names), 500):
        out = subprocess.run(
            ["apt-cache", *options, "policy", *names[start : start + 500]],
            capture_output=True,
            text=True,
            env={**os.environ, "LC_ALL": "C"},
        )
        origins.update(installed_origins(out.stdout))
        upgradable.update(upgradable_in(out.stdout))
    return origins, upgradable


def tree_digests(root: Path) -> dict[str, str]:
    """Every path under ``root``: a file's sha256, ``link:`` and its target's, ``dir`` for a
    folder."""
    found: dict[str, str] = {}
    if not root.is_dir():
        return found
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            if path.is_symlink():
                target = os.readlink(path).encode()
                found[str(path)] = "link:" + hashlib.sha256(target).hexdigest()
            elif path.is_dir():
                found[str(path)] = "dir"
            else:
                try:
                    found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
                except OSError:
                    found[str(path)] = "unreadable"
    return found


def python_version(python: str) -> str:
    """``python --version`` (``3.11.2``), or ``none`` where there is no such python."""
    found = shutil.which(python)
    if found is None:
        return "none"
    out = subprocess.run([found, "--version"], capture_output=True, text=True)
    return (out.stdout + out.stderr).strip().removeprefix("Python ") or "none"


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return "none"


def merged_origins(host: dict[str, str], setup: dict[str, str]) -> dict[str, str]:
    """Each package's origin by the host's lists, or, where they hold its installed version in
    no release, by the set-up step's own lists (:data:`SETUP_LISTS`)."""
    return {
        n: setup[n] if o == LOCAL and setup.get(n, LOCAL) != LOCAL else o for n, o in host.items()
    }


def host_state() -> HostState:
    """The host as it is now."""
    fields = dict(line.split("=", 1) for line in _read(OS_RELEASE).splitlines() if "=" in line)
    versions = installed_packages()
    origins, upgradable = package_policy(sorted(versions))
    unlisted = sorted(n for n, o in origins.items() if o == LOCAL)
    if unlisted and SETUP_LISTS.is_dir():  # what the set-up step installed by, if anything
        origins = merged_origins(origins, package_policy(unlisted, SETUP_LISTS)[0])
    # apt names a package of the host's own architecture without it (libc6, not libc6:amd64)
    origins.update(
        {
            n: origins[n.split(":")[0]]
            for n in versions
            if n not in origins and n.split(":")[0] in origins
        }
    )
    return HostState(
        release=fields.get("VERSION_CODENAME", "").strip('"') or "none",
        debian_version=_read(DEBIAN_VERSION),
        pythons={python: python_version(python) for python in PYTHONS},
        etc_apt=tree_digests(ETC_APT),
        packages={n: Package(v, origins.get(n, LOCAL)) for n, v in versions.items()},
        upgradable=upgradable,
    )


def write_state(state: HostState, path: Path) -> None:
    """The state as lines of words (a path last, as it may hold spaces)."""
    lines = [f"release {state.release}", f"debian_version {state.debian_version}"]
    lines += [f"python {name} {version}" for name, version in state.pythons.items()]
    lines += [f"etc_apt {digest} {path}" for path, digest in state.etc_apt.items()]
    lines += [f"package {n} {p.version} {p.origin}" for n, p in sorted(state.packages.items())]
    lines += [f"upgradable {n} {v}" for n, v in sorted(state.upgradable.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(path)


def read_state(path: Path) -> HostState:
    """Parse :func:`write_state`'s file; ValueError names a line it does not write."""
    release = debian_version = None
    pythons: dict[str, str] = {}
    etc_apt: dict[str, str] = {}
    packages: dict[str, Package] = {}
    upgradable: dict[str, str] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        kind, _, rest = line.partition(" ")
        words = rest.split(" ")
        if kind == "release" and len(words) == 1:
            release = rest
        elif kind == "debian_version" and rest:
            debian_version = rest
        elif kind == "python" and len(words) >= 2:
            pythons[words[0]] = " ".join(words[1:])
        elif kind == "etc_apt" and len(words) >= 2:
            etc_apt[rest.split(" ", 1)[1]] = words[0]
        elif kind == "package" and len(words) == 3:
            packages[words[0]] = Package(words[1], words[2])
        elif kind == "upgradable" and len(words) == 2:
            upgradable[words[0]] = words[1]
        else:
            raise ValueError(f"{path}:{n}: not a line of a host record: {line!r}")
    if release is None or debian_version is None:
        raise ValueError(f"{path}: no 'release' or 'debian_version' line: not a host record")
    return HostState(release, debian_version, pythons, etc_apt, packages, upgradable)


@dataclass(frozen=True)
class HostChanges:
    """How the host changed: ``added`` (new packages of its own release: allowed) and
    ``violations`` (everything else), one short phrase each."""

    added: list[str]
    violations: list[str]


def compare(before: HostState, after: HostState) -> HostChanges:
    """What changed from ``before`` to ``after``; only new packages that the release of
    ``before`` holds are allowed."""
    bad: list[str] = []
    if after.release != before.release:
        bad.append(f"release {before.release} -> {after.release}")
    if after.debian_version != before.debian_version:
        bad.append(f"{DEBIAN_VERSION} {before.debian_version} -> {after.debian_version}")
    for python in sorted(set(before.pythons) | set(after.pythons)):
        was, now = before.pythons.get(python, "none"), after.pythons.get(python, "none")
        if was != now:
            bad.append(f"{python} --version {was} -> {now}")
    for path in sorted(set(before.etc_apt) | set(after.etc_apt)):
        was, now = before.etc_apt.get(path), after.etc_apt.get(path)
        if was != now:
            what = "added" if was is None else "removed" if now is None else "changed"
            bad.append(f"{path} {what}")
    added = []
    for name, package in sorted(after.packages.items()):
        old = before.packages.get(name)
        if old is None and before.release in package.origin.split(","):
            added.append(f"{name} {package.version}")
        elif old is None:
            origin = "no release's lists" if package.origin == LOCAL else package.origin
            bad.append(f"{name} {package.version} installed from {origin}, not {before.release}")
        elif old.version != package.version:
            bad.append(f"{name} {old.version} -> {package.version}")
    for name in sorted(set(before.packages) - set(after.packages)):
        bad.append(f"{name} {before.packages[name].version} removed")
    # The host's package index, as `apt list --upgradable` reads it: a refreshed list shows
    # upgrades the host did not show before (or hides ones it did).
    for name in sorted(set(before.upgradable) | set(after.upgradable)):
        was, now = before.upgradable.get(name), after.upgradable.get(name)
        if was != now and name in before.packages and name in after.packages:
            shown = "not upgradable" if now is None else f"upgradable to {now}"
            bad.append(f"apt list --upgradable: {name} now {shown}")
    return HostChanges(added, bad)


def summary(changes: HostChanges, record: Path, release: str) -> str:
    """The one line ``compare`` prints."""
    if changes.violations:
        shown = "; ".join(changes.violations[:SHOWN])
        more = len(changes.violations) - SHOWN
        return f"the host changed since {record} beyond new packages of {release}: {shown}" + (
            f"; and {more} more" if more > 0 else ""
        )
    if changes.added:
        return (
            f"the host as in {record}, but {len(changes.added)} packages newly installed from "
            f"{release}: {', '.join(changes.added)}"
        )
    return f"the host as in {record}"


def main(argv: list[str]) -> int:
    usage = "usage: systemsetup.py record FILE | compare FILE | since EPOCH_SECONDS"
    if len(argv) != 2 or argv[0] not in ("record", "compare", "since"):
        print(usage, file=sys.stderr)
        return 2
    command, arg = argv
    if command == "record":
        write_state(host_state(), Path(arg))
        return 0
    if command == "compare":
        try:
            before = read_state(Path(arg))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            print(f"systemsetup.py: {e}", file=sys.stderr)
            return 2
        changes = compare(before, host_state())
        line = summary(changes, Path(arg), before.release)
        print(line, file=sys.stderr if changes.violations else sys.stdout)
        return 1 if changes.violations else 0
    try:
        since = float(arg)
    except ValueError:
        print(f"systemsetup.py: EPOCH_SECONDS must be a number, got {arg!r}", file=sys.stderr)
        return 2
    found = dpkg_changes_since(since)
    for line in found:
        print(f"installed while the tests ran: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
