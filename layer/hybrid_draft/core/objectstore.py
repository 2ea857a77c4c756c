"""Shard headers in object storage (``s3://``, ``gs://``, ``az://``), read as the Run:ai
Model Streamer reads them: by its own client, with ranged requests for each shard's 8-byte
length and then its JSON header, never a tensor's bytes.

No vLLM import. The draft's plan of a Run:ai target in object storage is made from these
(``draftplan``); each header is checked as a local shard's is (``checkpoint.object_shard``).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybrid_draft import files
from hybrid_draft.core import checkpoint


def _chunks(requests: Sequence[tuple[int, str, int, int]]) -> dict[int, bytes]:
    """Each ``(index, address, offset, size)`` range, read by Run:ai's streamer, by its
    index."""
    from runai_model_streamer import DistributedStreamer, FileChunks

    out: dict[int, bytes] = {}
    with DistributedStreamer() as streamer:
        streamer.stream_files(
            [FileChunks(i, uri, [offset], [size]) for i, uri, offset, size in requests],
            None,
            "cpu",
            False,
        )
        for index, _chunk, buffer in streamer.get_chunks():
            out[index] = bytes(buffer.numpy().tobytes())
    return out


def read_shards(uris: Sequence[str]) -> list[checkpoint.Shard]:
    """The shards at ``uris``, from their headers alone; :class:`checkpoint.CheckpointError`
    naming the address for one that is not a safetensors file safetensors would accept."""
    if not uris:
        return []
    lengths = _chunks([(i, uri, 0, 8) for i, uri in enumerate(uris)])
    sizes = [
        checkpoint.header_length(files.show_path(uri), lengths.get(i, b""))
        for i, uri in enumerate(uris)
    ]
    # An empty header is asked for no range: object_shard then says it is not JSON.
    headers = _chunks(
        [(i, uri, 8, size) for i, (uri, size) in enumerate(zip(uris, sizes, strict=True)) if size]
    )
    return [
        checkpoint.object_shard(uri, lengths[i] + headers.get(i, b"")) for i, uri in enumerate(uris)
    ]


def list_shards(uri: str) -> list[str]:
    """The ``*.safetensors`` objects directly under ``uri``, as vLLM's Run:ai loader lists
    them (Run:ai's ``list_safetensors``), in order."""
    from runai_model_streamer import list_safetensors

    return sorted(list_safetensors(uri))


def pull_configs(uri: str, dest: str) -> None:
    """The JSON files (``config.json``, the index) and configuration code under ``uri``,
    copied into ``dest`` as vLLM copies them before it loads such a checkpoint."""
    from runai_model_streamer import pull_files

    pull_files(uri.rstrip("/") + "/", dest, allow_pattern=["*.json", "*.py"])
