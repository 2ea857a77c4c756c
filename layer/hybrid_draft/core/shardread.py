"""The draft's planned tensors read from a shard with explicit reads, never through a mapping.

A memory-mapped shard (safetensors' ``safe_open``) that shrinks while it is read, as a
download still in progress or a network filesystem can, kills the process with SIGBUS at
the first page past the new end: no exception, no ``load_failed`` event. The draft's plan
already holds every byte range the draft needs (each kept tensor's dtype, shape and
offsets, from the header read once when the load was planned), so this reader reads those
ranges with ``preadv``: a file that ends early is a short read, raised as
:class:`ShardChanged` naming the shard, the tensor, the bytes expected and the size the
file has now. The file opened is first checked against the plan (its size and its
header's digest), so a shard replaced between the plan and the read is refused the same
way rather than read at offsets that are no longer its tensors'.

Adjacent kept tensors are read together, up to :data:`RUN_BYTES` a read, as the storage's
floor reads them: one large request instead of one per tensor. The memory they are read
into is used again (:class:`Buffers`) once no tensor refers to it, so a load that copies
each tensor into its parameter and drops it does not pay a fresh page fault for every page
of the draft. The tensors are those ``safe_open(...).get_tensor`` gives: same dtype (bf16
and the float8 formats included, F4 as ``float4_e2m1fn_x2`` with its last dimension
halved), shape and bytes, on the CPU; bytes no other tensor is given, and that are never
overwritten while any tensor refers to them.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from hybrid_draft import files
from hybrid_draft.core import checkpoint

#: safetensors' dtype names and the torch dtype ``safe_open`` gives for each (by name:
#: older torch builds lack some; a tensor of one they lack cannot be read there either).
TORCH_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "C64": "complex64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F4": "float4_e2m1fn_x2",
}
#: The dtypes stored two elements to a byte, whose last dimension torch counts in pairs.
_PACKED = {"F4"}


class ShardChanged(checkpoint.CheckpointError):
    """A shard that is not, or no longer, the file its draft's load was planned from."""


def _now(fd: int) -> str:
    try:
        return f"{os.fstat(fd).st_size:,} bytes"
    except OSError as exc:
        return f"unknown bytes ({exc.strerror or exc})"


def read_into(
    fd: int, view: memoryview, offset: int, path: str, run: Sequence[checkpoint.TensorInfo]
) -> None:
    """Fill ``view`` from ``offset`` of the open file ``fd`` with the tensors of ``run``
    (adjacent, starting at ``offset``); :class:`ShardChanged`, naming the tensor the file
    ends in, when it ends first."""
    want, got = len(view), 0
    while got < want:
        try:
            n = os.preadv(fd, [view[got:]], offset + got)
        except OSError as exc:
            t = _at(run, offset + got)
            raise ShardChanged(
                f"{files.show_path(path)}: reading tensor {files.show(t.name)} "
                f"({t.nbytes:,} bytes at offset {t.start:,}) failed: {exc.strerror or exc}"
            ) from None
        if n == 0:
            t = _at(run, offset + got)
            raise ShardChanged(
                f"{files.show_path(path)}: expected {t.nbytes:,} bytes of tensor "
                f"{files.show(t.name)} at offset {t.start:,}, but the file ends at "
                f"{offset + got:,} (it now has {_now(fd)}): it shrank after the draft's load "
                "was planned"
            )
        got += n


def _at(run: Sequence[checkpoint.TensorInfo], position: int) -> checkpoint.TensorInfo:
    """The tensor of ``run`` that holds the byte at ``position``."""
    return next((t for t in run if position < t.end), run[-1])


def torch_dtype(path: str, t: checkpoint.TensorInfo) -> torch.dtype:
    """The torch dtype ``safe_open`` gives a tensor (:class:`CheckpointError` if none)."""
    dtype = getattr(torch, TORCH_DTYPES.get(t.dtype, ""), None)
    if not isinstance(dtype, torch.dtype):
        raise checkpoint.CheckpointError(
            f"{files.show_path(path)}: tensor {files.show(t.name)}: dtype {t.dtype} has no "
            f"torch dtype in torch {torch.__version__} (safetensors cannot load it either)"
        )
    return dtype


def torch_shape(path: str, t: checkpoint.TensorInfo) -> tuple[int, ...]:
    """The shape ``safe_open`` gives: a packed dtype's last dimension counts pairs."""
    if t.dtype not in _PACKED:
        return t.shape
    if not t.shape or t.shape[-1] % 2:
        raise checkpoint.CheckpointError(
            f"{files.show_path(path)}: tensor {files.show(t.name)}: {t.dtype} with shape "
            f"{list(t.shape)}: torch needs its last dimension divisible by 2"
        )
    return (*t.shape[:-1], t.shape[-1] // 2)


def check(fd: int, path: str, shard: checkpoint.Shard) -> None:
    """Refuse a file that is not the shard planned: another size, or another header."""
    size = os.fstat(fd).st_size
    shown = files.show_path(path)
    if size != shard.size:
        raise ShardChanged(
            f"{shown}: the file has {size:,} bytes, not the {shard.size:,} its header "
            "described when the draft's load was planned: it changed since"
        )
    if shard.digest is None:
        return
    try:
        header = files.pread_exact(fd, shard.data_start, 0, path)
    except files.FileProblem as exc:
        raise ShardChanged(str(exc)) from None
    if checkpoint.header_digest(header) != shard.digest:
        raise ShardChanged(
            f"{shown}: its header is not the one the draft's load was planned from: the "
            "file was replaced or rewritten since"
        )


#: The most bytes one read takes: adjacent tensors are read together up to this.
RUN_BYTES = 16 << 20
#: A tensor joins a run only at an offset this aligned within it (every dtype's itemsize
#: divides it), so that its view of the run's memory has its dtype's alignment.
ALIGN = 16
#: How far ahead of the run being read the kernel is asked to read runs after a gap.
PREFETCH_BYTES = 256 << 20


def runs(tensors: Sequence[checkpoint.TensorInfo]) -> list[list[checkpoint.TensorInfo]]:
    """``tensors`` (in file order) in runs read by one request each: adjacent byte ranges,
    each tensor aligned in its run, up to :data:`RUN_BYTES` (one larger tensor alone)."""
    out: list[list[checkpoint.TensorInfo]] = []
    for t in tensors:
        if out:
            run = out[-1]
            first = run[0].start
            if (
                run[-1].end == t.start
                and (t.start - first) % ALIGN == 0
                and t.end - first <= RUN_BYTES
            ):
                run.append(t)
                continue
        out.append([t])
    return out


class Buffers:
    """The memory one draft read reads into, each block used again once no tensor refers
    to it.

    Memory the process has not touched costs a page fault per page (the kernel zeroes it)
    when it is first written: more than the read itself, for a draft of hundreds of MiB.
    A model's ``load_weights`` copies each tensor into its parameter and drops it, so the
    next run can be read into the same pages. A block returns here only when the array its
    tensors' storage holds is gone (a finalizer on it): a consumer that keeps a tensor keeps
    its bytes, never overwritten.
    """

    def __init__(self) -> None:
        self.free: list[np.ndarray[Any, np.dtype[np.uint8]]] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of memory no live tensor refers to, as a uint8 tensor."""
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        fits = [b for b in self.free if b.nbytes >= nbytes]
        if fits:
            block = min(fits, key=len)
            self.free.remove(block)
        else:
            self.free.clear()  # too small for this run: the allocator has them back
            block = np.empty(nbytes, dtype=np.uint8)
        lent = block[:nbytes]
        weakref.finalize(lent, self.free.append, block)
        return torch.from_numpy(lent)


class _Prefetch:
    """Asks the kernel to start reading the runs that follow a gap, a window ahead of use.

    A run adjacent to the one before it needs no hint: the kernel's own readahead follows
    a sequential read, in large requests. A run after a gap is one it cannot guess; asked
    for ahead (``POSIX_FADV_WILLNEED``, which only schedules reads of exactly that range),
    its read finds it cached. A no-op where the OS has no fadvise.
    """

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self.ranges, self.issued, self.ahead = ranges, 0, 0
        self.enabled = hasattr(os, "posix_fadvise")

    def before(self, fd: int, i: int) -> None:
        """Called before run ``i`` is read from ``fd``: keep the window ahead scheduled."""
        while (
            self.enabled
            and self.issued < len(self.ranges)
            and (self.issued <= i or self.ahead < PREFETCH_BYTES)
        ):
            j = self.issued
            start, end = self.ranges[j]
            if j > i and self.ranges[j - 1][1] != start:
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
            self.ahead += end - start
            self.issued += 1
        start, end = self.ranges[i]
        self.ahead -= end - start


def tensor(memory: torch.Tensor, base: int, path: str, t: checkpoint.TensorInfo) -> torch.Tensor:
    """Planned tensor ``t``, a view of ``memory`` (its run, read from offset ``base``)."""
    dtype, shape = torch_dtype(path, t), torch_shape(path, t)
    return memory[t.start - base : t.end - base].view(dtype).reshape(shape)


def read_shard(
    path: str,
    shard: checkpoint.Shard,
    tensors: Sequence[checkpoint.TensorInfo],
    buffers: Buffers | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each of ``tensors`` (the planned ones of ``shard``, at ``path``, in file order), read
    run by run into memory from ``buffers`` (a pool of this call's own without). The file is
    opened once, checked against the plan, and closed when the iteration ends."""
    try:
        fd, _ = files.open_regular(path)
    except FileNotFoundError:
        raise ShardChanged(
            f"{files.show_path(path)}: no such file (it was there when the draft's load "
            "was planned)"
        ) from None
    except files.FileProblem as exc:
        raise ShardChanged(str(exc)) from None
    pool = buffers if buffers is not None else Buffers()
    try:
        check(fd, path, shard)
        grouped = runs(tensors)
        prefetch = _Prefetch([(run[0].start, run[-1].end) for run in grouped])
        for i, run in enumerate(grouped):
            prefetch.before(fd, i)
            base = run[0].start
            memory = pool.take(run[-1].end - base)
            if len(memory):
                read_into(fd, memory.numpy().data, base, path, run)
            for t in run:
                yield t.name, tensor(memory, base, path, t)
            del memory
    finally:
        os.close(fd)
