"""The draft-load strategies the benchmark times, each run cold in a worker process.

``python -m hybrid_draft.tools.bench.strategies SPEC.json`` runs one strategy ``runs`` times and
writes one JSON object to the spec's ``result_file``. Before every run each shard is
evicted from the page cache and ``mincore`` confirms it; a run reports wall seconds, bytes
read from storage (``/proc/self/io``) and the checkpoint pages resident afterwards; the
worker reports its peak RSS. One process per strategy keeps the RSS figures apart.

CPU strategies: ``full_pass`` (every byte of every shard, as a second InstantTensor pass
reads), ``lazy`` and ``lazy_pruned`` (vLLM's real ``safetensors_weights_iterator``, a
consumer that copies the draft's tensors into preallocated buffers, all shards or the
pruned ones: stock vLLM and the original mod), ``auto`` (the product's own default path for
a same-checkpoint draft loaded on its own: the ``safetensors_filtered`` loader mode
``auto`` switches the draft to, driven through its ``get_all_weights`` with the plan's
selection, the tensors vLLM replaces skipped), ``selective`` (mode ``selective`` as it runs
on this host: its InstantTensor loader with CUDA, else the very ``auto`` path it falls
back to), ``limit`` (one sequential pass over exactly the byte ranges the draft reads,
merged: the storage's floor) and ``one_pass`` (the target's pass through vLLM's
``DefaultModelLoader`` with the product's tap keeping the draft's tensors, then the draft's
load from them by the product's loader; vLLM's InstantTensor iterator, which needs CUDA, is
stood in for by a reader that streams each shard whole and yields copies, as InstantTensor
does with ``copy=True``; each run also times the same target pass untapped).
For the other target formats: ``fastsafetensors_stock`` (every tensor of the rule-pruned
shards, read whole by fastsafetensors' ``ParallelLoader`` as vLLM's
``fastsafetensors_weights_iterator`` drives it, onto the CPU with ``nogds=True``: vLLM's
iterator needs CUDA), ``fastsafetensors_filtered`` (the product's ``fastsafetensors_filtered``
loader), ``fastsafetensors_one_pass`` (the target's fastsafetensors pass, the same stand-in,
through ``DefaultModelLoader`` with the tap, then the draft from the hold), ``runai_stock``
(vLLM's real ``runai_safetensors_weights_iterator`` over the rule-pruned shards),
``runai_filtered`` (the product's ``runai_streamer_filtered`` loader) and ``runai_one_pass``
(the target's pass through vLLM's real ``RunaiModelStreamerLoader`` with the tap, then the
draft from the hold); and, against object storage (``spec["s3"]``), ``runai_s3_stock``,
``runai_s3_filtered`` and ``runai_s3_one_pass``, the same three over the shards' ``s3://``
addresses, each run's bytes over the wire counted (``rchar``, and the product's own figure).
GPU strategies (CUDA only): ``it_full`` and ``it_selective`` (InstantTensor without and
with ``tensor_filter``), ``lazy_to_gpu`` (lazy safetensors, then a copy to the device) and
``it_one_pass`` (InstantTensor's full pass keeping the draft's tensors on the device, then
the draft's parameters filled from them; with the device's peak memory).
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
CPU_STRATEGIES = (
    "full_pass",
    "lazy",
    "lazy_pruned",
    "auto",
    "selective",
    "limit",
    "one_pass",
    "fastsafetensors_stock",
    "fastsafetensors_filtered",
    "fastsafetensors_one_pass",
    "runai_stock",
    "runai_filtered",
    "runai_one_pass",
)
#: The Run:ai strategies against object storage (``--s3-endpoint``): each the ``runai_*``
#: strategy of the same suffix, over the shards' ``s3://`` addresses.
S3_STRATEGIES = ("runai_s3_stock", "runai_s3_filtered", "runai_s3_one_pass")
GPU_STRATEGIES = ("it_full", "it_selective", "lazy_to_gpu", "it_one_pass")
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


def _buffers(spec: dict[str, Any], device: str = "cpu", names: Any = None) -> dict[str, Any]:
    """Destination tensors, allocated and touched before timing (as a loaded model's are):
    for every tensor the draft keeps, or for ``names``."""
    import torch

    return {
        name: torch.zeros(shape, dtype=getattr(torch, TORCH_DTYPES[dtype]), device=device)
        for name, (dtype, shape) in spec["meta"].items()
        if names is None or name in names
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


def _plan(spec: dict[str, Any]) -> Any:
    from hybrid_draft.tools import draftinfo

    return draftinfo.for_model_dir(spec["model_dir"])


def _draft_reader(
    plan: Any, load_format: str, device: str, held: Any = None, address: str | None = None
) -> Callable[[], Any]:
    """One of hybrid-draft's registered draft loaders, driven as vLLM drives it for the
    draft: ``get_all_weights`` with the plan's read (the replaced tensors skipped, as its
    ``load_weights`` decides for DeepSeekMTP) and, for one pass, the hold; ``address`` the
    model's (default: the plan's first shard's directory)."""
    from types import SimpleNamespace

    from vllm.config.load import LoadConfig

    from hybrid_draft import settings
    from hybrid_draft.adapter import loaders
    from hybrid_draft.core import draftread

    sink = settings.process_sink()
    loader = loaders.loader_class(load_format)(
        LoadConfig(load_format=load_format, device=device, use_tqdm_on_load=False)
    )
    model = SimpleNamespace(is_unused_checkpoint_weight=plan.is_unused)
    model_config = SimpleNamespace(
        model=address or str(plan.shards[0].path.parent), revision=None, model_weights=""
    )

    def weights() -> Any:
        read = draftread.DraftRead(plan=plan, sink=sink, hold=held() if callable(held) else held)
        read.skipped = dict(plan.replaced)
        read.sources = {k: {"tensors": 0, "bytes": 0} for k in ("storage", "stream")}
        loader.draft = read
        return loader.get_all_weights(model_config, model)

    return weights


def _s3_plan(spec: dict[str, Any]) -> Any:
    """The draft's plan over the shards' ``s3://`` addresses: the local plan's draft class
    and rules, each shard's header read from object storage by the product's ranged
    requests (``objectstore``), as a served load of an ``s3://`` checkpoint plans it."""
    import dataclasses

    from hybrid_draft.core import objectstore

    local = _plan(spec)
    where = spec["s3"]["files"]
    shards = objectstore.read_shards([where[str(s.path)] for s in local.shards])
    return dataclasses.replace(local, shards=tuple(shards))


#: The product's loaders that read onto the CPU in a CPU strategy (the selective one reads
#: onto the spec's CUDA device).
_CPU_LOADERS = ("safetensors_filtered", "fastsafetensors_filtered", "runai_streamer_filtered")


def _product(load_format: str, s3: bool = False) -> Callable[[dict[str, Any]], Callable[[], None]]:
    """The product's draft load, every tensor copied into the draft's buffers; with ``s3``,
    the draft of the checkpoint's ``s3://`` copy."""

    def make(spec: dict[str, Any]) -> Callable[[], None]:
        from hybrid_draft.adapter import selective
        from hybrid_draft.core import policy

        if load_format == policy.SELECTIVE and selective.cuda_unavailable() is not None:
            spec["ran"] = f"auto ({selective.cuda_unavailable()})"
            fmt, device = policy.FILTERED, "cpu"
        else:
            spec["ran"] = load_format
            fmt, device = (
                load_format,
                ("cpu" if load_format in _CPU_LOADERS else spec["device"]),
            )
        if s3:
            weights = _draft_reader(_s3_plan(spec), fmt, device, address=spec["s3"]["uri"])
        else:
            weights = _draft_reader(_plan(spec), fmt, device)
        buffers = _buffers(spec, device, {r[3] for r in spec["tensor_ranges"]})

        def run() -> None:
            for name, tensor in weights():
                buffers[name].copy_(tensor)
            if device != "cpu":
                _cuda_sync()

        return run

    return make


def stream_whole_shards(files: list[str], *_args: Any, **_kwargs: Any) -> Any:
    """Stands in for vLLM's ``instanttensor_weights_iterator`` (CUDA only) on the CPU: each
    shard read whole in large reads, every tensor yielded as a copy of its own (InstantTensor
    with ``copy=True``)."""
    import json as _json
    import struct

    import torch

    for path in files:
        with open(path, "rb", buffering=0) as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = _json.loads(f.read(size))
            data = bytearray(os.fstat(f.fileno()).st_size - 8 - size)
            view, done = memoryview(data), 0
            while done < len(data):
                n = f.readinto(view[done : done + CHUNK])
                if not n:
                    raise OSError(f"{path}: short read")
                done += n
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            dtype = getattr(torch, TORCH_DTYPES[meta["dtype"]])
            tensor = (
                torch.frombuffer(
                    data, dtype=dtype, count=(end - start) // dtype.itemsize, offset=start
                )
                if end > start
                else torch.empty(0, dtype=dtype)
            )
            yield name, tensor.view(meta["shape"]).clone()


def fastsafetensors_whole_shards(files: list[str], *_args: Any, **_kwargs: Any) -> Any:
    """Stands in for vLLM's ``fastsafetensors_weights_iterator`` (its device is CUDA's) on
    the CPU: fastsafetensors' ``ParallelLoader`` as that iterator drives it (a one-process
    group, the shards in order, each read whole, vLLM's queue size), onto ``"cpu"`` with
    ``nogds=True`` (vLLM's own fallback where GDS is unavailable). Each tensor is yielded as
    a copy of its own, as ``ParallelLoader`` makes them in a one-process group."""
    from fastsafetensors.common import SingleGroup
    from fastsafetensors.parallel_loader import ParallelLoader

    loader = ParallelLoader(
        pg=SingleGroup(),
        hf_weights_files=sorted(files),
        queue_size=int(os.environ.get("VLLM_FASTSAFETENSORS_QUEUE_SIZE", "0")),
        use_tqdm_on_load=False,
        device="cpu",
        nogds=True,
    )
    weights = loader.iterate_weights()
    try:
        yield from weights
    finally:
        weights.close()  # its buffers first (fastsafetensors' order), then the loader
        loader.close()


def _s3_files(spec: dict[str, Any], files_key: str) -> list[str]:
    where = spec["s3"]["files"]
    return [where[path] for path in spec[files_key]]


def fastsafetensors_stock(spec: dict[str, Any]) -> Callable[[], None]:
    """What stock vLLM's draft load reads with ``--load-format fastsafetensors``: every tensor
    of the shards its own filter keeps for the draft, read whole by fastsafetensors (the
    stand-in above), the draft's tensors copied into its buffers (``load_weights`` drops the
    rest)."""
    spec["ran"] = "fastsafetensors ParallelLoader (cpu, nogds: vLLM's iterator stood in)"
    buffers = _buffers(spec)

    def run() -> None:
        for name, tensor in fastsafetensors_whole_shards(spec["files_pruned"]):
            target = buffers.get(name)
            if target is not None:
                target.copy_(tensor)

    return run


def _runai_stock(s3: bool) -> Callable[[dict[str, Any]], Callable[[], None]]:
    def make(spec: dict[str, Any]) -> Callable[[], None]:
        """vLLM's real Run:ai iterator over the shards its filter keeps for the draft (their
        ``s3://`` addresses with ``s3``), the draft's tensors copied into its buffers."""
        from vllm.model_executor.model_loader.weight_utils import (
            runai_safetensors_weights_iterator,
        )

        files = _s3_files(spec, "files_pruned") if s3 else list(spec["files_pruned"])
        buffers = _buffers(spec)

        def run() -> None:
            for name, tensor in runai_safetensors_weights_iterator(files, False):
                target = buffers.get(name)
                if target is not None:
                    target.copy_(tensor)

        return run

    return make


def served_configs(model_dir: str, load_format: str = "instanttensor") -> Any:
    """The real vLLM configs of serving ``model_dir`` (a directory or an ``s3://`` address)
    with ``load_format`` and its MTP draft, in a one-process world (as a served load has):
    what the one-pass strategies decide by."""
    import tempfile

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        parallel_state,
    )
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(
        model=model_dir,
        load_format=load_format,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        skip_tokenizer_init=True,
        max_model_len=128,
        enforce_eager=True,
        dtype="float32",
    ).create_engine_config()
    if parallel_state._WORLD is None:
        import atexit
        import shutil

        rendezvous = tempfile.mkdtemp(prefix="hybrid-draft-bench-")
        atexit.register(shutil.rmtree, rendezvous, True)  # gone with the worker
        with set_current_vllm_config(VllmConfig()):
            init = f"file://{rendezvous}/dist-init"
            init_distributed_environment(1, 0, init, 0, "gloo")
            ensure_model_parallel_initialized(1, 1)
    return config


def target_load(config: Any) -> Any:
    """The target's load as a served one decides it, inside a load scope: its
    ``adapter.load.Load`` (the tap on it: ``.tap``), by production's own code."""
    from hybrid_draft import settings
    from hybrid_draft.adapter import calls, load

    call = calls.Call.resolve(config)
    return load.decide(call, call.request(), settings.load())


def held_names(model_dir: str) -> frozenset[str]:
    """The tensors a served load's target stream keeps for its draft (this rank's)."""
    from vllm.config import set_current_vllm_config

    from hybrid_draft.adapter import loadscope

    config = served_configs(model_dir)
    with set_current_vllm_config(config), loadscope.scope():
        tap = target_load(config).tap
        return tap.wanted if tap is not None else frozenset()


#: The one-pass strategies: the target's load format, the product's loader its draft is
#: switched to, and whether the checkpoint is read from its ``s3://`` copy.
ONE_PASS = {
    "one_pass": ("instanttensor", "safetensors_filtered", False),
    "fastsafetensors_one_pass": ("fastsafetensors", "fastsafetensors_filtered", False),
    "runai_one_pass": ("runai_streamer", "runai_streamer_filtered", False),
    "runai_s3_one_pass": ("runai_streamer", "runai_streamer_filtered", True),
}


def _target_loader(load_format: str) -> Any:
    """The target's loader as vLLM picks it for ``load_format``, reading onto the CPU: its
    ``DefaultModelLoader`` (InstantTensor's and fastsafetensors' iterators, which need
    CUDA, stood in for) or its real ``RunaiModelStreamerLoader``."""
    from vllm.config.load import LoadConfig

    config = LoadConfig(load_format=load_format, device="cpu", use_tqdm_on_load=False)
    if load_format == "runai_streamer":
        from vllm.model_executor.model_loader.runai_streamer_loader import (
            RunaiModelStreamerLoader,
        )

        return RunaiModelStreamerLoader(config)
    import vllm.model_executor.model_loader.default_loader as default_loader

    # The one stand-in: vLLM's InstantTensor or fastsafetensors read, which needs CUDA.
    if load_format == "instanttensor":
        setattr(default_loader, "instanttensor_weights_iterator", stream_whole_shards)  # noqa: B010
    else:
        setattr(  # noqa: B010
            default_loader, "fastsafetensors_weights_iterator", fastsafetensors_whole_shards
        )
    return default_loader.DefaultModelLoader(config)


def one_pass(spec: dict[str, Any]) -> dict[str, Any]:
    """The target's pass with the product's tap, then the draft's load from the hold; and
    the same target pass untapped, alternating, every run cold. The tap (what it holds,
    its budget with the free-memory cap, the expert filter) is decided by production's
    code on the real vLLM configs of serving this checkpoint with the target's format."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config

    from hybrid_draft.adapter import loadscope
    from hybrid_draft.core import figures

    target_format, draft_format, s3 = ONE_PASS[spec["strategy"]]
    plan = _s3_plan(spec) if s3 else _plan(spec)
    model = spec["s3"]["uri"] if s3 else spec["model_dir"]
    target = _target_loader(target_format)
    config = served_configs(model, target_format)
    target_model: Any = SimpleNamespace()  # the target reads every tensor
    model_config: Any = SimpleNamespace(model=model, revision=None, model_weights="")
    own = [t for t in plan.kept if t.name not in plan.replaced]
    current: list[Any] = [None]
    draft = _draft_reader(plan, draft_format, "cpu", held=lambda: current[0], address=model)
    buffers = _buffers(spec, "cpu", {t.name for t in own})
    files = spec["files_all"]

    def target_pass(decided: Any, wire: dict[str, list[Any]] | None = None) -> float:
        """One target pass, tapped when ``decided`` (its load) holds for the draft, as a
        served load's run taps it; with ``wire``, its bytes over the wire added."""
        chars, start = pagecache.read_chars(), time.perf_counter()
        with figures.measuring() as cost:
            cost.observe = decided.tap.offer if decided is not None else None
            for _ in target.get_all_weights(model_config, target_model):
                pass
        seconds = time.perf_counter() - start
        if wire is not None:
            wire["target_network_bytes"].append(pagecache.read_chars() - chars)
            wire["target_product_network_bytes"].append(cost.network)
        return seconds

    out: dict[str, Any] = {
        "seconds": [],
        "bytes_read": [],
        "resident_bytes": [],
        "cold": [],
        "target_seconds": [],
        "untapped_target_seconds": [],
        "held_bytes": [],
        "rss_before": pagecache.rss(),
    }
    network: dict[str, list[Any]] | None = (
        {
            key: []
            for key in (
                "network_bytes",
                "product_network_bytes",
                "target_network_bytes",
                "target_product_network_bytes",
            )
        }
        if s3
        else None
    )
    pagecache.settle()  # what setting up started in the background ends before any timing
    # One untimed pass first: a process's first pass also pays its one-time costs (code
    # paths, the allocator's growth), which would fall on whichever side ran first.
    pagecache.evict(files)
    out["warmup_seconds"] = target_pass(None)
    for i in range(spec["runs"]):
        for tapped in (i % 2 == 0, i % 2 != 0):
            out["cold"].append(pagecache.evict(files) == 0)
            if not tapped:
                out["untapped_target_seconds"].append(target_pass(None))
                continue
            with set_current_vllm_config(config), loadscope.scope():
                decided = target_load(config)
                held = decided.tap
                if held is None:
                    raise RuntimeError(f"the target's load holds nothing: {decided.target}")
                out["target_seconds"].append(target_pass(decided, network))
                out["held_bytes"].append(held.peak_bytes)
                current[0] = held
                chars = pagecache.read_chars()
                before, start = pagecache.read_bytes(), time.perf_counter()
                with figures.measuring() as cost:
                    for name, tensor in draft():
                        buffers[name].copy_(tensor)
                out["seconds"].append(time.perf_counter() - start)
                out["bytes_read"].append(pagecache.read_bytes() - before)
                if network is not None:
                    network["network_bytes"].append(pagecache.read_chars() - chars)
                    network["product_network_bytes"].append(cost.network)
                out["resident_bytes"].append(pagecache.resident_bytes(files))
                held.release("the bench's draft load ended")
                current[0] = None
    out["peak_rss"] = pagecache.peak_rss()
    out["ran"] = f"tap + {draft_format}"
    if network is not None:
        out.update(network)
    return out


def limit(spec: dict[str, Any]) -> Callable[[], None]:
    """One sequential read of the byte ranges the draft reads (adjacent ones merged)."""
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
            files = spec["files_own"]
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

    buffers = _buffers(spec, spec["device"], {r[3] for r in spec["tensor_ranges"]})

    def run() -> None:
        for path in spec["files_own"]:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if name in buffers:
                        buffers[name].copy_(f.get_tensor(name))
        _cuda_sync()

    return run


def it_one_pass(spec: dict[str, Any]) -> dict[str, Any]:
    """On the GPU: InstantTensor's full pass keeping the draft's tensors (the tap's work: a
    dictionary of references), then the draft's buffers filled from them; the untapped pass
    alternating; the device's peak memory for each."""
    import instanttensor
    import torch

    wanted = {r[3] for r in spec["tensor_ranges"]}
    out: dict[str, Any] = {
        "seconds": [],
        "bytes_read": [],
        "resident_bytes": [],
        "cold": [],
        "target_seconds": [],
        "untapped_target_seconds": [],
        "held_bytes": [],
        "peak_device_bytes": [],
        "rss_before": pagecache.rss(),
    }
    buffers = _buffers(spec, spec["device"], wanted)

    def target_pass(tapped: bool) -> tuple[float, dict[str, Any]]:
        held: dict[str, Any] = {}
        start = time.perf_counter()
        with instanttensor.safe_open(
            list(spec["files_all"]),
            framework="pt",
            device=spec["device"],
            process_group=None,
            copy=True,
        ) as f:
            for name, tensor in f.tensors():
                if tapped and name in wanted:
                    held[name] = tensor
        _cuda_sync()
        return time.perf_counter() - start, held

    pagecache.settle()
    # One untimed pass first, as in one_pass: the process's one-time costs fall on neither side.
    pagecache.evict(spec["files_all"])
    out["warmup_seconds"] = target_pass(False)[0]
    for i in range(spec["runs"]):
        for tapped in (i % 2 == 0, i % 2 != 0):
            out["cold"].append(pagecache.evict(spec["files_all"]) == 0)
            torch.cuda.reset_peak_memory_stats()
            seconds, held = target_pass(tapped)
            if not tapped:
                out["untapped_target_seconds"].append(seconds)
                continue
            out["target_seconds"].append(seconds)
            out["held_bytes"].append(sum(t.numel() * t.element_size() for t in held.values()))
            before, start = pagecache.read_bytes(), time.perf_counter()
            for name in list(held):
                buffers[name].copy_(held.pop(name))
            _cuda_sync()
            out["seconds"].append(time.perf_counter() - start)
            out["bytes_read"].append(pagecache.read_bytes() - before)
            out["resident_bytes"].append(pagecache.resident_bytes(spec["files_all"]))
            out["peak_device_bytes"].append(torch.cuda.max_memory_allocated())
    out["peak_rss"] = pagecache.peak_rss()
    return out


#: Strategies that time their own phases (one pass: the target's pass, then the draft's).
PHASED: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    **{name: one_pass for name in ONE_PASS},
    "it_one_pass": it_one_pass,
}
STRATEGIES: dict[str, Callable[[dict[str, Any]], Callable[[], None]]] = {
    "full_pass": full_pass,
    "lazy": _lazy("files_all"),
    "lazy_pruned": _lazy("files_pruned"),
    "auto": _product("safetensors_filtered"),
    "selective": _product("instanttensor_selective"),
    "limit": limit,
    "fastsafetensors_stock": fastsafetensors_stock,
    "fastsafetensors_filtered": _product("fastsafetensors_filtered"),
    "runai_stock": _runai_stock(s3=False),
    "runai_filtered": _product("runai_streamer_filtered"),
    "runai_s3_stock": _runai_stock(s3=True),
    "runai_s3_filtered": _product("runai_streamer_filtered", s3=True),
    "it_full": it_full,
    "it_selective": it_selective,
    "lazy_to_gpu": lazy_to_gpu,
}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["strategy"] in PHASED:
        return PHASED[spec["strategy"]](spec)
    run = STRATEGIES[spec["strategy"]](spec)
    pagecache.settle()  # what setting up started in the background ends before any timing
    files = spec["files_all"]
    out: dict[str, Any] = {
        "seconds": [],
        "bytes_read": [],
        "resident_bytes": [],
        "cold": [],
        "rss_before": pagecache.rss(),
    }
    gpu = spec["strategy"] in GPU_STRATEGIES
    network = spec["strategy"] in S3_STRATEGIES
    if network:
        from hybrid_draft.core import figures

        out.update(network_bytes=[], product_network_bytes=[])
    # One untimed cold run first: a process's first run also pays one-time costs (code paged
    # in, fresh memory faulted) that a served draft load has paid in the target's load.
    pagecache.evict(files)
    start = time.perf_counter()
    run()
    out["warmup_seconds"] = time.perf_counter() - start
    for _ in range(spec["runs"]):
        left = pagecache.evict(files)
        if gpu:
            import torch

            torch.cuda.reset_peak_memory_stats()
        before = pagecache.read_bytes()
        if network:  # the bytes over the wire: the socket reads, and the product's count
            chars = pagecache.read_chars()
            start = time.perf_counter()
            with figures.measuring() as cost:
                run()
            out["seconds"].append(time.perf_counter() - start)
            out["network_bytes"].append(pagecache.read_chars() - chars)
            out["product_network_bytes"].append(cost.network)
        else:
            start = time.perf_counter()
            run()
            out["seconds"].append(time.perf_counter() - start)
        if gpu:
            out.setdefault("peak_device_bytes", []).append(torch.cuda.max_memory_allocated())
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
    if "s3" in spec:  # vLLM's copies of an s3:// model's config files: the worker's own
        os.environ["VLLM_ASSETS_CACHE"] = os.path.join(
            os.path.dirname(spec["result_file"]), "vllm-assets"
        )
    result = measure(spec)
    # A result file, not stdout: vLLM's logger writes to stdout.
    with open(spec["result_file"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
