"""Cold-cache measurement helpers: evict files from the page cache, count resident pages,
bytes read from storage, peak RSS, and wait out background child processes. Linux only
(posix_fadvise, mincore, /proc)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import resource
import time
from collections.abc import Iterable

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(resident, total) pages of one file in the page cache, by ``mincore``."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return sum(b & 1 for b in vec), pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def resident_bytes(paths: Iterable[str | os.PathLike[str]]) -> int:
    return sum(resident_pages(p)[0] for p in paths) * PAGE


def evict(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Drop every page of ``paths`` from the page cache; return the pages still resident."""
    left = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        left += resident_pages(path)[0]
    return left


def _io(field: str) -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/io has no {field}")


def read_bytes() -> int:
    """Bytes this process (all its threads) caused to be fetched from storage."""
    return _io("read_bytes")


def read_chars() -> int:
    """Bytes this process (all its threads) has had returned by ``read(2)`` and its kin
    (``rchar``): from files, the page cache included, and from sockets a client reads with
    ``read(2)``, as the Run:ai Model Streamer's S3 client does; ``recv(2)`` is not counted."""
    return _io("rchar")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak_rss() -> int:
    """This process's peak resident set size in bytes (``VmHWM``).

    Not ``ru_maxrss``: that survives ``exec`` and so reports the parent's size in a worker
    started from a large process; ``VmHWM`` belongs to the address space exec replaces.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def children() -> list[int]:
    """This process's child processes still running (zombies, which have ended, left out),
    from ``/proc/self/task/*/children``; none where the kernel does not list them."""
    found = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                found += [int(pid) for pid in f.read().split()]
        except OSError:
            continue
    running = []
    for pid in found:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            running.append(pid)
    return running


def settle(timeout: float = 300.0) -> float:
    """Wait until this process has no child process running, at most ``timeout`` seconds;
    return the seconds waited.

    Importing vLLM 0.33 starts two background builds of a kernel launcher (its ``humming``
    dependency), seconds of CPU each: a run timed beside them measures them too (on two
    cores, a draft load took 0.60 s next to them and 0.09 s without). The bench sets
    ``HUMMING_DISABLE_PARALLEL_BUILD=1`` so that they do not start; this waits out any that
    do, and any other process an import leaves behind.
    """
    start = time.perf_counter()
    while children() and time.perf_counter() - start < timeout:
        time.sleep(0.05)
    return time.perf_counter() - start
