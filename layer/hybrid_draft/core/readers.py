"""The draft's weight readers: iterators of ``(name, tensor)``, one per read path.

No vLLM import: each needs torch and its format's own library alone. The adapter's loader
classes (``adapter/model_loader/``) call these with what vLLM decided (whether to show a
progress bar, which experts this rank skips); ``bench``, ``scripts/gpu-check.sh`` and the
tests call them directly. Each reads only what it is handed: a plan's selection (its
shards, its tensors and their byte ranges) or, for the ungrouped InstantTensor load,
vLLM's own list of files.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from hybrid_draft.core import checkpoint, figures, objectstore, shardread

Weights = Generator[tuple[str, torch.Tensor], None, None]


def _tqdm(total: int, desc: str, progress: bool, **kwargs: Any) -> Any:
    """A progress bar, shown only where ``progress`` (the caller asked vLLM, or not)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, mininterval=1.0, disable=not progress, **kwargs)


def lazy_filtered_iterator(selection: checkpoint.Selection, progress: bool = False) -> Weights:
    """Read each selected shard's kept tensors, in file order, with explicit reads of their
    planned byte ranges (``shardread``): a shard that shrinks meanwhile raises, naming it.
    One pool of read memory serves the whole selection."""
    with _tqdm(
        len(selection.tensors),
        "Loading the draft's tensors (safetensors, filtered)",
        progress,
        unit="shard",
    ) as bar:
        buffers = shardread.Buffers()
        for path, tensors in selection.tensors.items():
            yield from shardread.read_shard(path, selection.shards[path], tensors, buffers)
            bar.update(1)


#: The most memory the selective read's ring buffer takes, unless one tensor needs more
#: (:func:`selective_sizing`).
SELECTIVE_MAX_BUFFER = 256 << 20
#: The bytes of each of its I/O operations: InstantTensor's own default on its disk and
#: buffered backends.
SELECTIVE_CHUNK = 8 << 20
#: The fewest operations it keeps in flight where the draft has that many chunks.
SELECTIVE_MIN_IO_DEPTH = 4


def selective_sizing(sizes: Sequence[int], safe_open: Callable[..., Any]) -> dict[str, int]:
    """The ``buffer_size``, ``io_depth`` and ``chunk_size`` InstantTensor's ``safe_open`` gets
    for a selective read of tensors of ``sizes`` bytes, in the order it reads them.

    Left to itself, ``safe_open`` sizes its ring buffer for a whole model: on disk, 512
    operations of 8 MiB in flight, a 4 GiB buffer set up and torn down for a draft of 150 MiB
    (on an H200, 1.4-1.8 s before the first tensor and 0.3 s to close, against 0.1 s of
    reading). Sized to the draft instead: the buffer is InstantTensor's own recommendation for
    these tensors (room for a tensor and the next two, for most of the bytes), no larger than
    the tensors together or :data:`SELECTIVE_MAX_BUFFER`, never smaller than the largest one;
    the I/O depth is as many 8 MiB operations as that buffer holds, at least
    :data:`SELECTIVE_MIN_IO_DEPTH` (or the draft's chunks, if fewer) and at most
    :data:`SELECTIVE_MAX_BUFFER`'s worth; the chunk size is passed too, so that the buffer
    fits the depth whatever ``INSTANTTENSOR_CHUNK_SIZE`` says.
    An argument ``safe_open`` does not take (an older InstantTensor) is not passed; without
    the recommendation, the buffer is three times the largest tensor, which bounds it.
    """
    if not sizes:
        return {}
    try:
        from instanttensor._impl import recommended_buffer_size_for_tensors

        recommended = int(recommended_buffer_size_for_tensors(list(sizes)))
    except Exception:  # an InstantTensor without it: the bound it never exceeds
        recommended = 3 * max(sizes)
    total = sum(sizes)
    buffer = max(min(recommended, total, SELECTIVE_MAX_BUFFER), max(sizes))
    chunks = -(-total // SELECTIVE_CHUNK)
    depth = min(
        max(buffer // SELECTIVE_CHUNK, min(SELECTIVE_MIN_IO_DEPTH, chunks), 1),
        SELECTIVE_MAX_BUFFER // SELECTIVE_CHUNK,
    )
    sizing = {
        "buffer_size": max(buffer, depth * SELECTIVE_CHUNK),
        "io_depth": depth,
        "chunk_size": SELECTIVE_CHUNK,
    }
    try:
        params = inspect.signature(safe_open).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return sizing
    return {k: v for k, v in sizing.items() if k in params}


def instanttensor_selective_iterator(
    selection: checkpoint.Selection, device: torch.device, progress: bool = False
) -> Weights:
    """Stream exactly the selected tensors to ``device`` with InstantTensor.

    ``process_group=None``: every rank reads its own copy of the (small) draft, which the
    tensor filter requires; ``copy=True`` keeps tensors valid after the buffer is reused;
    the buffer and I/O depth are the draft's (:func:`selective_sizing`).
    """
    import instanttensor

    files = sorted(selection.tensors)  # the order safe_open reads them in
    sizes = [t.nbytes for path in files for t in selection.tensors[path]]
    yield from _instanttensor_stream(
        files,
        device,
        selection.names,
        selection.nbytes,
        "Loading the draft's tensors using InstantTensor (selective)",
        progress,
        **selective_sizing(sizes, instanttensor.safe_open),
    )


def _instanttensor_stream(
    files: list[str],
    device: torch.device,
    tensor_filter: list[str] | None,
    nbytes: int,
    desc: str,
    progress: bool,
    **sizing: int,
) -> Weights:
    """InstantTensor's read of ``files`` onto ``device``, as the draft's readers make it:
    ``process_group=None`` (every rank reads its own copy), ``copy=True`` (tensors stay
    valid after the buffer is reused), exact names."""
    import instanttensor

    with (
        instanttensor.safe_open(
            files,
            framework="pt",
            device=device,
            process_group=None,
            copy=True,
            tensor_filter=tensor_filter,
            tensor_name_match_mode="exact",
            **sizing,
        ) as f,
        _tqdm(
            getattr(f, "total_tensor_size", None) or nbytes,
            desc,
            progress,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
        ) as bar,
    ):
        for name, tensor in f.tensors():
            bar.update(tensor.numel() * tensor.element_size())
            yield name, tensor


def instanttensor_ungrouped_iterator(
    files: list[str],
    device: torch.device,
    progress: bool = False,
    local_expert_ids: set[int] | None = None,
    load_engram_on_cpu: bool = False,
    should_skip_weight: Callable[[str, set[int] | None], bool] = lambda _n, _e: False,
    engram: re.Pattern[str] | None = None,
) -> Weights:
    """vLLM 0.33's ``instanttensor_weights_iterator`` with ``process_group=None``.

    vLLM's reads with the world group whenever the world has more than one rank, and
    InstantTensor then all-reduces and all-gathers over it: ranks that never load this
    model (the other pipeline stages, for a draft) would never join. Here every rank reads
    the files itself. The rest is vLLM's: other ranks' experts filtered out before reading
    (``should_skip_weight``), Engram tables mapped on the CPU, ``copy=True``.
    """
    from safetensors import safe_open

    gpu_names: list[str] = []
    cpu_weights: dict[str, list[str]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                if load_engram_on_cpu and engram is not None and engram.search(name):
                    cpu_weights.setdefault(path, []).append(name)
                else:
                    gpu_names.append(name)
    experts = local_expert_ids is not None and any(
        should_skip_weight(name, set()) for name in gpu_names
    )
    tensor_filter = (
        [name for name in gpu_names if not should_skip_weight(name, local_expert_ids)]
        if cpu_weights or experts
        else None
    )
    if gpu_names:
        yield from _instanttensor_stream(
            files,
            device,
            tensor_filter,
            0,
            "Loading the draft using InstantTensor (this pipeline stage only)",
            progress,
        )
    for path, names in cpu_weights.items():
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in names:
                yield name, f.get_tensor(name)


def fastsafetensors_filtered_iterator(
    selection: checkpoint.Selection, device: torch.device, progress: bool = False
) -> Weights:
    """Read exactly the selected tensors with fastsafetensors, shard by shard.

    ``set_tensor_filter`` makes its copier read only the kept tensors' byte ranges (the
    ``nogds`` copier: a plain read into host memory, then to ``device``); a one-process group,
    as every rank reads its own copy of the (small) draft. The tensors share their buffer's
    ownership, so they stay valid after it is closed.
    """
    from fastsafetensors import SafeTensorsFileLoader
    from fastsafetensors.common import SingleGroup

    with _tqdm(
        len(selection.tensors),
        "Loading the draft's tensors (fastsafetensors, filtered)",
        progress,
        unit="shard",
    ) as bar:
        for path, tensors in selection.tensors.items():
            wanted = {t.name for t in tensors}
            loader = SafeTensorsFileLoader(
                SingleGroup(), device=str(device), nogds=True, set_numa=False
            )
            try:
                loader.add_filenames({0: [path]})
                loader.set_tensor_filter(wanted.__contains__)
                buffer = loader.copy_files_to_device()
                try:
                    for t in tensors:
                        yield t.name, buffer.get_tensor(t.name)
                finally:
                    buffer.close()
            finally:
                loader.close()
            bar.update(1)


def runai_filtered_iterator(
    selection: checkpoint.Selection,
    progress: bool = False,
    access: objectstore.Access | None = None,
) -> Weights:
    """Stream exactly the selected tensors with Run:ai's Model Streamer (0.17's
    ``tensor_names``): it reads each shard's header, then only the kept tensors' byte ranges,
    from local files or object storage (the selection's shards are addressed as the
    streamer opens them), the bytes from object storage counted (``figures.received``).

    Onto the CPU, as vLLM's own Run:ai iterator does outside distributed streaming; the
    tensors are the caller's (``owned=True``), so none is copied again.

    An object is read only as the version its plan read (``objectstore.verify``, before and
    after: Run:ai reads the header again and takes no version), Run:ai's client bounded by
    ``access`` (``objectstore.runai_limits``); a read that fails is explained by the layer's
    own question to the object store (``objectstore.explain``): the object and the answer.
    """
    from runai_model_streamer import SafetensorsStreamer

    paths = list(selection.tensors)
    shards = [selection.shards[p] for p in paths]
    access = access or objectstore.Access()
    objectstore.verify(shards, access, "before the draft's tensors were read")
    remote = any(map(figures.is_object_uri, paths))
    with objectstore.runai_limits(access) if remote else contextlib.nullcontext():
        try:
            with (
                SafetensorsStreamer() as streamer,
                _tqdm(
                    len(selection.names),
                    "Loading the draft's tensors (Run:ai Model Streamer, filtered)",
                    progress,
                    unit="tensor",
                ) as bar,
            ):
                streamer.stream_files(paths, device="cpu", tensor_names=selection.names)
                for name, tensor in figures.received(paths, streamer.get_tensors()):
                    bar.update(1)
                    yield name, tensor
        except Exception as exc:
            why = objectstore.explain(shards, access, exc)
            if why is None:
                raise
            raise why from None
    objectstore.verify(shards, access, "while the draft's tensors were read")
