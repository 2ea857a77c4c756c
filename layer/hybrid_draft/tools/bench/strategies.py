"""The draft-load strategies the benchmark times, each run cold in a worker process.

``python -m hybrid_draft.tools.bench.strategies SPEC.json`` runs one strategy ``runs`` times and
writes one JSON object to the spec's ``result_file``. Before every run each shard is
evicted from the page cache and ``mincore`` confirms it; a run reports wall seconds, bytes
read from storage (``/proc/self/io``) and the checkpoint pages resident afterwards; the
worker reports its peak RSS. One process per strategy keeps the RSS figures apart.

CPU strategies: ``full_pass`` (every byte of every shard, as a second InstantTensor pass
reads), ``lazy`` and ``lazy_pruned`` (vLLM's real ``safetensors_weights_iterator``, a
consumer that copies only the draft's tensors into preallocated buffers, all shards or the
pruned ones: stock vLLM and the original mod), ``auto`` (the product's own default path for
a same-checkpoint draft: the ``safetensors_filtered`` loader mode ``auto`` switches the
draft to, driven through its ``get_all_weights`` with the draft class's rule), ``selective``
(mode ``selective`` as it runs on this host: its InstantTensor loader with CUDA, else the
very ``auto`` path it falls back to), and ``limit`` (one sequential pass over exactly the
draft's byte ranges, merged: the storage's floor).
GPU strategies (CUDA only): ``it_full`` and ``it_selective`` (InstantTensor without and
with ``tensor_filter``) and ``lazy_to_gpu`` (lazy safetensors, then a copy to the device).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from hybrid_draft.tools.bench import pagecache

CHUNK = 64 << 20
CPU_STRATEGIES = ("full_pass", "lazy", "lazy_pruned", "auto", "selective", "limit")
GPU_STRATEGIES = ("it_full", "it_selective", "lazy_to_gpu")
TORCH_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F8_E4M3": "float8_e4m3fn",
    "I64": "int64",
    "I32": "int32",
    "U8": "uint8",
}


def _read_fully(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(f"short read at offset {offset}")
        view = view[n:]
        offset += n


def full_pass(spec: dict[str, Any]) -> Callable[[], None]:
    scratch = bytearray(CHUNK)

    def run() -> None:
        for path in spec["files_all"]:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(scratch):
                    pass

    return run


def _buffers(spec: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    """Destination tensors, allocated and touched before timing (as a loaded model's are)."""
    import torch

    return {
        name: torch.zeros(shape, dtype=getattr(torch, TORCH_DTYPES[dtype]), device=device)
        for name, (dtype, shape) in spec["meta"].items()
    }


def _lazy(files_key: str) -> Callable[[dict[str, Any]], Callable[[], None]]:
    def make(spec: dict[str, Any]) -> Callable[[], None]:
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        buffers = _buffers(spec)

        def run() -> None:
            for name, tensor in safetensors_weights_iterator(spec[files_key], False, "lazy"):
                target = buffers.get(name)
                if target is not None:  # as load_weights does: unwanted tensors stay unread
                    target.copy_(tensor)

        return run

    return make


def _product(load_format: str) -> Callable[[dict[str, Any]], Callable[[], None]]:
    """One of hybrid-draft's registered draft loaders, driven as vLLM drives it for the
    draft: ``get_all_weights`` with the draft class's rule, every tensor copied in."""

    def make(spec: dict[str, Any]) -> Callable[[], None]:
        from types import SimpleNamespace

        from vllm.config.load import LoadConfig

        from hybrid_draft.adapter import drafts, loaders, selective

        if load_format == loaders.SELECTIVE and selective.cuda_unavailable() is not None:
            spec["ran"] = f"auto ({selective.cuda_unavailable()})"
            fmt, device = loaders.FILTERED, "cpu"
        else:
            spec["ran"] = load_format
            fmt, device = (
                load_format,
                ("cpu" if load_format == loaders.FILTERED else spec["device"]),
            )
        rule = drafts.mtp_draft(spec["model_dir"]).is_unused
        if rule is None:
            raise SystemExit(f"{spec['model_dir']}: the draft class has no rule")
        loader = loaders._loader_classes()[fmt](
            LoadConfig(load_format=fmt, device=device, use_tqdm_on_load=False)
        )
        model = SimpleNamespace(is_unused_checkpoint_weight=rule)
        model_config = SimpleNamespace(model=spec["model_dir"], revision=None)
        buffers = _buffers(spec, device)

        def run() -> None:
            for name, tensor in loader.get_all_weights(model_config, model):
                buffers[name].copy_(tensor)
            if device != "cpu":
                _cuda_sync()

        return run

    return make


def limit(spec: dict[str, Any]) -> Callable[[], None]:
    merged: list[list[Any]] = []
    for path, start, end, _ in spec["tensor_ranges"]:
        if merged and merged[-1][0] == path and merged[-1][2] == start:
            merged[-1][2] = end
        else:
            merged.append([path, start, end])
    scratch = memoryview(bytearray(CHUNK))

    def run() -> None:
        for path, start, end in merged:
            fd = os.open(path, os.O_RDONLY)
            try:
                offset = start
                while offset < end:
                    n = min(CHUNK, end - offset)
                    _read_fully(fd, scratch[:n], offset)
                    offset += n
            finally:
                os.close(fd)

    return run


def _cuda_sync() -> None:
    import torch

    torch.cuda.synchronize()


def it_full(spec: dict[str, Any], names: list[str] | None = None) -> Callable[[], None]:
    import instanttensor

    def run() -> None:
        kwargs: dict[str, Any] = {}
        files = spec["files_all"]
        if names is not None:
            kwargs = {"tensor_filter": list(names), "tensor_name_match_mode": "exact"}
            files = spec["files_pruned"]
        with instanttensor.safe_open(
            list(files),
            framework="pt",
            device=spec["device"],
            process_group=None,
            copy=True,
            **kwargs,
        ) as f:
            for _name, _tensor in f.tensors():
                pass
        _cuda_sync()

    return run


def it_selective(spec: dict[str, Any]) -> Callable[[], None]:
    return it_full(spec, [r[3] for r in spec["tensor_ranges"]])


def lazy_to_gpu(spec: dict[str, Any]) -> Callable[[], None]:
    from safetensors import safe_open

    buffers = _buffers(spec, spec["device"])

    def run() -> None:
        for path in spec["files_pruned"]:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if name in buffers:
                        buffers[name].copy_(f.get_tensor(name))
        _cuda_sync()

    return run


STRATEGIES: dict[str, Callable[[dict[str, Any]], Callable[[], None]]] = {
    "full_pass": full_pass,
    "lazy": _lazy("files_all"),
    "lazy_pruned": _lazy("files_pruned"),
    "auto": _product("safetensors_filtered"),
    "selective": _product("instanttensor_selective"),
    "limit": limit,
    "it_full": it_full,
    "it_selective": it_selective,
    "lazy_to_gpu": lazy_to_gpu,
}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    run = STRATEGIES[spec["strategy"]](spec)
    files = spec["files_all"]
    out: dict[str, Any] = {
        "seconds": [],
        "bytes_read": [],
        "resident_bytes": [],
        "cold": [],
        "rss_before": pagecache.rss(),
    }
    for _ in range(spec["runs"]):
        left = pagecache.evict(files)
        before = pagecache.read_bytes()
        start = time.perf_counter()
        run()
        out["seconds"].append(time.perf_counter() - start)
        out["bytes_read"].append(pagecache.read_bytes() - before)
        out["resident_bytes"].append(pagecache.resident_bytes(files))
        out["cold"].append(left == 0)
    out["peak_rss"] = pagecache.peak_rss()
    if "ran" in spec:
        out["ran"] = spec["ran"]
    return out


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = measure(spec)
    # A result file, not stdout: vLLM's logger writes to stdout.
    with open(spec["result_file"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
