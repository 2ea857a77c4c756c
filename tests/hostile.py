"""Hostile files for the bad-input tests, made fresh at the path a test names: each returns the
path to hand to the code under test."""

from __future__ import annotations

import os
from pathlib import Path


def fifo(p: Path) -> Path:
    """A FIFO: an open for reading would wait for a writer forever."""
    os.mkfifo(p)
    return p


def dev_zero(p: Path) -> Path:
    """A link to ``/dev/zero``: endless bytes."""
    p.symlink_to("/dev/zero")
    return p


def directory(p: Path) -> Path:
    p.mkdir()
    return p


def huge(p: Path) -> Path:
    """A 1 GiB file (sparse: no disk used), over every limit of the layer's reads."""
    with open(p, "wb") as f:
        f.truncate(1 << 30)
    return p


def under_a_file(p: Path) -> Path:
    """A path whose parent is a regular file."""
    p.write_text("a regular file")
    return p / "x"
