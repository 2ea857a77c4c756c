"""hybrid-draft's draft loaders, registered with vLLM's own ``register_model_loader``.

Both are vLLM's ``DefaultModelLoader`` but for one step: the draft's primary weights are
read from its :class:`~hybrid_draft.planning.DraftPlan` (made once, when the load was
decided) instead of by walking every shard. A shard holding nothing the draft keeps is
never opened; a tensor the rule rejects is never touched, as vLLM already skips other
ranks' experts (``should_skip_weight``) before reading; a tensor behind a module vLLM
replaces with the target's right after loading is not read at all (``sharing``); a tensor
the target's InstantTensor pass kept for the draft (``hold``) is taken from memory.
Everything else is vLLM's: the model's ``load_weights``, its "weights were not
initialized" check (which the skipped parameters pass only because vLLM replaces them, and
only after the layer has checked the rest are complete), quantization. A source without a
plan (secondary weights, a loader used without one) is read by vLLM's own lazy path.

- ``safetensors_filtered``: the kept tensors, shard by shard in file order, each read whole
  from its planned byte range with explicit reads (``shardread``: no memory map, so a shard
  that shrinks while read is an exception, never a SIGBUS). Modes ``auto`` and
  ``safetensors`` (and the selective fallback).
- ``instanttensor_selective``: the kept tensors streamed to the draft's device by
  InstantTensor's ``tensor_filter`` (mode ``selective``).

A third, ``instanttensor_ungrouped``, selects nothing: it is vLLM's InstantTensor load of
a draft with ``process_group=None`` instead of vLLM's world group, for a draft that only
the last pipeline stage loads (``pipeline.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hybrid_draft import checkpoint, planning, policy
from hybrid_draft.adapter import calls, hold, internals, shardread, sharing, stats
from hybrid_draft.events import Sink, emit

if TYPE_CHECKING:
    from vllm.config.load import LoadConfig
    from vllm.config.model import ModelConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    Source = DefaultModelLoader.Source

#: The load formats these loaders are registered under.
FILTERED = "safetensors_filtered"
SELECTIVE = policy.SELECTIVE_FORMAT
UNGROUPED = "instanttensor_ungrouped"

Weights = Generator[tuple[str, torch.Tensor], None, None]


def _tqdm(total: int, desc: str, use_tqdm: bool, **kwargs: Any) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        mininterval=1.0,
        disable=not internals.enable_tqdm(use_tqdm),
        **kwargs,
    )


def lazy_filtered_iterator(
    selection: checkpoint.Selection, use_tqdm_on_load: bool = True
) -> Weights:
    """Read each selected shard's kept tensors, in file order, with explicit reads of their
    planned byte ranges (``shardread``): a shard that shrinks meanwhile raises, naming it.
    One pool of read memory serves the whole selection."""
    with _tqdm(
        len(selection.tensors),
        "Loading the draft's tensors (safetensors, filtered)",
        use_tqdm_on_load,
        unit="shard",
    ) as bar:
        buffers = shardread.Buffers()
        for path, tensors in selection.tensors.items():
            yield from shardread.read_shard(path, selection.shards[path], tensors, buffers)
            bar.update(1)


def instanttensor_selective_iterator(
    selection: checkpoint.Selection, device: torch.device, use_tqdm_on_load: bool = True
) -> Weights:
    """Stream exactly the selected tensors to ``device`` with InstantTensor.

    ``process_group=None``: every rank reads its own copy of the (small) draft, which the
    tensor filter requires; ``copy=True`` keeps tensors valid after the buffer is reused.
    """
    import instanttensor

    with (
        instanttensor.safe_open(
            list(selection.files),
            framework="pt",
            device=device,
            process_group=None,
            copy=True,
            tensor_filter=selection.names,
            tensor_name_match_mode="exact",
        ) as f,
        _tqdm(
            getattr(f, "total_tensor_size", None) or selection.nbytes,
            "Loading the draft's tensors using InstantTensor (selective)",
            use_tqdm_on_load,
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
    use_tqdm_on_load: bool = True,
    local_expert_ids: set[int] | None = None,
    load_engram_on_cpu: bool = False,
) -> Weights:
    """vLLM 0.33's ``instanttensor_weights_iterator`` with ``process_group=None``.

    vLLM's reads with the world group whenever the world has more than one rank, and
    InstantTensor then all-reduces and all-gathers over it: ranks that never load this
    model (the other pipeline stages, for a draft) would never join. Here every rank reads
    the files itself. The rest is vLLM's: other ranks' experts filtered out before reading
    (``should_skip_weight``), Engram tables mapped on the CPU, ``copy=True``.
    """
    import instanttensor
    from safetensors import safe_open

    should_skip_weight = internals.should_skip_weight
    engram = internals.engram_pattern()
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
        with (
            instanttensor.safe_open(
                files,
                framework="pt",
                device=device,
                process_group=None,
                copy=True,
                tensor_filter=tensor_filter,
                tensor_name_match_mode="exact",
            ) as f,
            _tqdm(
                getattr(f, "total_tensor_size", None) or 0,
                "Loading the draft using InstantTensor (this pipeline stage only)",
                use_tqdm_on_load,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
            ) as bar,
        ):
            for name, tensor in f.tensors():
                bar.update(tensor.numel() * tensor.element_size())
                yield name, tensor
    for path, names in cpu_weights.items():
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in names:
                yield name, f.get_tensor(name)


@dataclass(kw_only=True)
class DraftRead:
    """What one draft load takes from where: its plan, the hold it draws on, what it skips.

    Made by the layer when it decides the load (``patch``), handed to the loader through
    :func:`reading`; the loader fills ``sources``.
    """

    plan: planning.DraftPlan
    #: Where its events go (the load's settings').
    sink: Sink
    hold: hold.Hold | None = None
    #: The draft's pipeline-parallel size and speculative method (what vLLM's
    #: replacement depends on), from the configs the load was decided with.
    pipeline_parallel_size: int = 1
    method: str | None = "mtp"
    #: Filled by the load: ``planning.DraftPlan.sources`` keys, as read.
    sources: dict[str, dict[str, int]] = field(default_factory=dict)
    #: The replaced tensors skipped, by name -> kind (after the built model was checked).
    skipped: dict[str, str] = field(default_factory=dict)


_READ: ContextVar[DraftRead | None] = ContextVar("hybrid_draft_draft_read", default=None)


@contextlib.contextmanager
def reading(read: DraftRead | None) -> Iterator[None]:
    """While open, this layer's loaders read the draft by ``read``."""
    token = _READ.set(read)
    try:
        yield
    finally:
        _READ.reset(token)


def _add(counts: dict[str, int], tensor: Any) -> None:
    counts["tensors"] += 1
    counts["bytes"] += hold.nbytes(tensor)


@functools.cache
def _loader_classes() -> dict[str, type]:
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    should_skip_weight = internals.should_skip_weight

    class PlannedDraftLoader(DefaultModelLoader):
        """``DefaultModelLoader`` whose primary weights are read by the draft's plan."""

        def __init__(self, load_config: LoadConfig) -> None:
            # The base class reads plan-less sources as lazy safetensors.
            super().__init__(calls.lazy_load_config(load_config))
            self.requested_load_config = load_config
            self.draft: DraftRead | None = None

        # -- the weights ------------------------------------------------------------------

        def _get_weights_iterator(self, source: Source) -> Weights:
            read = self.draft
            if (
                read is None
                or read.plan.is_unused is None
                or not read.plan.kept
                or source.prefix
                or source.is_unused_weight is None
                or self._encoder_only_lm_prefixes is not None
            ):
                return super()._get_weights_iterator(source)
            local = self.local_expert_ids
            held = read.hold
            taking = [
                t.name
                for t in read.plan.kept
                if held is not None
                and t.name in held.tensors
                and t.name not in read.skipped
                and not should_skip_weight(t.name, local)
            ]
            from_hold = set(taking)
            selection = read.plan.selection(
                skip=lambda n: n in from_hold or should_skip_weight(n, local),
                replaced=read.skipped,
            )
            files = [str(s.path) for s in read.plan.shards]
            stats.resolved(files)
            stats.dropped(set(files) - set(selection.files))
            if self.counter_before_loading_weights == 0.0:
                self.counter_before_loading_weights = time.perf_counter()
            return self._weights(read, taking, selection)

        def _weights(
            self, read: DraftRead, taking: list[str], selection: checkpoint.Selection
        ) -> Weights:
            missed = []
            for name in taking:
                tensor = read.hold.take(name) if read.hold is not None else None
                if tensor is None:  # released meanwhile: read from storage after all
                    missed.append(name)
                    continue
                _add(read.sources["stream"], tensor)
                yield name, tensor
            if missed:
                yield from self._count(read, self.read_names(read.plan, missed))
            yield from self._count(read, self.read(selection))

        @staticmethod
        def _count(read: DraftRead, weights: Iterable[tuple[str, Any]]) -> Weights:
            for name, tensor in weights:
                _add(read.sources["storage"], tensor)
                yield name, tensor

        def read(self, selection: checkpoint.Selection) -> Weights:
            raise NotImplementedError

        def read_names(self, plan: planning.DraftPlan, names: Iterable[str]) -> Weights:
            """The named checkpoint tensors, from storage (the skip's fallback)."""
            wanted = set(names)
            return lazy_filtered_iterator(
                checkpoint.selection(plan.shards, lambda t: t.name in wanted), False
            )

        # -- the load ---------------------------------------------------------------------

        def load_weights(self, model: Any, model_config: ModelConfig) -> None:
            self.draft = read = _READ.get()
            replaceable: dict[str, str] = {}
            if read is not None:
                read.sources = {
                    key: {"tensors": 0, "bytes": 0}
                    for key in ("storage", "stream", "replaced_by_target")
                }
            if read is not None and read.plan.replaced:
                # The built model's own attributes are what vLLM's proposer looks at.
                kinds = read.plan.shared & sharing.expected(
                    model, read.pipeline_parallel_size, read.method, True
                )
                replaceable = sharing.replaceable(model, kinds)
                present = set(replaceable.values())
                read.skipped = {n: k for n, k in read.plan.replaced.items() if k in present}
                sizes = {t.name: t.nbytes for t in read.plan.kept}
                read.sources["replaced_by_target"] = {
                    "tensors": len(read.skipped),
                    "bytes": sum(sizes[n] for n in read.skipped),
                }
            real = model.load_weights

            def load_and_check(weights: Iterable[tuple[str, Any]]) -> Any:
                loaded = real(weights)
                if read is None or not read.skipped:
                    return loaded
                return self._check_skip(model, model_config, read, replaceable, real, loaded)

            model.load_weights = load_and_check
            try:
                super().load_weights(model, model_config)
            finally:
                del model.load_weights

        def _complete(self, model: Any, model_config: ModelConfig, loaded: set[str]) -> bool:
            """vLLM's own "weights were not initialized" check, as a question."""
            quantized = model_config.quantization is not None

            def check(names: set[str]) -> None:
                DefaultModelLoader.track_weights_loading(self, model, names, quantized=quantized)

            return internals.weights_complete(check, model, loaded)

        def _check_skip(
            self,
            model: Any,
            model_config: ModelConfig,
            read: DraftRead,
            replaceable: dict[str, str],
            load: Callable[[Iterable[tuple[str, Any]]], Any],
            loaded: set[str] | None,
        ) -> Any:
            """Exempt the skipped parameters from vLLM's check only if nothing else is
            missing; else read the skipped tensors now (the name rule missed this class)."""
            params = dict(model.named_parameters())
            pending = {n for n in replaceable if loaded is None or n not in loaded}
            # A load_weights that reports nothing (HY-V3's) leaves nothing to check here:
            # the name rule (proven per class) and the check after vLLM's replacement stand.
            if loaded is not None and not self._complete(model, model_config, loaded | pending):
                names = list(read.skipped)
                with sharing.partial_load():
                    more = load(self._count(read, self.read_names(read.plan, names)))
                emit(
                    "hybrid_draft.replaced_fallback",
                    "warning",
                    sink=read.sink,
                    role="draft",
                    names=names,
                    parameters=[],
                    bytes=read.sources["replaced_by_target"]["bytes"],
                    detail="the draft's load left parameters unset that vLLM does not "
                    "replace; the skipped tensors were read from the checkpoint",
                )
                read.sources["replaced_by_target"] = {"tensors": 0, "bytes": 0}
                read.skipped = {}
                return loaded | set(more or ())
            by_kind: dict[str, list[str]] = {}
            for name, kind in read.skipped.items():
                by_kind.setdefault(kind, []).append(name)
            sizes = {t.name: t.nbytes for t in read.plan.kept}
            skipped = sharing.Skipped(
                model=model,
                params={n: params[n] for n in pending},
                kinds={n: replaceable[n] for n in pending},
                names=by_kind,
                nbytes={k: sum(sizes[n] for n in v) for k, v in by_kind.items()},
                read=lambda names: self.read_names(read.plan, names),
                sink=read.sink,
            )
            scope = hold.current()
            if scope is not None:
                scope.skipped.append(skipped)
            else:
                sharing.on_first_forward(skipped)
            return None if loaded is None else loaded | pending

    class FilteredSafetensorsLoader(PlannedDraftLoader):
        """Safetensors read by the draft's plan: never a tensor the plan leaves out."""

        def read(self, selection: checkpoint.Selection) -> Weights:
            return lazy_filtered_iterator(selection, self.load_config.use_tqdm_on_load)

    class SelectiveInstantTensorLoader(PlannedDraftLoader):
        """InstantTensor streaming only the draft's planned tensors onto its device."""

        def read(self, selection: checkpoint.Selection) -> Weights:
            if not selection.files:
                return iter(())  # type: ignore[return-value]
            device = torch.device(
                self.load_config.device or get_current_vllm_config().device_config.device or "cpu"
            )
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            return instanttensor_selective_iterator(
                selection, device, self.load_config.use_tqdm_on_load
            )

    class UngroupedInstantTensorLoader(DefaultModelLoader):
        """vLLM's InstantTensor load, without the world group (a last-stage-only draft)."""

        def __init__(self, load_config: LoadConfig) -> None:
            super().__init__(dataclasses.replace(load_config, load_format=policy.INSTANTTENSOR))

        def _get_weights_iterator(self, source: Source) -> Weights:
            from vllm.config import get_current_vllm_config_or_none
            from vllm.platforms import current_platform

            if not current_platform.is_cuda():
                # vLLM's own read: off CUDA its iterator refuses InstantTensor before it
                # picks a process group, so there is no collective to avoid.
                return super()._get_weights_iterator(source)
            # The steps of vLLM's _get_weights_iterator before its InstantTensor read,
            # through default_loader's names (the layer's load figures see them there).
            default_loader = sys.modules[DefaultModelLoader.__module__]
            folder, files, use_safetensors, index_file = internals.prepare_weights(
                self,
                source.model_or_path,
                source.subfolder,
                source.revision,
                source.fall_back_to_pt,
                source.allow_patterns_overrides,
            )
            if not use_safetensors:  # .bin/.pt: vLLM's readers, which involve no group
                return super()._get_weights_iterator(source)
            if self._encoder_only_lm_prefixes is not None and files:
                files = default_loader.filter_mm_encoder_only_safetensors_files(
                    files,
                    folder,
                    index_file,
                    self._encoder_only_lm_prefixes,
                    weights_mapper=self._encoder_only_weights_mapper,
                )
            if source.is_unused_weight is not None:
                files = default_loader.filter_safetensors_files_by_weight_name(
                    files, source.is_unused_weight
                )
            vllm_config = get_current_vllm_config_or_none()
            engram = getattr(vllm_config, "engram_config", None) if vllm_config else None
            if self.counter_before_loading_weights == 0.0:
                self.counter_before_loading_weights = time.perf_counter()
            weights = instanttensor_ungrouped_iterator(
                files,
                current_platform.current_device(),
                self.load_config.use_tqdm_on_load,
                self.local_expert_ids,
                bool(engram and getattr(engram, "cpu_offload", False)),
            )
            return ((source.prefix + name, tensor) for name, tensor in weights)

    return {
        FILTERED: FilteredSafetensorsLoader,
        SELECTIVE: SelectiveInstantTensorLoader,
        UNGROUPED: UngroupedInstantTensorLoader,
    }


@functools.cache
def register(load_format: str) -> None:
    """Register one of this layer's loaders with vLLM, once per process (a failure is
    not remembered: the next call tries again)."""
    internals.register_model_loader(load_format, _loader_classes()[load_format])
