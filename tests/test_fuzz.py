"""Property-based fuzzing (hypothesis) of the three texts the layer parses from outside: the
config TOML, a safetensors index and a safetensors header.

Properties: the config gives settings or a one-line ``ConfigError``, nothing else; an index
gives shard paths inside the model directory or a one-line ``CheckpointError``; a header is
accepted exactly when safetensors' own ``safe_open`` accepts it. Bounded: a fixed number of
examples, derandomized (the default run is reproducible), each under a generous deadline
that only a pathology (a hang, quadratic work on a long line) reaches. For a longer, random
search: ``HYBRID_DRAFT_FUZZ=thorough``.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_draft import settings as hd_settings
from hybrid_draft.core import checkpoint

pytestmark = pytest.mark.once  # the same on every vLLM release (docs/testing.md)

THOROUGH = os.environ.get("HYBRID_DRAFT_FUZZ", "") == "thorough"


def bounded(examples: int) -> settings:
    return settings(
        max_examples=examples * (20 if THOROUGH else 1),
        deadline=timedelta(seconds=10),
        derandomize=not THOROUGH,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hybrid-draft-fuzz-") as d:
        yield Path(d)


# --- config TOML -----------------------------------------------------------------------------

KEYS = st.sampled_from(["draft", "log", "mode", "level", "events_file", "x", "draft.mode", '"a b"'])
SCALARS = st.one_of(
    st.sampled_from(['"auto"', '"Selective "', '"fast"', '""', "3", "true", "1e400", "nan"]),
    st.text(max_size=20).map(json.dumps),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.lists(st.tuples(KEYS, inner), max_size=3).map(
            lambda kv: "{" + ", ".join(f"{k} = {v}" for k, v in kv) + "}"
        ),
    ),
    max_leaves=20,
)
LINES = st.one_of(
    KEYS.map(lambda k: f"[{k}]"),
    KEYS.map(lambda k: f"[[{k}]]"),
    st.tuples(KEYS, VALUES).map(lambda kv: f"{kv[0]} = {kv[1]}"),
    st.text(max_size=40),
    st.sampled_from(["#", '"""', "[", "=", " " * 200 + "x", "[" * 300 + "]" * 300]),
)
TOML_TEXT = st.one_of(st.lists(LINES, max_size=12).map("\n".join), st.text(max_size=400))


@bounded(300)
@given(text=TOML_TEXT)
def test_config_text_gives_settings_or_one_config_error(text: str, scratch: Path) -> None:
    path = scratch / "hybrid-draft.toml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        result = hd_settings.load({"HYBRID_DRAFT_CONFIG": str(path)})
    except hd_settings.ConfigError as exc:
        assert "\n" not in str(exc) and str(exc).startswith(str(path))
    else:
        assert result.mode.value in hd_settings.MODES
        assert result.level.value in hd_settings.LEVELS


# --- safetensors index -----------------------------------------------------------------------

SHARD = "model-00001-of-00001.safetensors"
NAMES = st.one_of(
    st.sampled_from(
        [
            SHARD,
            "../" + SHARD,
            "/etc/passwd",
            "sub/" + SHARD,
            "." + SHARD,
            "missing.safetensors",
            "link.safetensors",
            "",
            ".",
            "..",
        ]
    ),
    st.text(max_size=30),
)
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
INDEX = st.one_of(
    st.fixed_dictionaries(
        {"weight_map": st.dictionaries(st.text(max_size=10), st.one_of(NAMES, JSON), max_size=5)}
    ).map(json.dumps),
    JSON.map(json.dumps),
    st.text(max_size=200),
)


@pytest.fixture(scope="module")
def model_dir(scratch: Path) -> Path:
    root = scratch / "index" / "model"
    (root / "sub").mkdir(parents=True)
    data = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    shard = struct.pack("<Q", len(data)) + data + bytes(8)
    (root / SHARD).write_bytes(shard)
    (root / "sub" / SHARD).write_bytes(shard)
    (root.parent / SHARD).write_bytes(shard)
    (root / "link.safetensors").symlink_to(root.parent / SHARD)  # out of the checkpoint
    return root


@bounded(200)
@given(index=INDEX)
def test_an_index_resolves_inside_the_model_directory_or_is_refused(
    index: str, model_dir: Path
) -> None:
    (model_dir / checkpoint.INDEX_NAME).write_text(index, errors="surrogatepass")
    try:
        paths = checkpoint.shard_files(model_dir)
    except checkpoint.CheckpointError as exc:
        assert "\n" not in str(exc)
    else:
        real = os.path.realpath(model_dir)
        for p in paths:
            assert p.parent == model_dir and p.name.endswith(".safetensors")
            assert os.path.commonpath([os.path.realpath(p), real]) == real


# --- safetensors headers ---------------------------------------------------------------------

DTYPES = st.one_of(st.sampled_from(sorted(checkpoint.DTYPE_BITS)), st.sampled_from(["F31", "f32"]))


@st.composite
def headers(draw: Any) -> bytes:
    """A header and its data: mostly well-formed, then bent in one of many ways."""
    count = draw(st.integers(0, 4))
    entries: dict[str, Any] = {}
    offset = 0
    for i in range(count):
        dtype = draw(DTYPES)
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        bits = checkpoint.DTYPE_BITS.get(dtype, 8)
        n = bits
        for d in shape:
            n *= d
        size = n // 8
        begin = offset + draw(st.sampled_from([0, 0, 0, 0, 1, -1]))
        end = begin + size + draw(st.sampled_from([0, 0, 0, 0, 1, -1]))
        entry: Any = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        if draw(st.integers(0, 9)) == 0:
            entry[draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = draw(JSON)
        if draw(st.integers(0, 14)) == 0:
            entry = draw(JSON)
        entries[draw(st.text(max_size=6)) + str(i)] = entry
        offset = max(offset, end, 0)
    if draw(st.booleans()):
        entries["__metadata__"] = draw(
            st.one_of(st.dictionaries(st.text(max_size=5), st.text(max_size=5)), JSON)
        )
    text = json.dumps(entries)
    if draw(st.integers(0, 4)) == 0:  # a raw edit: cut, insert or replace a few characters
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.text(max_size=3)) + text[at + draw(st.integers(0, 3)) :]
    raw = text.encode("utf-8", errors="surrogatepass")
    raw += b" " * (-len(raw) % 8)
    data = offset + draw(st.sampled_from([0, 0, 0, 1, -1]))
    return struct.pack("<Q", len(raw)) + raw + bytes(max(data, 0))


@bounded(400)
@given(blob=headers())
def test_a_header_is_accepted_exactly_when_safe_open_accepts_it(blob: bytes, scratch: Path) -> None:
    from safetensors import safe_open

    path = scratch / "fuzz.safetensors"
    path.write_bytes(blob)
    try:
        with safe_open(str(path), "pt") as f:
            list(f.keys())
        theirs = True
    except Exception:
        theirs = False
    try:
        checkpoint.read_shard(path)
        ours = True
    except checkpoint.CheckpointError as exc:
        assert "\n" not in str(exc)
        ours = False
    assert ours == theirs, blob[:300]
