"""The draft's planned tensors read from a shard with explicit reads, never through a mapping.

A memory-mapped shard (safetensors' ``safe_open``) that shrinks while it is read, as a
download still in progress or a network filesystem can, kills the process with SIGBUS at
the first page past the new end: no exception, no ``load_failed`` event. The draft's plan
already holds every byte range the draft needs (each kept tensor's dtype, shape and
offsets, from the header read once when the load was planned), so this reader reads those
ranges with ``preadv`` into each tensor's own buffer: a file that ends early is a short
read, raised as :class:`ShardChanged` naming the shard, the tensor, the bytes expected and
the size the file has now. The file opened is first checked against the plan (its size and
its header's digest), so a shard replaced between the plan and the read is refused the same
way rather than read at offsets that are no longer its tensors'. The tensors are those
``safe_open(...).get_tensor`` gives: same dtype (bf16 and the float8 formats included, F4 as
``float4_e2m1fn_x2`` with its last dimension halved), shape and bytes, on the CPU, each
owning its memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hybrid_draft import checkpoint, files

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


def read_into(fd: int, view: memoryview, offset: int, path: str, what: str) -> None:
    """Fill ``view`` from ``offset`` of the open file ``fd``; :class:`ShardChanged` when the
    file ends first. ``path`` and ``what`` (the tensor) name the read in the error."""
    want, got = len(view), 0
    while got < want:
        try:
            n = os.preadv(fd, [view[got:]], offset + got)
        except OSError as exc:
            raise ShardChanged(
                f"{files.show_path(path)}: reading {what} ({want:,} bytes at offset "
                f"{offset:,}) failed: {exc.strerror or exc}"
            ) from None
        if n == 0:
            raise ShardChanged(
                f"{files.show_path(path)}: expected {want:,} bytes of {what} at offset "
                f"{offset:,}, but the file ends at {offset + got:,} (it now has {_now(fd)}): "
                "it shrank after the draft's load was planned"
            )
        got += n


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


def tensor(fd: int, path: str, t: checkpoint.TensorInfo) -> torch.Tensor:
    """One planned tensor, read whole into memory it owns."""
    dtype, shape = torch_dtype(path, t), torch_shape(path, t)
    buffer = torch.empty(t.nbytes, dtype=torch.uint8)
    if t.nbytes:
        read_into(fd, buffer.numpy().data, t.start, path, f"tensor {files.show(t.name)}")
    return buffer.view(dtype).reshape(shape)


def read_shard(
    path: str,
    shard: checkpoint.Shard,
    tensors: Sequence[checkpoint.TensorInfo],
    before: Any = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each of ``tensors`` (the planned ones of ``shard``, at ``path``) in order; ``before(fd,
    i)`` is called ahead of tensor ``i`` (the prefetch). The file is opened once, checked
    against the plan, and closed when the iteration ends."""
    try:
        fd, _ = files.open_regular(path)
    except FileNotFoundError:
        raise ShardChanged(
            f"{files.show_path(path)}: no such file (it was there when the draft's load "
            "was planned)"
        ) from None
    except files.FileProblem as exc:
        raise ShardChanged(str(exc)) from None
    try:
        check(fd, path, shard)
        for i, t in enumerate(tensors):
            if before is not None:
                before(fd, i)
            yield t.name, tensor(fd, path, t)
    finally:
        os.close(fd)
