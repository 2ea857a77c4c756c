"""What scripts/system-setup installed, and whether anything was installed after it.

scripts/system-setup installs everything the suite and the image test need from the system
before any test starts, and records the time it finished and the versions it left
(``build/system-setup.txt``, ``$HYBRID_DRAFT_SYSTEM_RECORD``). A package installed or
upgraded while tests run changes the host under them (Debian trixie's Docker packages bring
a newer libc and libssl: every new Python importing hashlib fails until dpkg is done), so
the suite checks dpkg's own log: no ``install`` or ``upgrade`` line after pytest started.

Run as a script (scripts/test does, once pytest and the image test are both done):
``python tests/systemsetup.py EPOCH`` exits 1, listing them, when dpkg installed or upgraded
anything after EPOCH.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

RECORD_ENV = "HYBRID_DRAFT_SYSTEM_RECORD"
DPKG_LOG = Path("/var/log/dpkg.log")
#: The dpkg log actions that change what is installed (``status`` and ``configure`` lines
#: follow them; ``remove`` and ``purge`` take away, which no step of the suite does).
CHANGES = ("install", "upgrade", "remove", "purge")


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


def record_path() -> Path | None:
    """The record scripts/test's set-up step wrote, or None outside scripts/test."""
    value = os.environ.get(RECORD_ENV)
    return Path(value) if value else None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: systemsetup.py EPOCH_SECONDS", file=sys.stderr)
        return 2
    try:
        since = float(argv[0])
    except ValueError:
        print(f"systemsetup.py: EPOCH_SECONDS must be a number, got {argv[0]!r}", file=sys.stderr)
        return 2
    found = dpkg_changes_since(since)
    for line in found:
        print(f"installed while the tests ran: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
