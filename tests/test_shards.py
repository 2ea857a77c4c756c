"""Shards and indexes as safetensors and vLLM take them: every header the layer's reader accepts
is one safetensors' own ``safe_open`` accepts, and the other way round; a refusal names the
shard and the tensor; an index's shard names resolve inside the model directory only."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest

from hybrid_draft.core import checkpoint
from hybrid_draft.core.checkpoint import CheckpointError

pytestmark = pytest.mark.once  # the same on every vLLM release (docs/testing.md)


def shard_bytes(header: bytes | str, data: int = 0, pad: bool = True, tail: bytes = b"") -> bytes:
    raw = header.encode() if isinstance(header, str) else header
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(data) + tail


def safe_open_accepts(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            list(f.keys())
        return True
    except Exception:
        return False


def reader_accepts(path: Path) -> bool:
    try:
        checkpoint.read_shard(path)
        return True
    except CheckpointError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)
        return False


G = '"dtype":"F32","shape":[2],"data_offsets":[0,8]'


def h(text: str) -> str:
    """A header text with ``@G`` standing for a valid 8-byte F32 tensor's fields."""
    return text.replace("@G", G)


#: name -> (header text, data bytes after the header, bytes after the data). Each probes one
#: rule of safetensors' read_metadata / Metadata::validate (or of serde_json under it).
CORPUS: dict[str, tuple[str, int, bytes]] = {
    "valid": (h('{"a":{@G}}'), 8, b""),
    "empty_header_object": ("{}", 0, b""),
    "metadata_null": (h('{"__metadata__":null,"a":{@G}}'), 8, b""),
    "metadata_number_value": (h('{"__metadata__":{"x":1},"a":{@G}}'), 8, b""),
    "metadata_list": (h('{"__metadata__":["x"],"a":{@G}}'), 8, b""),
    "metadata_repeated": (h('{"__metadata__":{},"__metadata__":{},"a":{@G}}'), 8, b""),
    "metadata_key_repeated": (h('{"__metadata__":{"x":"1","x":"2"},"a":{@G}}'), 8, b""),
    "extra_field": (h('{"a":{@G,"note":{"b":[1,{"c":null}]}}}'), 8, b""),
    "extra_field_125_deep": (h('{"a":{@G,"x":') + "[" * 125 + "]" * 125 + "}}", 8, b""),
    "extra_field_126_deep": (h('{"a":{@G,"x":') + "[" * 126 + "]" * 126 + "}}", 8, b""),
    "field_repeated": (h('{"a":{@G,"shape":[2]}}'), 8, b""),
    "extra_field_repeated": (h('{"a":{@G,"n":1,"n":2}}'), 8, b""),
    "tensor_as_list": ('{"a":["F32",[2],[0,8]]}', 8, b""),
    "tensor_as_long_list": ('{"a":["F32",[2],[0,8],1]}', 8, b""),
    "tensor_null": ('{"a":null}', 8, b""),
    "tensor_number": ('{"a":5}', 8, b""),
    "dtype_as_map": ('{"a":{"dtype":{"F32":null},"shape":[2],"data_offsets":[0,8]}}', 8, b""),
    "dtype_map_value": ('{"a":{"dtype":{"F32":1},"shape":[2],"data_offsets":[0,8]}}', 8, b""),
    "dtype_unknown": ('{"a":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}}', 8, b""),
    "dtype_lower_case": ('{"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}}', 8, b""),
    "dtype_escaped": ('{"a":{"dtype":"F\\u0033\\u0032","shape":[2],"data_offsets":[0,8]}}', 8, b""),
    "missing_offsets": ('{"a":{"dtype":"F32","shape":[2]}}', 8, b""),
    "shape_float": ('{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', 8, b""),
    "shape_exponent": ('{"a":{"dtype":"F32","shape":[2e0],"data_offsets":[0,8]}}', 8, b""),
    "shape_negative": ('{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', 8, b""),
    "shape_bool": ('{"a":{"dtype":"U8","shape":[true],"data_offsets":[0,1]}}', 1, b""),
    "shape_past_u64": (
        '{"a":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,8]}}',
        8,
        b"",
    ),
    "shape_overflows": (
        '{"a":{"dtype":"F32","shape":[1099511627776,1099511627776,0],"data_offsets":[0,0]}}',
        0,
        b"",
    ),
    "shape_zero_first": (
        '{"a":{"dtype":"F32","shape":[0,1099511627776,1099511627776],"data_offsets":[0,0]}}',
        0,
        b"",
    ),
    "shape_vs_bytes": ('{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', 8, b""),
    "scalar": ('{"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}', 4, b""),
    "f4_half_byte": ('{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}', 2, b""),
    "f4_whole_bytes": ('{"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}', 2, b""),
    "offsets_negative_zero": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[-0,8]}}', 8, b""),
    "offsets_three": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}', 8, b""),
    "offsets_object": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":{"0":0,"1":8}}}', 8, b""),
    "offsets_gap": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', 12, b""),
    "offsets_reversed": ('{"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}', 8, b""),
    "offsets_overlap": (
        h('{"a":{@G},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}'),
        12,
        b"",
    ),
    "offsets_out_of_order": (
        h('{"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"a":{@G}}'),
        16,
        b"",
    ),
    "two_empty_tensors_at_one_offset": (
        '{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
        '"b":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}',
        0,
        b"",
    ),
    "offset_u64_max": (
        '{"a":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551615,8]}}',
        8,
        b"",
    ),
    "name_repeated_last_valid": (
        h('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{@G}}'),
        8,
        b"",
    ),
    "name_repeated_first_invalid": (h('{"a":{},"a":{@G}}'), 8, b""),
    # A repeat whose colon a colon inside a string could stand for, or an escape could hide.
    "field_repeated_name_with_colons": (h('{"a::":{@G,"dtype":"F32"}}'), 8, b""),
    "metadata_key_repeated_value_colon": (
        h('{"__metadata__":{"x":"1:2","x":"2"},"a":{@G}}'),
        8,
        b"",
    ),
    "field_repeated_escaped_colon": (h('{"a\\u003a":{@G,"dtype":"F32"}}'), 8, b""),
    "name_repeated_with_colon": (h('{"a:b":{@G},"a:b":{@G}}'), 8, b""),
    "metadata_value_colons": (h('{"__metadata__":{"t:":"12:00:00"},"a:":{@G}}'), 8, b""),
    "data_short": (h('{"a":{@G}}'), 4, b""),
    "data_trailing": (h('{"a":{@G}}'), 8, b"x"),
    "not_an_object": ("[1,2]", 0, b""),
    "not_json": ("{not json", 0, b""),
    "trailing_comma": (h('{"a":{@G},}'), 8, b""),
    "nul_padding": (h('{"a":{@G}}\0\0\0'), 8, b""),
    "leading_space": (h(' {"a":{@G}}'), 8, b""),
    "byte_order_mark": (h('\ufeff{"a":{@G}}'), 8, b""),
    "nan_in_extra_field": (h('{"a":{@G,"x":NaN}}'), 8, b""),
    "infinite_number": (h('{"a":{@G,"x":1e400}}'), 8, b""),
    "long_integer": (h('{"a":{@G,"x":') + "9" * 400 + "}}", 8, b""),
    "lone_surrogate": (h('{"a":{@G,"x":"\\ud800"}}'), 8, b""),
    "surrogate_pair": (h('{"\\ud83d\\ude00":{@G}}'), 8, b""),
    "control_character": (h('{"a\x01":{@G}}'), 8, b""),
}


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_the_reader_accepts_exactly_what_safe_open_accepts(case: str, tmp_path: Path) -> None:
    header, data, tail = CORPUS[case]
    path = tmp_path / "model.safetensors"
    path.write_bytes(shard_bytes(header, data, tail=tail))
    assert reader_accepts(path) == safe_open_accepts(path), case


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"\x01\x00", "shorter than a safetensors header"),
        (struct.pack("<Q", 100_000_001) + b"{}", "over safetensors' limit of 100,000,000 bytes"),
        (struct.pack("<Q", 64) + b"{}", "runs past the end of the file"),
        (shard_bytes(b'{"a\xff":{}}'), "header is not UTF-8"),
    ],
)
def test_framing_errors(raw: bytes, fragment: str, tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(raw)
    assert not safe_open_accepts(path)
    with pytest.raises(CheckpointError, match=fragment):
        checkpoint.read_shard(path)


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        (
            '{"w":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}}',
            8,
            "tensor 'w': dtype 'F31' is not one safetensors knows",
        ),
        (
            h('{"a":{@G},"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}'),
            12,
            "tensor 'w': data_offsets [4, 12] do not start where the previous tensor's data "
            "ends (8)",
        ),
        (
            '{"w":{"dtype":"BF16","shape":[3,4],"data_offsets":[0,8]}}',
            8,
            "tensor 'w': shape [3, 4] of BF16 is 24 bytes but its data_offsets [0, 8] span 8",
        ),
        (h('{"w":{@G}}'), 4, "the header places tensors up to byte"),
    ],
)
def test_a_refusal_names_the_shard_and_the_tensor(
    header: str, data: int, message: str, tmp_path: Path
) -> None:
    path = tmp_path / "model-00001-of-00002.safetensors"
    path.write_bytes(shard_bytes(header, data))
    with pytest.raises(CheckpointError) as info:
        checkpoint.read_shard(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value)


def test_non_regular_shards_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    (tmp_path / "dir.safetensors").mkdir()
    (tmp_path / "zero.safetensors").symlink_to("/dev/zero")
    for name, kind in (("fifo", "a FIFO"), ("dir", "a directory"), ("zero", "a character device")):
        with pytest.raises(CheckpointError, match=f"{kind}, not a regular file"):
            checkpoint.read_shard(tmp_path / f"{name}.safetensors")


# --- which files an index may name -----------------------------------------------------------


def small_checkpoint(root: Path, shard: str = "model-00001-of-00001.safetensors") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / shard).write_bytes(shard_bytes(h('{"w":{@G}}'), 8))
    (root / checkpoint.INDEX_NAME).write_text(json.dumps({"weight_map": {"w": shard}}))
    return root


@pytest.mark.parametrize(
    "name",
    [
        "../elsewhere/x.safetensors",
        "/etc/passwd",
        "sub/x.safetensors",
        ".hidden.safetensors",
        "x.bin",
    ],
)
def test_an_index_names_only_files_in_the_model_directory(name: str, tmp_path: Path) -> None:
    model = small_checkpoint(tmp_path / "model")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "x.safetensors").write_bytes(shard_bytes(h('{"w":{@G}}'), 8))
    (model / "sub").mkdir()
    shutil.copy(outside / "x.safetensors", model / "sub" / "x.safetensors")
    (model / checkpoint.INDEX_NAME).write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(CheckpointError) as info:
        checkpoint.shard_files(model)
    assert f"names the shard {name!r}, which is not a *.safetensors file in the model" in str(
        info.value
    )


def test_symbolic_links_stay_inside_the_checkpoint(tmp_path: Path) -> None:
    model = small_checkpoint(tmp_path / "model", "model.safetensors")
    outside = tmp_path / "outside.safetensors"
    shutil.move(model / "model.safetensors", outside)
    (model / "model.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"a symbolic link to .*outside the checkpoint"):
        checkpoint.read_checkpoint(model)
    # A link within the model directory is followed.
    (model / "model.safetensors").unlink()
    shutil.move(outside, model / "data.bin")
    (model / "model.safetensors").symlink_to("data.bin")
    assert [s.name for s in checkpoint.read_checkpoint(model)] == ["model.safetensors"]


def test_a_hugging_face_cache_snapshot_reads_its_blobs(tmp_path: Path) -> None:
    """``snapshots/<rev>/<file> -> ../../blobs/<hash>``, as huggingface_hub lays it out."""
    repo = tmp_path / "hub" / "models--org--name"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, content in (
        ("model.safetensors", shard_bytes(h('{"w":{@G}}'), 8)),
        ("config.json", b"{}"),
    ):
        blob = repo / "blobs" / f"hash-{name}"
        blob.write_bytes(content)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    shards = checkpoint.read_checkpoint(snapshot)
    assert [(s.name, s.nbytes) for s in shards] == [("model.safetensors", 8)]
    assert checkpoint.read_json(snapshot, "config.json", 1024) == {}
    # The same links from a directory that is not a snapshot lead out of it.
    other = tmp_path / "copy"
    shutil.copytree(snapshot, other, symlinks=True)
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        checkpoint.read_checkpoint(other)


@pytest.mark.parametrize(
    ("index", "fragment"),
    [
        ("{", "not a safetensors index"),
        ("[]", "not a safetensors index (a JSON object whose weight_map maps tensor names"),
        ('{"weight_map": {"w": 3}}', "weight_map maps to 3, not a file name"),
        ('{"weight_map": ' * 5000 + "}" * 5000, "nested too deeply"),
    ],
)
def test_bad_indexes(index: str, fragment: str, tmp_path: Path) -> None:
    model = small_checkpoint(tmp_path / "model")
    (model / checkpoint.INDEX_NAME).write_text(index)
    with pytest.raises(CheckpointError, match=re.escape(fragment)):
        checkpoint.shard_files(model)


# --- the draft's filtered reader: the tensors safe_open gives -------------------------------

#: Shapes per dtype: a matrix, an empty one, a vector and a scalar (F4 packs two to a byte,
#: so it has no scalar and wants an even last dimension).
_SHAPES = ([3, 4], [0, 2], [6], [])


@pytest.mark.parametrize("dtype", sorted(checkpoint.DTYPE_BITS))
def test_the_filtered_reader_gives_what_safe_open_gives(dtype: str, tmp_path: Path) -> None:
    """Each dtype safetensors knows: the same dtype, shape and bytes as ``get_tensor``, or,
    where PyTorch has no such dtype (F6), a refusal from both."""
    import random

    import torch
    from safetensors import safe_open

    from hybrid_draft.core import shardread

    bits = checkpoint.DTYPE_BITS[dtype]
    header: dict[str, object] = {}
    data = bytearray()
    rng = random.Random(dtype)
    for i, shape in enumerate(_SHAPES):
        count = 1
        for d in shape:
            count *= d
        if (count * bits) % 8:
            continue  # not a whole number of bytes: no such tensor
        size = count * bits // 8
        header[f"t{i}"] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(data), len(data) + size],
        }
        data += bytes(rng.randrange(2 if dtype == "BOOL" else 256) for _ in range(size))
    path = tmp_path / "x.safetensors"
    path.write_bytes(shard_bytes(json.dumps(header), tail=bytes(data)))
    shard = checkpoint.read_shard(path)
    with safe_open(str(path), "pt") as f:
        try:
            expected = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        except Exception:
            expected = None
    if expected is None:
        with pytest.raises(CheckpointError, match=f"dtype {dtype} has no torch dtype"):
            list(shardread.read_shard(str(path), shard, list(shard.tensors)))
        return
    got = dict(shardread.read_shard(str(path), shard, list(shard.tensors)))
    assert got.keys() == expected.keys() and got
    for name, want in expected.items():
        have = got[name]
        assert (have.dtype, have.shape) == (want.dtype, want.shape), name
        as_bytes = [
            t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
            for t in (have, want)
        ]
        assert torch.equal(*as_bytes), name


def _mixed_shard(tmp_path: Path, seed: int) -> Path:
    """A shard of 40 tensors of mixed dtypes and sizes: adjacent tensors at offsets of every
    alignment, some empty, one far larger than a run."""
    import random

    rng = random.Random(seed)
    header: dict[str, object] = {}
    data = bytearray()
    dtypes = ["U8", "BOOL", "BF16", "F16", "F32", "I64", "F8_E4M3"]
    for i in range(40):
        dtype = rng.choice(dtypes)
        size = checkpoint.DTYPE_BITS[dtype] // 8
        count = 300 if i == 17 else rng.choice([0, 1, 3, 5, 8, 17])
        header[f"t{i:02}"] = {
            "dtype": dtype,
            "shape": [count],
            "data_offsets": [len(data), len(data) + count * size],
        }
        data += bytes(rng.randrange(2 if dtype == "BOOL" else 256) for _ in range(count * size))
    path = tmp_path / f"mixed-{seed}.safetensors"
    path.write_bytes(shard_bytes(json.dumps(header), tail=bytes(data)))
    return path


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("keep", [True, False], ids=["consumer-keeps", "consumer-drops"])
def test_the_filtered_reader_reads_runs_a_kept_tensor_stays_whole(
    seed: int, keep: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adjacent planned tensors are read a run at a time into memory that is used again:
    every tensor is still what ``get_tensor`` gives, whether the consumer keeps them all
    (nothing it holds is read over) or drops each (the reads reuse a few blocks)."""
    import random

    import numpy as np
    import torch
    from safetensors import safe_open

    from hybrid_draft.core import shardread

    monkeypatch.setattr(shardread, "RUN_BYTES", 64)  # many runs from a small shard
    blocks: list[int] = []
    real_empty = np.empty

    def counting(size: int, dtype: object) -> object:
        blocks.append(size)
        return real_empty(size, dtype=dtype)

    monkeypatch.setattr(shardread.np, "empty", counting)
    path = _mixed_shard(tmp_path, seed)
    shard = checkpoint.read_shard(path)
    rng = random.Random(seed)
    planned = [t for t in shard.tensors if rng.random() < 0.7]  # gaps between some
    with safe_open(str(path), "pt") as f:
        expected = {t.name: f.get_tensor(t.name) for t in planned}
    runs = shardread.runs(planned)
    assert len(runs) > 3 and max(len(r) for r in runs) > 1
    assert [t for r in runs for t in r] == planned

    def same(have: torch.Tensor, want: torch.Tensor) -> bool:
        return (have.dtype, have.shape) == (want.dtype, want.shape) and torch.equal(
            have.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
        )

    kept: dict[str, torch.Tensor] = {}
    names = []
    for name, tensor in shardread.read_shard(str(path), shard, planned):
        names.append(name)
        if keep:
            kept[name] = tensor
        else:
            assert same(tensor, expected[name]), name
        del tensor
    assert names == [t.name for t in planned]
    if keep:
        assert all(same(kept[n], expected[n]) for n in names)
        assert len(blocks) == len([r for r in runs if r[-1].end > r[0].start])
    else:  # the loop's last tensor is still held when the next run is read: two blocks
        # (more only where a run is larger than every block before it)
        growth = sum(
            1
            for i, r in enumerate(runs)
            if r[-1].end - r[0].start > max((q[-1].end - q[0].start for q in runs[:i]), default=0)
        )
        assert len(blocks) <= growth + 1 < len(runs)
