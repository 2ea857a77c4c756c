"""Safetensors checkpoints read the cheap way: the index and each shard's header, no data.

A shard header is an 8-byte little-endian length and that many bytes of JSON. Reading it
with two plain reads costs far less than ``safe_open`` (which maps the file and validates
it): on the 163 shards of a DeepSeek-V3 layout, 0.12 s against 1.8 s. The header is held to
exactly the rules safetensors applies (its Rust ``SafeTensors::read_metadata`` and
``Metadata::validate``), so a shard is accepted here if and only if ``safe_open`` accepts it;
:class:`CheckpointError` names the shard, the tensor and the rule. Files are read through
:mod:`hybrid_draft.files` (regular files only, never a blocking open, bounded sizes), and
the shards an index names are resolved as vLLM resolves them: plain ``*.safetensors`` file
names inside the model directory, through symbolic links only into that directory or, for
a Hugging Face cache snapshot, into the cache's ``blobs``. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import math
import os
import stat
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

from hybrid_draft import files
from hybrid_draft.core import figures

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
#: safetensors' own bound on a header's length (its ``MAX_HEADER_SIZE``).
MAX_HEADER = 100_000_000
#: The largest index read (a DeepSeek-V3 index, 92,000 tensors, is 9 MB).
INDEX_LIMIT = 64 << 20
#: The largest ``config.json`` read (real ones are under 100 kB).
CONFIG_LIMIT = 16 << 20
#: Bits per element of each dtype safetensors 0.8 knows.
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
_USIZE_MAX = (1 << 64) - 1
#: The deepest value serde_json (safetensors' parser) reads inside a tensor entry's field:
#: its recursion limit of 128 levels, less the header object and the entry.
_FIELD_DEPTH = 125
_TENSOR_FIELDS = ("dtype", "shape", "data_offsets")
#: The largest magnitude serde_json reads as a number (an f64's); past it, "out of range".
_F64_MAX = 1.7976931348623157e308


class TensorInfo(NamedTuple):
    """One tensor's place in its shard: absolute byte range ``[start, end)`` in the file.

    A named tuple, not a dataclass: a DeepSeek-V3 layout has 92,000 of them.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def header_digest(data: bytes) -> str:
    """The digest of a shard's header bytes (its 8-byte length and JSON): what a reader
    compares to know the file it opens is the one its plan was made from."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True)
class ObjectVersion:
    """Which version of an object in object storage a header was read from: what a reader
    pins its requests to, and compares before and after it reads."""

    #: The object's ETag, as the store quotes it (None: the store gave none).
    etag: str | None
    #: The object's version id in a versioned bucket (None: not versioned).
    version_id: str | None
    #: The object's whole size in bytes.
    size: int
    #: A ``gs://`` object's generation, which names one version of it (None: another store).
    generation: str | None = None

    def __str__(self) -> str:
        if self.generation:
            parts = [f"generation {self.generation}"]
        else:
            parts = [f"ETag {self.etag}" if self.etag else "no ETag"]
        if self.version_id:
            parts.append(f"version {self.version_id}")
        return f"{', '.join(parts)}, {self.size:,} bytes"


@dataclass(frozen=True)
class Shard:
    path: Path
    tensors: tuple[TensorInfo, ...]
    #: :func:`header_digest` of the header as read (None: not known).
    digest: str | None = dataclasses.field(default=None, compare=False)
    #: The object-storage address of a shard that is not a local file (``s3://...``): what
    #: its loader opens. ``path`` then holds the object's key, for its name.
    uri: str | None = None
    #: The version of the object its header was read from (None: a local file, or a store
    #: the layer reads no versions of).
    version: ObjectVersion | None = dataclasses.field(default=None, compare=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def location(self) -> str:
        """What a loader opens: the local path, or the object-storage address."""
        return self.uri if self.uri is not None else str(self.path)

    @property
    def data_start(self) -> int:
        """Where the tensors' data begins: 8 bytes and the header's length."""
        return self.tensors[0].start if self.tensors else 0

    @property
    def size(self) -> int:
        """The file's size as its header describes it (the data ends the file)."""
        return self.tensors[-1].end if self.tensors else 0

    @functools.cached_property
    def nbytes(self) -> int:
        """The tensors' bytes (asked for per row of a plan: summed once)."""
        return sum(t.end - t.start for t in self.tensors)


class CheckpointError(ValueError):
    """A checkpoint directory or shard that is not a readable safetensors checkpoint; one line
    that names the file (and the tensor) and the rule it breaks."""


def refuse_irregular(paths: Iterable[str]) -> None:
    """Raise :class:`CheckpointError` for the first local shard of ``paths`` that is not a
    regular file: a FIFO no one writes to would hold a load's read for ever (its ``open``
    waits in the kernel, where nothing can stop it), a device would be read without end.
    Objects in object storage are not looked at; a missing file is left to the loader."""
    for path in paths:
        if figures.is_object_uri(path):
            continue
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue
        if not stat.S_ISREG(mode):
            raise CheckpointError(
                f"{files.show_path(path)}: {files.describe(mode)}, not a regular file: a "
                "shard must be one (a read of a FIFO waits for a writer, of a device "
                "without end)"
            )


# --- the header, as safetensors parses it ---------------------------------------------------


class _Repeated(list):  # type: ignore[type-arg]
    """A JSON object with a repeated key, kept as its ``(key, value)`` pairs in order:
    safetensors rejects some repeats (a field of a tensor) and not others (a tensor name)."""


def _object(pairs: list[tuple[str, Any]]) -> Any:
    obj = dict(pairs)
    return obj if len(obj) == len(pairs) else _Repeated(pairs)


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _int(text: str) -> int | float:
    """serde_json's reading: ``-0`` and integers past i64/u64 are floats (never a size)."""
    if text != "-0" and len(text) <= 20:
        value = int(text)
        if -(1 << 63) <= value <= _USIZE_MAX:
            return value
    return _float(text)


def _pairs(obj: Any) -> list[tuple[str, Any]]:
    return list(obj) if isinstance(obj, _Repeated) else list(obj.items())


def _depth(value: Any) -> int:
    """How deeply ``value`` nests (a scalar is 0), without recursion; -1 when it holds an
    integer too large for serde_json (past an f64), which safetensors refuses anywhere."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, _Repeated):
            children = (v for _, v in item)
        elif isinstance(item, list):
            children = item
        else:
            if type(item) is int and abs(item) > _F64_MAX:
                return -1
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def _lone_surrogate(value: Any) -> bool:
    """Whether a string anywhere in ``value`` (keys too) holds an unpaired surrogate."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):  # a _Repeated's items are (key, value) tuples
            stack.extend(item)
    return False


def _usize(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _USIZE_MAX


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (dict, _Repeated)):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "a string"


def _where(path: str, name: str) -> str:
    return f"{path}: tensor {files.show(name)}"


def _entry(path: str, name: str, meta: Any) -> tuple[int, int, str, tuple[int, ...], int]:
    """One tensor entry, type-checked as safetensors' ``TensorInfo``: (begin, end, dtype,
    shape, size in bits, or -1 where the size overflows 64 bits). Raises
    :class:`CheckpointError` naming the shard and the tensor. Written for speed: a
    DeepSeek-V3 checkpoint has 92,000 entries."""
    if type(meta) is dict and len(meta) == 3 and "data_offsets" in meta and "shape" in meta:
        dtype, shape, offsets = meta.get("dtype"), meta["shape"], meta["data_offsets"]
        if dtype is None and "dtype" not in meta:
            dtype, shape, offsets = _fields(_where(path, name), _pairs(meta))
    elif isinstance(meta, (dict, _Repeated)):
        dtype, shape, offsets = _fields(_where(path, name), _pairs(meta))
    elif type(meta) is list:  # serde reads a struct from a sequence of its fields, too
        if len(meta) != 3:
            raise CheckpointError(
                f"{_where(path, name)}: a list of {len(meta)} items where safetensors wants "
                "an object (or the list [dtype, shape, data_offsets])"
            )
        dtype, shape, offsets = meta
    else:
        raise CheckpointError(
            f"{_where(path, name)} has no valid dtype, shape and data_offsets in the header: "
            f"its entry is {_kind(meta)}, not an object"
        )
    if type(dtype) is not str:
        dtype = _dtype_map(_where(path, name), dtype)
    bits = DTYPE_BITS.get(dtype)
    if bits is None:
        raise CheckpointError(
            f"{_where(path, name)}: dtype {files.show(dtype)} is not one safetensors knows "
            f"({', '.join(DTYPE_BITS)})"
        )
    if type(shape) is not list:
        raise CheckpointError(
            f"{_where(path, name)}: shape {files.show(shape)} is not a list of non-negative "
            "integers"
        )
    count = 1
    for d in shape:
        if type(d) is not int or d < 0 or d > _USIZE_MAX:
            raise CheckpointError(
                f"{_where(path, name)}: shape {files.show(shape)} is not a list of "
                "non-negative integers"
            )
        if count <= _USIZE_MAX:  # as safetensors: the first overflow is final, a 0 after it too
            count *= d
    if (
        type(offsets) is not list
        or len(offsets) != 2
        or type(offsets[0]) is not int
        or type(offsets[1]) is not int
        or not 0 <= offsets[0] <= _USIZE_MAX
        or not 0 <= offsets[1] <= _USIZE_MAX
    ):
        raise CheckpointError(
            f"{_where(path, name)}: data_offsets {files.show(offsets)} is not a pair of "
            "non-negative integers [begin, end]"
        )
    nbits = count * bits if count <= _USIZE_MAX and count * bits <= _USIZE_MAX else -1
    return offsets[0], offsets[1], dtype, tuple(shape), nbits


def _fields(where: str, pairs: list[tuple[str, Any]]) -> tuple[Any, Any, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in _TENSOR_FIELDS:
            if key in found:
                raise CheckpointError(f"{where}: the field {key} is given twice")
            found[key] = value
        else:
            depth = _depth(value)
            if depth > _FIELD_DEPTH:
                raise CheckpointError(
                    f"{where}: the field {files.show(key)} nests deeper than safetensors "
                    f"reads ({_FIELD_DEPTH} levels)"
                )
            if depth < 0:
                raise CheckpointError(
                    f"{where}: the field {files.show(key)} holds a number out of range"
                )
    missing = [k for k in _TENSOR_FIELDS if k not in found]
    if missing:
        raise CheckpointError(
            f"{where} has no valid dtype, shape and data_offsets in the header: "
            f"missing {', '.join(missing)}"
        )
    return found["dtype"], found["shape"], found["data_offsets"]


def _dtype_map(where: str, dtype: Any) -> str:
    """serde's other spelling of a unit enum variant: ``{"F32": null}``."""
    if type(dtype) is dict and len(dtype) == 1:
        ((key, value),) = dtype.items()
        if value is None and isinstance(key, str):
            return key
    raise CheckpointError(
        f"{where}: dtype {files.show(dtype)} is not a string naming a dtype safetensors knows"
    )


def _metadata(path: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, (dict, _Repeated)):
        raise CheckpointError(f"{path}: __metadata__ is {_kind(value)}, not an object of strings")
    for key, item in _pairs(value):
        if type(item) is not str:
            raise CheckpointError(
                f"{path}: __metadata__ {files.show(key)} is {_kind(item)}, not a string "
                "(safetensors metadata maps strings to strings)"
            )


def _no_repeated_key(text: str, header: Any) -> bool:
    """Whether no JSON object in ``text`` (parsed, without \\u escapes, into ``header``) repeats
    a key, which a dict would hide. Every ``:`` of the text is a member's or inside a string;
    a repeated member leaves its ``:`` in the text but not in the parse. So the members and
    the colons inside strings counted in the parse (a count that may miss some, never one
    too many) equal the text's colons only when nothing was repeated and nothing missed;
    otherwise the header is parsed again with every repeat kept (:class:`_Repeated`)."""
    if type(header) is not dict or set(map(type, header.values())) - {dict}:
        return False  # an entry that is not an object: counted the long way
    counted = len(header) + "".join(header).count(":") + sum(map(len, header.values()))
    metadata = header.get("__metadata__")
    if metadata:
        counted += "".join(metadata).count(":")
        counted += "".join(v for v in metadata.values() if type(v) is str).count(":")
    return counted == text.count(":")


def _parse(path: str, data: bytes) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(
            f"{path}: header is not UTF-8: {exc.reason} at byte {8 + exc.start:,}"
        ) from None
    hooks: dict[str, Any] = {"parse_constant": _constant, "parse_float": _float}
    if "-0" in text:  # serde_json reads -0 as a float, never a size: parse it as one
        hooks["parse_int"] = _int
    if "\\u" not in text:  # the common header: parsed into dicts, repeats ruled out after
        try:
            header = json.loads(text, **hooks)
        except (ValueError, TypeError, RecursionError, MemoryError):
            header = None  # said exactly by the parse below
        if header is not None and _no_repeated_key(text, header):
            return header
    hooks["object_pairs_hook"] = _object
    try:
        header = files.parse_json(text, path, "JSON", **hooks)
    except files.FileProblem as exc:
        detail = exc.detail.removeprefix("not valid JSON: ")
        raise CheckpointError(f"{path}: header is not JSON: {detail}") from None
    if "\\u" in text and _lone_surrogate(header):
        raise CheckpointError(f"{path}: header is not JSON: a \\u escape is a lone surrogate")
    return header


def _validate(path: str, header: Any, size: int, file_size: int | None) -> list[TensorInfo]:
    """The tensors of a parsed header, checked as safetensors' ``Metadata::validate``;
    against the file's size too where it is known (an object read by its header alone:
    not)."""
    if not isinstance(header, (dict, _Repeated)):
        raise CheckpointError(f"{path}: header is a JSON {_json_type(header)}, not an object")
    entries: dict[str, tuple[int, int, str, tuple[int, ...], int]] = {}
    seen_metadata = False
    for name, meta in _pairs(header):
        if name == "__metadata__":
            if seen_metadata:
                raise CheckpointError(f"{path}: __metadata__ is given twice")
            seen_metadata = True
            _metadata(path, meta)
            continue
        entries[name] = _entry(path, name, meta)  # a repeated name: the last one holds
    ordered = sorted(entries.items(), key=itemgetter(1))  # by (begin, end), as safetensors
    base = 8 + size
    start = 0
    tensors = []
    for name, (begin, end, dtype, shape, nbits) in ordered:
        if begin != start or end < begin:
            raise CheckpointError(
                f"{path}: tensor {files.show(name)}: data_offsets [{begin}, {end}] "
                + (
                    "end before they begin"
                    if end < begin
                    else f"do not start where the previous tensor's data ends ({start}); "
                    "safetensors wants the tensors' data contiguous from 0, without "
                    "gaps or overlaps"
                )
            )
        start = end
        if nbits < 0:
            raise CheckpointError(
                f"{path}: tensor {files.show(name)}: shape {list(shape)} of {dtype} "
                "overflows a 64-bit byte count"
            )
        if nbits % 8:
            raise CheckpointError(
                f"{path}: tensor {files.show(name)}: shape {list(shape)} of {dtype} is "
                f"{nbits} bits, not a whole number of bytes"
            )
        if end - begin != nbits // 8:
            raise CheckpointError(
                f"{path}: tensor {files.show(name)}: shape {list(shape)} of {dtype} is "
                f"{nbits // 8:,} bytes but its data_offsets [{begin}, {end}] span "
                f"{end - begin:,}"
            )
        tensors.append(TensorInfo(name, dtype, shape, base + begin, base + end))
    if file_size is None:
        return tensors
    if base + start > file_size:
        raise CheckpointError(
            f"{path}: the header places tensors up to byte {base + start:,} but the "
            f"file has {file_size:,} bytes (truncated?)"
        )
    if base + start < file_size:
        raise CheckpointError(
            f"{path}: {file_size - base - start:,} bytes follow the last tensor's data "
            "(safetensors wants the tensors' data to end the file)"
        )
    return tensors


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "list"
    return {str: "string", bool: "boolean", int: "number", float: "number"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def _read(path: str | os.PathLike[str]) -> tuple[int, Any, int, str]:
    """(header length, parsed header, file size, header digest) of one shard, bounded and
    non-blocking."""
    shown = files.show_path(path)
    try:
        fd, st = files.open_regular(path)
    except FileNotFoundError:
        raise CheckpointError(f"{shown}: no such file") from None
    except files.FileProblem as exc:
        raise CheckpointError(str(exc)) from None
    try:
        raw = files.pread_exact(fd, 8, 0, path)
        size = header_length(shown, raw)
        if 8 + size > st.st_size:
            raise CheckpointError(
                f"{shown}: header length {size:,} runs past the end of the file "
                f"({st.st_size:,} bytes)"
            )
        data = files.pread_exact(fd, size, 8, path)
    except files.FileProblem as exc:
        raise CheckpointError(str(exc)) from None
    finally:
        os.close(fd)
    if len(data) != size:
        raise CheckpointError(f"{shown}: shrank while its header was read")
    try:
        return size, _parse(shown, data), st.st_size, header_digest(raw + data)
    except MemoryError:
        raise CheckpointError(f"{shown}: header is too large to parse in memory") from None


def header_length(shown: str, raw: bytes) -> int:
    """The header length a shard's first 8 bytes (``raw``) give, within safetensors' limit;
    :class:`CheckpointError` naming the shard (``shown``) otherwise."""
    if len(raw) != 8:
        raise CheckpointError(f"{shown}: shorter than a safetensors header (8 bytes)")
    size: int = struct.unpack("<Q", raw)[0]
    if size > MAX_HEADER:
        raise CheckpointError(
            f"{shown}: header length {size:,} is over safetensors' limit of {MAX_HEADER:,} bytes"
        )
    return size


class Header(dict[str, Any]):
    """A shard's parsed header (entry name -> entry), with its tensors as validated."""

    tensors: tuple[TensorInfo, ...] = ()
    digest: str | None = None


def read_header(path: str | os.PathLike[str]) -> tuple[int, dict[str, Any]]:
    """The header length and the parsed header JSON of one safetensors file, which must be
    one ``safe_open`` accepts (else :class:`CheckpointError`): the one read of a header,
    which :func:`read_shard` goes through too."""
    size, parsed, file_size, digest = _read(path)
    tensors = _validate(files.show_path(path), parsed, size, file_size)
    header = Header(_pairs(parsed))
    header.tensors = tuple(tensors)
    header.digest = digest
    return size, header


def read_shard(path: str | os.PathLike[str]) -> Shard:
    """One shard's tensors from its header; :class:`CheckpointError` for any shard that
    safetensors would reject, naming the shard and the tensor."""
    size, header = read_header(path)
    if isinstance(header, Header):
        return Shard(Path(path), header.tensors, header.digest)
    shown = files.show_path(path)  # a header from elsewhere: checked here
    return Shard(Path(path), tuple(_validate(shown, header, size, os.stat(path).st_size)))


def object_shard(uri: str, raw: bytes, version: ObjectVersion | None = None) -> Shard:
    """An object-storage shard from its header alone (``raw``: the 8-byte length and that
    many bytes of JSON, read by ranged requests), checked as :func:`read_shard` checks a
    file but for the file's size, which only the object's ``version`` (where it was read)
    gives. :class:`CheckpointError` names the address."""
    shown = files.show_path(uri)
    size = header_length(shown, raw[:8])
    if len(raw) != 8 + size:
        raise CheckpointError(
            f"{shown}: header length {size:,}, but {len(raw) - 8:,} header bytes were read"
        )
    try:
        parsed = _parse(shown, raw[8:])
    except MemoryError:
        raise CheckpointError(f"{shown}: header is too large to parse in memory") from None
    tensors = _validate(shown, parsed, size, None)
    key = uri.partition("://")[2].partition("/")[2]
    return Shard(Path(key or "?"), tuple(tensors), header_digest(raw), uri=uri, version=version)


# --- which files: as vLLM resolves them ------------------------------------------------------


def _within(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def confined(model_dir: str | os.PathLike[str], name: str) -> Path:
    """``model_dir/name``, refused unless reading it stays inside the checkpoint.

    A symbolic link is followed only into the model directory itself or, when the model
    directory is a Hugging Face cache snapshot (``<repo>/snapshots/<revision>``), into that
    cache's ``<repo>/blobs`` (where ``snapshots/<rev>/<file> -> ../../blobs/<hash>``).
    """
    root = Path(model_dir)
    path = root / name
    if not os.path.islink(path):
        return path
    real_root = os.path.realpath(root)
    target = os.path.realpath(path)
    allowed = [real_root]
    snapshots = os.path.dirname(real_root)
    if os.path.basename(snapshots) == "snapshots":
        allowed.append(os.path.join(os.path.dirname(snapshots), "blobs"))
    if any(_within(target, a) for a in allowed):
        return path
    raise CheckpointError(
        f"{files.show_path(path)}: a symbolic link to {files.show_path(target)}, outside "
        "the checkpoint (links are followed only into the model directory, or from a "
        "Hugging Face cache's snapshots/<revision>/ into its blobs/)"
    )


def _plain_shard_name(name: object) -> bool:
    """Whether vLLM would find ``name`` among ``MODEL_DIR/*.safetensors`` (its glob)."""
    return (
        isinstance(name, str)
        and name.endswith(".safetensors")
        and not name.startswith(".")
        and "/" not in name
        and os.sep not in name
        and (os.altsep is None or os.altsep not in name)
        and "\0" not in name
    )


def read_json(model_dir: str | os.PathLike[str], name: str, limit: int) -> Any:
    """The JSON of the file ``name`` in a model directory, confined and bounded
    (:func:`confined`, :func:`hybrid_draft.files.read_json`). A missing file raises
    :class:`FileNotFoundError`; anything else that stops the read, :class:`CheckpointError`."""
    path = confined(model_dir, name)
    try:
        return files.read_json(path, limit)
    except files.FileProblem as exc:
        raise CheckpointError(str(exc)) from None


def _index_names(root: Path, index: Path) -> list[str]:
    shown = files.show_path(index)
    what = (
        "not a safetensors index (a JSON object whose weight_map maps tensor names to shard files)"
    )
    try:
        text = files.read_text(confined(root, INDEX_NAME), INDEX_LIMIT)
    except files.FileProblem as exc:
        raise CheckpointError(str(exc)) from None
    except FileNotFoundError:
        raise CheckpointError(f"{shown}: disappeared while read") from None
    try:
        data = files.parse_json(text, index)
    except files.FileProblem as exc:
        raise CheckpointError(f"{shown}: {what}: {exc.detail}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        found = "no weight_map object" if isinstance(data, dict) else f"a JSON {_json_type(data)}"
        raise CheckpointError(f"{shown}: {what}: {found}")
    odd = [n for n in weight_map.values() if not isinstance(n, str)]
    if odd:
        raise CheckpointError(
            f"{shown}: {what}: weight_map maps to {files.show(odd[0])}, not a file name"
        )
    names = set(weight_map.values())
    outside = sorted(n for n in names if not _plain_shard_name(n))
    if outside:
        raise CheckpointError(
            f"{shown}: names the shard {files.show(outside[0])}, which is not a *.safetensors "
            "file in the model directory (vLLM reads only the MODEL_DIR/*.safetensors files "
            "an index names)"
        )
    return sorted(names)


def shard_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The shards a loader would read: those the index names, else every ``*.safetensors``,
    each confined to the checkpoint (:func:`confined`)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"{files.show_path(root)}: not a directory")
    index = root / INDEX_NAME
    if index.is_file():  # as vLLM: an index that is not a regular file is no index
        names = _index_names(root, index)
        missing = [n for n in names if not os.path.lexists(root / n)]
        if missing:
            raise CheckpointError(
                f"{files.show_path(index)}: names shards that do not exist: "
                f"{files.show(missing[:3])}"
            )
    else:
        pattern = os.path.join(glob.escape(os.fspath(root)), "*.safetensors")
        names = sorted(os.path.basename(p) for p in glob.glob(pattern))
        if not names:
            raise CheckpointError(
                f"{files.show_path(root)}: no {INDEX_NAME} and no *.safetensors files"
            )
    return [confined(root, n) for n in names]


def read_checkpoint(model_dir: str | os.PathLike[str]) -> list[Shard]:
    return [read_shard(p) for p in shard_files(model_dir)]


def read_files(paths: Iterable[str | os.PathLike[str]]) -> list[Shard]:
    """The shards at ``paths`` (as vLLM resolved them); :class:`CheckpointError` for any
    that safetensors would reject."""
    return [read_shard(p) for p in paths]


@dataclass(frozen=True)
class Selection:
    """The tensors a draft keeps, per shard in file order, each shard's tensors in file order.

    What the draft loaders read (``adapter/loaders.py``): a shard with no kept tensor is
    never opened, a rejected tensor is never touched.
    """

    #: Per shard, each kept tensor as planned (name, dtype, shape, byte range).
    tensors: dict[str, list[TensorInfo]]
    #: Per shard, the shard as planned (its size and header digest): what a reader checks
    #: the file it opens against.
    shards: dict[str, Shard]

    @property
    def files(self) -> dict[str, list[str]]:
        """Per shard, the kept tensors' names."""
        return {path: [t.name for t in kept] for path, kept in self.tensors.items()}

    @property
    def names(self) -> list[str]:
        return [t.name for kept in self.tensors.values() for t in kept]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for kept in self.tensors.values() for t in kept)

    def summary(self) -> dict[str, int]:
        return {
            "planned_shards": len(self.tensors),
            "planned_tensors": len(self.names),
            "planned_bytes": self.nbytes,
        }


def selection(shards: Iterable[Shard], keep: Callable[[TensorInfo], bool]) -> Selection:
    """The tensors ``keep`` accepts, per shard in file order (shards holding none left out)."""
    kept: dict[str, list[TensorInfo]] = {}
    planned: dict[str, Shard] = {}
    for shard in shards:
        tensors = [t for t in shard.tensors if keep(t)]
        if tensors:
            kept[shard.location], planned[shard.location] = tensors, shard
    return Selection(kept, planned)
