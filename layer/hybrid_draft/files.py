"""Reading what a user or a checkpoint names without hanging or reading without bound.

Every file the layer and its commands read (the config, an events file, a safetensors index
or header, a ``config.json``) goes through :func:`open_regular`: the path must name a
regular file (after following symbolic links), checked with ``stat`` before it is opened,
then opened with ``O_NONBLOCK`` (so a FIFO swapped in after the check cannot block the
open) and checked again with ``fstat`` on the open descriptor, which is what is read. A
FIFO, a device such as ``/dev/zero``, a directory or a socket is refused with a one-line
:class:`FileProblem`; so is a file over the caller's size limit. Parsing errors of every
kind, deep nesting (``RecursionError``) and exhaustion (``MemoryError``) included, become
the same one-line problem. Stdlib only: the runtime imports this in every model load.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator
from typing import Any

#: The longest rendering of an input value or excerpt in a one-line message.
SHOW_LIMIT = 120


class FileProblem(ValueError):
    """A file that cannot be read as asked; ``str()`` is one line naming the path."""

    def __init__(self, path: str | os.PathLike[str], detail: str) -> None:
        self.path = os.fspath(path)
        self.detail = one_line(detail)
        super().__init__(f"{show_path(self.path)}: {self.detail}")


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line (white space runs folded), cut to ``limit`` characters."""
    folded = " ".join(str(text).split())
    return folded if len(folded) <= limit else folded[: limit - 3] + "..."


def error_line(exc: BaseException) -> str:
    """An exception's message on one line (:func:`one_line`), or its type when it has none."""
    return one_line(str(exc)) or type(exc).__name__


def show(value: object, limit: int = SHOW_LIMIT) -> str:
    """``repr(value)`` cut to ``limit`` characters: an input quoted in an error message."""
    try:
        text = repr(value)
    except Exception:  # RecursionError on a deeply nested value, among others
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def show_path(path: str | os.PathLike[str]) -> str:
    """A path as given, or its ``repr`` when it holds characters that would break a line."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if text.isprintable() and len(text) <= 4096:
        return text
    return show(text, 4096)


def describe(mode: int) -> str:
    """What kind of file ``mode`` is, for a message ("a FIFO", "a directory", ...)."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _os_detail(exc: OSError) -> str:
    return exc.strerror or str(exc)


def open_regular(path: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    """An open read-only descriptor on the regular file at ``path``, and its ``fstat``.

    Raises :class:`FileNotFoundError` when nothing is there (callers decide whether that
    is an error) and :class:`FileProblem` for anything else that stops the read.
    """
    try:
        before = os.stat(path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        detail = _os_detail(exc) if isinstance(exc, OSError) else str(exc)
        raise FileProblem(path, detail) from None
    if not stat.S_ISREG(before.st_mode):
        raise FileProblem(path, f"{describe(before.st_mode)}, not a regular file")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise FileProblem(path, _os_detail(exc)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between the check and the open
            raise FileProblem(path, f"{describe(st.st_mode)}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def pread_exact(fd: int, size: int, offset: int, path: str | os.PathLike[str]) -> bytes:
    """``size`` bytes at ``offset`` (fewer only if the file ends first)."""
    chunks = []
    while size > 0:
        try:
            chunk = os.pread(fd, min(size, 16 << 20), offset)
        except OSError as exc:
            raise FileProblem(path, _os_detail(exc)) from None
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def too_large(size: int, limit: int) -> str:
    return f"is {size:,} bytes, over the limit of {limit:,} bytes for this file"


def read_bytes(path: str | os.PathLike[str], limit: int) -> bytes:
    """The whole regular file at ``path``, which must hold at most ``limit`` bytes."""
    fd, st = open_regular(path)
    try:
        if st.st_size > limit:
            raise FileProblem(path, too_large(st.st_size, limit))
        data = pread_exact(fd, limit + 1, 0, path)  # the file may grow after fstat
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FileProblem(path, f"grew past the limit of {limit:,} bytes while read")
    return data


def decode(data: bytes, path: str | os.PathLike[str]) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileProblem(path, f"not UTF-8 text: {exc.reason} at byte {exc.start:,}") from None


def read_text(path: str | os.PathLike[str], limit: int) -> str:
    """The UTF-8 text of the regular file at ``path`` (at most ``limit`` bytes)."""
    return decode(read_bytes(path, limit), path)


def parse_json(
    text: str | bytes, path: str | os.PathLike[str], what: str = "JSON", **hooks: Any
) -> Any:
    """``json.loads`` whose every failure is one :class:`FileProblem` naming ``path``."""
    try:
        return json.loads(text, **hooks)
    except RecursionError:
        raise FileProblem(path, f"not valid {what}: nested too deeply") from None
    except MemoryError:
        raise FileProblem(path, f"not valid {what}: too large to parse in memory") from None
    except (ValueError, TypeError) as exc:  # JSON, UTF-8 and hook errors alike
        raise FileProblem(path, f"not valid {what}: {one_line(str(exc))}") from None


def read_json(path: str | os.PathLike[str], limit: int, what: str = "JSON") -> Any:
    """The parsed JSON of the regular file at ``path`` (at most ``limit`` bytes)."""
    return parse_json(read_text(path, limit), path, what)


def read_lines(
    path: str | os.PathLike[str], limit: int, line_limit: int
) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` for each line of the regular file at ``path``, read as a
    stream: the file may hold at most ``limit`` bytes, and a line longer than
    ``line_limit`` bytes is yielded as ``b""`` (skipped) rather than held in memory."""
    fd, st = open_regular(path)
    if st.st_size > limit:
        os.close(fd)
        raise FileProblem(path, too_large(st.st_size, limit))
    with os.fdopen(fd, "rb", buffering=1 << 16) as f:
        total = 0
        number = 0
        while True:
            try:
                line = f.readline(line_limit + 1)
            except OSError as exc:
                raise FileProblem(path, _os_detail(exc)) from None
            if not line:
                return
            number += 1
            total += len(line)
            if len(line) > line_limit and not line.endswith(b"\n"):
                while True:  # skip the rest of an over-long line in bounded pieces
                    rest = f.readline(line_limit + 1)
                    total += len(rest)
                    if not rest or rest.endswith(b"\n"):
                        break
                line = b""
            if total > limit:
                raise FileProblem(path, f"grew past the limit of {limit:,} bytes while read")
            yield number, line


def checked(parse: Callable[[], Any], path: str | os.PathLike[str], what: str) -> Any:
    """Run ``parse`` and turn recursion and memory errors into a :class:`FileProblem`."""
    try:
        return parse()
    except RecursionError:
        raise FileProblem(path, f"not valid {what}: nested too deeply") from None
    except MemoryError:
        raise FileProblem(path, f"not valid {what}: too large to parse in memory") from None
