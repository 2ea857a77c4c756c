"""The base of the layer's planned draft loaders: vLLM's ``DefaultModelLoader`` but for
the reader of the draft's primary weights.

Imported only when vLLM first builds one (``loaders.register_all``'s stand-ins).
:class:`PlannedDraftLoader` takes the draft's :class:`~hybrid_draft.core.draftread.DraftRead`
and hands the core (``core/draftload.py``) what only vLLM knows: which experts this rank
skips. The core splits the read between the hold and storage and counts both; this class
checks the skip of replaced tensors after vLLM's ``load_weights``. A subclass per target
format says only how storage is read (:meth:`PlannedDraftLoader.read`); each names the load
format it is registered under.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from hybrid_draft.adapter import calls, internals, loadscope, sharing
from hybrid_draft.core import checkpoint, draftload, figures, planning
from hybrid_draft.core.draftread import DraftRead, current
from hybrid_draft.core.readers import Weights
from hybrid_draft.events import emit

if TYPE_CHECKING:
    from vllm.config.load import LoadConfig
    from vllm.config.model import ModelConfig

    Source = DefaultModelLoader.Source


_NONE = object()


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
        planned = draftload.reads(read, lambda n: internals.should_skip_weight(n, local))
        files = [s.location for s in read.plan.shards]
        figures.resolved(files, {s.location: s.size for s in read.plan.shards})
        figures.dropped(set(files) - set(planned.selection.files))
        if self.counter_before_loading_weights == 0.0:
            self.counter_before_loading_weights = time.perf_counter()
        return draftload.weights(read, planned, self.read)

    def read(self, selection: checkpoint.Selection) -> Weights:
        raise NotImplementedError

    @property
    def progress(self) -> bool:
        """Whether this rank shows a progress bar for the read: vLLM's answer."""
        return internals.enable_tqdm(self.load_config.use_tqdm_on_load)

    def read_names(self, plan: planning.DraftPlan, names: Iterable[str]) -> Weights:
        """The named checkpoint tensors, from storage by this format's reader (the skip's
        fallback)."""
        return self.read(draftload.by_name(plan, names))

    # -- the load ---------------------------------------------------------------------

    def reload_weights(self, model: Any, model_config: ModelConfig, read: DraftRead) -> Weights:
        """The draft's tensors for a reload in place (``adapter.reload``): read by its plan
        as its first load reads them, other ranks' experts left out as vLLM's load sets
        that up; ``read`` already skips what is the target's."""
        self.draft = read
        internals.init_ep_weight_filter(self, model, model_config)
        weights: Weights = self.get_all_weights(model_config, model)
        return weights

    def load_weights(self, model: Any, model_config: ModelConfig) -> None:
        self.draft = read = current()
        replaceable: dict[str, str] = {}
        if read is not None:
            read.sources = draftload.empty_sources()
        if read is not None and read.plan.replaced:
            # The built model's own attributes are what vLLM's proposer looks at.
            kinds = read.plan.shared & sharing.expected(
                model, read.pipeline_parallel_size, read.method, True
            )
            replaceable = sharing.replaceable(model, kinds)
            read.skip(replaceable.values())
        real = model.load_weights
        own = vars(model).get("load_weights", _NONE)  # an attribute of the instance's own

        def load_and_check(weights: Iterable[tuple[str, Any]]) -> Any:
            loaded = real(weights)
            if read is None or not read.skipped:
                return loaded
            return self._check_skip(model, model_config, read, replaceable, real, loaded)

        model.load_weights = load_and_check
        try:
            super().load_weights(model, model_config)
        finally:
            if own is _NONE:
                del model.load_weights
            else:
                model.load_weights = own

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
                more = load(draftload.counted(read, self.read_names(read.plan, names)))
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
        scope = loadscope.current()
        if scope is not None:
            scope.skipped.append(skipped)
        else:
            sharing.on_first_forward(skipped)
        return None if loaded is None else loaded | pending
