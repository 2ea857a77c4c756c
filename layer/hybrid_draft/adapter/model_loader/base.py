"""The base of the layer's planned draft loaders: vLLM's ``DefaultModelLoader`` but for
the reader of the draft's primary weights.

Imported only after vLLM is (``loaders.register``). :class:`PlannedDraftLoader` takes the
draft's :class:`~hybrid_draft.adapter.draftread.DraftRead`, decides what the hold gives and
what storage must give (the plan's selection: kept tensors, less the held, the replaced and
other ranks' experts), counts both, and checks the skip of replaced tensors after vLLM's
``load_weights``. A subclass per target format says only how storage is read
(:meth:`PlannedDraftLoader.read`); each names the load format it is registered under.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from hybrid_draft import checkpoint, planning
from hybrid_draft.adapter import calls, hold, internals, readers, sharing, stats
from hybrid_draft.adapter.draftread import DraftRead, current
from hybrid_draft.adapter.readers import Weights
from hybrid_draft.events import emit

if TYPE_CHECKING:
    from vllm.config.load import LoadConfig
    from vllm.config.model import ModelConfig

    Source = DefaultModelLoader.Source


def _add(counts: dict[str, int], tensor: Any) -> None:
    counts["tensors"] += 1
    counts["bytes"] += hold.nbytes(tensor)


class PlannedDraftLoader(DefaultModelLoader):
    """``DefaultModelLoader`` whose primary weights are read by the draft's plan."""

    #: The load format this loader is registered under.
    load_format: ClassVar[str]

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
            and not internals.should_skip_weight(t.name, local)
        ]
        from_hold = set(taking)
        selection = read.plan.selection(
            skip=lambda n: n in from_hold or internals.should_skip_weight(n, local),
            replaced=read.skipped,
        )
        files = [s.location for s in read.plan.shards]
        stats.resolved(files, {s.location: s.size for s in read.plan.shards})
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
        return readers.lazy_filtered_iterator(
            checkpoint.selection(plan.shards, lambda t: t.name in wanted), False
        )

    # -- the load ---------------------------------------------------------------------

    def load_weights(self, model: Any, model_config: ModelConfig) -> None:
        self.draft = read = current()
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
