"""The draft-load strategies the benchmark times, each run cold in a worker process.

``python -m hybrid_draft.tools.bench.strategies SPEC.json`` runs one strategy ``runs`` times and
writes one JSON object to the spec's ``result_file``. Before every run each shard is
evicted from the page cache and ``mincore`` confirms it; a run reports wall seconds, bytes
read from storage (``/proc/self/io``) and the checkpoint pages resident afterwards; the
worker reports its peak RSS. One process per strategy keeps the RSS figures apart.

The product's strategies run the layer's own code with or without vLLM: the draft's plan
(:func:`bench_plan`), its read split between the hold and storage by ``core/draftload.py``
with the format's reader of ``core/readers.py`` (:func:`draft_weights`: what the layer's
loader hands vLLM's ``load_weights``), each tensor copied into the draft's buffers on the
spec's device, a CUDA one where there is one: ``auto`` (filtered safetensors, the reader of
the ``safetensors_filtered`` loader mode ``auto`` switches a same-checkpoint draft to),
``selective`` (InstantTensor with ``tensor_filter``, sized to the draft, onto CUDA; without
CUDA the very ``auto`` path mode ``selective`` falls back to), ``fastsafetensors_filtered``,
``runai_filtered`` (and ``runai_s3_filtered`` against object storage), and ``one_pass``
(the target's InstantTensor pass, on the CPU a whole-shard stream standing for it, offered
to the product's hold, then the draft from the hold; beside the same pass untapped).

Stock vLLM and the floors, read onto the CPU: ``full_pass`` (every byte of every shard, as
a second InstantTensor pass reads), ``lazy`` and ``lazy_pruned`` (vLLM's real
``safetensors_weights_iterator``, the draft's tensors copied into preallocated buffers, all
shards or the rule-pruned ones), ``limit`` (one sequential pass over exactly the byte ranges
the draft reads, merged: the storage's floor), ``fastsafetensors_stock`` (every tensor of
the rule-pruned shards, read whole by fastsafetensors' ``ParallelLoader`` as vLLM's
``fastsafetensors_weights_iterator`` drives it, onto the CPU with ``nogds=True``),
``runai_stock`` (vLLM's real ``runai_safetensors_weights_iterator`` over the rule-pruned
shards; ``runai_s3_stock`` over their ``s3://`` copies). With vLLM, the one pass of the
other target formats: ``fastsafetensors_one_pass`` and ``runai_one_pass`` (and
``runai_s3_one_pass``), the target's pass through vLLM's own loader with the tap decided by
production's code, then the draft from the hold.

Stock InstantTensor (CUDA only): ``it_full`` (its full pass: what a draft load reads
without the layer) and ``it_selective`` (``tensor_filter`` over the draft's own tensors,
InstantTensor's defaults otherwise).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from hybrid_draft.core.policy import (
    FASTSAFETENSORS_FILTERED,
    FILTERED,
    RUNAI_FILTERED,
    SELECTIVE,
)
from hybrid_draft.tools.bench import pagecache

if TYPE_CHECKING:
    from hybrid_draft.core.planning import DraftPlan

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
#: Stock InstantTensor, which reads onto a CUDA device only.
GPU_STRATEGIES = ("it_full", "it_selective")
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


def vllm_available() -> bool:
    """Whether vLLM can be imported here: not where it is absent or blocked (:func:`block_vllm`)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def block_vllm() -> None:
    """Make vLLM unimportable in this process, as on a machine without it (``--without-vllm``)."""
    sys.modules["vllm"] = None  # type: ignore[assignment]


#: The draft's tensors by name, written beside the bench checkpoint: what ``DeepSeekMTP``
#: loads of its layout, for planning where vLLM is not installed.
DRAFT_NAMES = "bench-draft-tensors.json"


def bench_plan(directory: str) -> DraftPlan:
    """The draft's plan: the product's own (vLLM's draft class and the rule the layer gives
    it) where vLLM can be imported; else a core plan of the checkpoint's headers with the
    names its layout recorded for ``DeepSeekMTP`` as the rule, the replaced ones by name."""
    from pathlib import Path

    from hybrid_draft.core import checkpoint, planning

    if vllm_available():
        from hybrid_draft.tools import draftinfo

        return draftinfo.for_model_dir(directory)
    wanted = set(json.loads((Path(directory) / DRAFT_NAMES).read_text()))
    return planning.DraftPlan(
        tuple(checkpoint.read_checkpoint(directory)),
        draft_class="DeepSeekMTP",
        rule_source="layout",
        rule=lambda name: name not in wanted,
        shared=frozenset(planning.SHARED_KINDS),
    )


def _plan(spec: dict[str, Any]) -> DraftPlan:
    return bench_plan(spec["model_dir"])


def _s3_plan(spec: dict[str, Any]) -> DraftPlan:
    """The draft's plan over the shards' ``s3://`` addresses: the local plan's draft class
    and rules, each shard's header read from object storage by the product's ranged
    requests (``objectstore``), as a served load of an ``s3://`` checkpoint plans it."""
    import dataclasses

    from hybrid_draft.core import objectstore

    local = _plan(spec)
    where = spec["s3"]["files"]
    shards = objectstore.read_shards([where[str(s.path)] for s in local.shards])
    return dataclasses.replace(local, shards=tuple(shards))


def reader(load_format: str, device: str) -> Callable[[Any], Any]:
    """The core reader the layer's loader of ``load_format`` reads storage with (its
    ``read``): onto ``device`` for InstantTensor and fastsafetensors, onto the CPU for the
    filtered safetensors and Run:ai reads, as those loaders read."""
    import torch

    from hybrid_draft.core import readers

    if load_format == SELECTIVE:
        return lambda s: readers.instanttensor_selective_iterator(s, torch.device(device))
    if load_format == FASTSAFETENSORS_FILTERED:
        return lambda s: readers.fastsafetensors_filtered_iterator(s, torch.device(device))
    if load_format == RUNAI_FILTERED:
        return readers.runai_filtered_iterator
    return readers.lazy_filtered_iterator


def draft_weights(plan: DraftPlan, read_storage: Callable[[Any], Any], held: Any = None) -> Any:
    """One draft load's tensors as the layer's loader hands them to vLLM's ``load_weights``:
    its read of ``plan`` (the replaced tensors skipped), split between the hold ``held`` and
    storage (``read_storage``), counted: ``core/draftload.py``, the code the loader runs.
    The loader adds only what needs vLLM: other ranks' experts skipped (one rank here: none)
    and, after ``load_weights``, the check that vLLM replaced what was skipped."""
    from hybrid_draft import settings
    from hybrid_draft.core import draftload
    from hybrid_draft.core.draftread import DraftRead

    read = DraftRead(plan=plan, sink=settings.process_sink(), hold=held)
    read.skipped = dict(plan.replaced)
    read.sources = draftload.empty_sources()
    return draftload.weights(read, draftload.reads(read), read_storage)


def selective_blocker(device: str) -> str | None:
    """Why mode ``selective`` reads ``auto``'s way here (None: it streams with InstantTensor):
    the layer's own host check where vLLM can be imported, else torch's and InstantTensor's."""
    from hybrid_draft.adapter import draftplan

    if vllm_available():
        found = draftplan.host_blocker(device)
        return None if found is None else found[1]
    if not device.startswith("cuda"):
        return "CUDA is not available (torch)"
    return draftplan.tensor_filter_supported()


#: The product's filtered strategies: the load format of the layer's loader each runs the
#: reader of, and whether it reads the checkpoint's ``s3://`` copy.
PRODUCT = {
    "auto": (FILTERED, False),
    "selective": (SELECTIVE, False),
    "fastsafetensors_filtered": (FASTSAFETENSORS_FILTERED, False),
    "runai_filtered": (RUNAI_FILTERED, False),
    "runai_s3_filtered": (RUNAI_FILTERED, True),
}


def product(spec: dict[str, Any]) -> Callable[[], None]:
    """The product's draft load (:func:`draft_weights`), every tensor copied into the draft's
    buffers on the spec's device, as ``load_weights`` copies it into its parameter."""
    load_format, s3 = PRODUCT[spec["strategy"]]
    device = spec["device"]
    if load_format == SELECTIVE:
        blocked = selective_blocker(device)
        if blocked is not None:
            load_format, spec["ran"] = FILTERED, f"auto ({blocked})"
    spec.setdefault("ran", load_format)
    plan = _s3_plan(spec) if s3 else _plan(spec)
    read_storage = reader(load_format, device)
    buffers = _buffers(spec, device, {r[3] for r in spec["tensor_ranges"]})

    def run() -> None:
        for name, tensor in draft_weights(plan, read_storage):
            buffers[name].copy_(tensor)
        if device != "cpu":
            _cuda_sync()

    return run


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


def instanttensor_stream(files: list[str], device: str) -> Any:
    """The target's InstantTensor pass as vLLM's ``instanttensor_weights_iterator`` makes it
    on one rank: every tensor of every shard onto ``device``, ``copy=True``, InstantTensor
    sizing its buffer itself."""
    import instanttensor

    with instanttensor.safe_open(
        list(files), framework="pt", device=device, process_group=None, copy=True
    ) as f:
        yield from f.tensors()


def one_pass(spec: dict[str, Any]) -> dict[str, Any]:
    """The target's pass with the product's tap, then the draft's load from the hold; and
    the same target pass untapped, alternating, every run cold.

    The target's pass is InstantTensor's real stream onto the CUDA device
    (:func:`instanttensor_stream`), or, on the CPU, the whole-shard stream that stands for it
    (:func:`stream_whole_shards`); each tensor it yields is offered to the product's hold
    (``Hold.offer``, the tap), made as a served target's load makes it (``Hold.of``: the
    draft's reads less the replaced tensors, within ``hold_budget`` capped at a quarter of
    what the target leaves free on the device). The draft then takes its tensors from the
    hold through :func:`draft_weights` (auto's reader for any it misses) into its buffers."""
    import torch

    from hybrid_draft import settings
    from hybrid_draft.core import hold

    plan = _plan(spec)
    device = spec["device"]
    cuda = device.startswith("cuda")
    files = spec["files_all"]
    current = settings.load()
    budget = hold.effective_budget(
        int(current.hold_budget.value), hold.free_memory(torch.device(device)), plan.all_bytes
    )
    stream = instanttensor_stream if cuda else stream_whole_shards
    read_storage = reader(FILTERED, device)
    buffers = _buffers(spec, device, {t.name for t in plan.reads()})

    def target_pass(tap: Any) -> float:
        start = time.perf_counter()
        for name, tensor in stream(files, device):
            if tap is not None:
                tap.offer(name, tensor)
        if cuda:
            _cuda_sync()
        return time.perf_counter() - start

    out = _phased_result(device)
    for _ in _tapped_runs(out, files, spec["runs"], lambda: target_pass(None)):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        made = hold.Hold.of(plan, None, budget, lambda _name: False, current)
        out["target_seconds"].append(target_pass(made))
        out["held_bytes"].append(made.peak_bytes)
        before, start = pagecache.read_bytes(), time.perf_counter()
        for name, tensor in draft_weights(plan, read_storage, made):
            buffers[name].copy_(tensor)
        if cuda:
            _cuda_sync()
        out["seconds"].append(time.perf_counter() - start)
        out["bytes_read"].append(pagecache.read_bytes() - before)
        out["resident_bytes"].append(pagecache.resident_bytes(files))
        if cuda:
            out["peak_device_bytes"].append(torch.cuda.max_memory_allocated())
        made.release("the bench's draft load ended")
    out["peak_rss"] = pagecache.peak_rss()
    stream_name = "InstantTensor's stream" if cuda else "the whole-shard stream"
    out["ran"] = f"{stream_name} + tap + {FILTERED}"
    return out


def _tapped_runs(
    out: dict[str, Any], files: list[str], runs: int, untapped: Callable[[], float]
) -> Iterator[None]:
    """A one-pass strategy's runs, every one cold: ``runs`` tapped and as many untapped
    target passes, alternating which comes first; the untapped ones are timed here, and the
    caller does each tapped one when this yields. One untimed pass comes first: a process's
    first pass also pays its one-time costs (code paths, the allocator's growth), which would
    fall on whichever side ran first."""
    pagecache.settle()  # what setting up started in the background ends before any timing
    pagecache.evict(files)
    out["warmup_seconds"] = untapped()
    for i in range(runs):
        for tapped in (i % 2 == 0, i % 2 != 0):
            out["cold"].append(pagecache.evict(files) == 0)
            if tapped:
                yield
            else:
                out["untapped_target_seconds"].append(untapped())


def _phased_result(device: str) -> dict[str, Any]:
    """The per-run lists of a one-pass strategy, empty."""
    keys = ("seconds", "bytes_read", "resident_bytes", "cold", "target_seconds")
    return {
        **{key: [] for key in keys},
        "untapped_target_seconds": [],
        "held_bytes": [],
        **({"peak_device_bytes": []} if device.startswith("cuda") else {}),
        "rss_before": pagecache.rss(),
    }


#: The one-pass strategies whose target is read by vLLM's own loader: the target's load
#: format, the layer's loader its draft is switched to, and whether the checkpoint is read
#: from its ``s3://`` copy.
VLLM_ONE_PASS = {
    "fastsafetensors_one_pass": ("fastsafetensors", FASTSAFETENSORS_FILTERED, False),
    "runai_one_pass": ("runai_streamer", RUNAI_FILTERED, False),
    "runai_s3_one_pass": ("runai_streamer", RUNAI_FILTERED, True),
}


def _target_loader(load_format: str) -> Any:
    """The target's loader as vLLM picks it for ``load_format``, reading onto the CPU: its
    ``DefaultModelLoader`` (fastsafetensors' iterator, which needs CUDA, stood in for) or
    its real ``RunaiModelStreamerLoader``."""
    from vllm.config.load import LoadConfig

    config = LoadConfig(load_format=load_format, device="cpu", use_tqdm_on_load=False)
    if load_format == "runai_streamer":
        from vllm.model_executor.model_loader.runai_streamer_loader import (
            RunaiModelStreamerLoader,
        )

        return RunaiModelStreamerLoader(config)
    import vllm.model_executor.model_loader.default_loader as default_loader

    # The one stand-in: vLLM's fastsafetensors read, which needs CUDA.
    setattr(  # noqa: B010
        default_loader, "fastsafetensors_weights_iterator", fastsafetensors_whole_shards
    )
    return default_loader.DefaultModelLoader(config)


def vllm_one_pass(spec: dict[str, Any]) -> dict[str, Any]:
    """A fastsafetensors or Run:ai target's pass through vLLM's own loader with the
    product's tap, then the draft's load from the hold (:func:`draft_weights`); and the same
    target pass untapped, alternating, every run cold. The tap (what it holds, its budget
    with the free-memory cap, the expert filter) is decided by production's code on the
    real vLLM configs of serving this checkpoint with the target's format."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config

    from hybrid_draft.adapter import loadscope
    from hybrid_draft.core import figures

    target_format, draft_format, s3 = VLLM_ONE_PASS[spec["strategy"]]
    plan = _s3_plan(spec) if s3 else _plan(spec)
    model = spec["s3"]["uri"] if s3 else spec["model_dir"]
    target = _target_loader(target_format)
    config = served_configs(model, target_format)
    target_model: Any = SimpleNamespace()  # the target reads every tensor
    model_config: Any = SimpleNamespace(model=model, revision=None, model_weights="")
    read_storage = reader(draft_format, "cpu")
    buffers = _buffers(spec, "cpu", {t.name for t in plan.reads()})
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

    out = _phased_result("cpu")
    network: dict[str, list[Any]] | None = {key: [] for key in _NETWORK_KEYS} if s3 else None
    for _ in _tapped_runs(out, files, spec["runs"], lambda: target_pass(None)):
        with set_current_vllm_config(config), loadscope.scope():
            decided = target_load(config)
            held = decided.tap
            if held is None:
                raise RuntimeError(f"the target's load holds nothing: {decided.target}")
            out["target_seconds"].append(target_pass(decided, network))
            out["held_bytes"].append(held.peak_bytes)
            chars = pagecache.read_chars()
            before, start = pagecache.read_bytes(), time.perf_counter()
            with figures.measuring() as cost:
                for name, tensor in draft_weights(plan, read_storage, held):
                    buffers[name].copy_(tensor)
            out["seconds"].append(time.perf_counter() - start)
            out["bytes_read"].append(pagecache.read_bytes() - before)
            if network is not None:
                network["network_bytes"].append(pagecache.read_chars() - chars)
                network["product_network_bytes"].append(cost.network)
            out["resident_bytes"].append(pagecache.resident_bytes(files))
            held.release("the bench's draft load ended")
    out["peak_rss"] = pagecache.peak_rss()
    out["ran"] = f"tap + {draft_format}"
    if network is not None:
        out.update(network)
    return out


#: A one-pass strategy's per-run figures against object storage (``run.py`` reports them).
_NETWORK_KEYS = (
    "network_bytes",
    "product_network_bytes",
    "target_network_bytes",
    "target_product_network_bytes",
)


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


def it_full(spec: dict[str, Any]) -> Callable[[], None]:
    """Stock vLLM's draft load with ``--load-format instanttensor``: InstantTensor's full
    pass onto the device, every tensor of every shard (none kept)."""

    def run() -> None:
        for _name, _tensor in instanttensor_stream(spec["files_all"], spec["device"]):
            pass
        _cuda_sync()

    return run


def it_selective(spec: dict[str, Any]) -> Callable[[], None]:
    """InstantTensor with ``tensor_filter`` over the draft's own tensors and every other
    argument its default: the selective read as it was before it was sized to the draft."""
    import instanttensor

    names = [r[3] for r in spec["tensor_ranges"]]

    def run() -> None:
        with instanttensor.safe_open(
            list(spec["files_own"]),
            framework="pt",
            device=spec["device"],
            process_group=None,
            copy=True,
            tensor_filter=names,
            tensor_name_match_mode="exact",
        ) as f:
            for _name, _tensor in f.tensors():
                pass
        _cuda_sync()

    return run


#: Strategies that time their own phases (one pass: the target's pass, then the draft's).
PHASED: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "one_pass": one_pass,
    **{name: vllm_one_pass for name in VLLM_ONE_PASS},
}
STRATEGIES: dict[str, Callable[[dict[str, Any]], Callable[[], None]]] = {
    "full_pass": full_pass,
    "lazy": _lazy("files_all"),
    "lazy_pruned": _lazy("files_pruned"),
    **{name: product for name in PRODUCT},
    "limit": limit,
    "fastsafetensors_stock": fastsafetensors_stock,
    "runai_stock": _runai_stock(s3=False),
    "runai_s3_stock": _runai_stock(s3=True),
    "it_full": it_full,
    "it_selective": it_selective,
}
#: The strategies that put the draft's tensors on the spec's device (a CUDA one where there
#: is one); the others read onto the CPU.
ON_DEVICE = frozenset({*PRODUCT, "one_pass", *GPU_STRATEGIES})


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["strategy"] not in ON_DEVICE:
        spec["device"] = "cpu"
    if spec["strategy"] in PHASED:
        return {**PHASED[spec["strategy"]](spec), "device": spec["device"]}
    run = STRATEGIES[spec["strategy"]](spec)
    pagecache.settle()  # what setting up started in the background ends before any timing
    files = spec["files_all"]
    out: dict[str, Any] = {
        "seconds": [],
        "bytes_read": [],
        "resident_bytes": [],
        "cold": [],
        "rss_before": pagecache.rss(),
        "device": spec["device"],
    }
    gpu = spec["device"].startswith("cuda")
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
    if spec.get("without_vllm"):
        block_vllm()
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
