"""An update of the target's weights in place that carries the draft (:class:`Carry`).

Two triggers update a served target's weights in calls the layer does not make: a trainer's
weight-transfer session (``adapter/sessions.py``: ``update_weights`` once per chunk) and a
trainer's direct ``load_weights`` calls on the target (``adapter/direct.py``: verl,
OpenRLHF, AReaL, skyrl-train, TRL, NeMo RL). Both load into the target alone; here the
draft's own tensors of each call, as the target's tap passes them on (``hold.Pass``), go to
the draft's own ``load_weights`` once the call's target load has returned, while the
caller's tensors are still the caller's, through vLLM's layerwise reload of the draft's own
layers (:class:`Stage`): each layer is processed (materialized, loaded, its quantization or
MLA processing run) once it is whole, and only its copy into the layer's original storage is
held back to the update's end. There the draft's load (``load.run``) is decided by the
policy under the update's trigger and takes what passed only if that is every one of its
tensors (``drafting.session_check``): then every held-back layer is copied into its
original storage and vLLM's layerwise reload of the draft finishes; otherwise, or when any
step fails, every draft layer holds the previous step's weights as it did before. Never part
one step's and part another's.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybrid_draft.adapter import calls, drafting, internals, load, loadscope, sharing
from hybrid_draft.core import draftread, figures, hold, policy

if TYPE_CHECKING:
    from vllm.config import LoadConfig

#: Marks a copy :meth:`Stage.feed` made of a tensor a layer waits with.
_OWNED = "_hybrid_draft_owned"


@dataclass
class Stage:
    """The draft's own layers in vLLM's layerwise reload for one update: each processed
    once its tensors are all in, its copy into the layer's original storage held back to
    the update's end, then made (:meth:`commit`) or dropped (:meth:`abort`), each all or
    nothing."""

    draft: Any
    #: The draft's own modules (none of the target's), each in the reload.
    own: list[Any]
    #: The processed layers held back, with what their copy needs (their original tensors).
    held: dict[Any, Any] = field(default_factory=dict)
    ended: bool = False

    @classmethod
    def open(cls, draft: Any, target: Any) -> Stage:
        """Put the draft's own layers into vLLM's layerwise reload. A module of the
        target's (one vLLM shared with the draft) is never touched: its weights come with
        the target's own update. A failure part way puts back every layer it had put in."""
        theirs = sharing.target_modules(draft, target)
        stage = cls(draft, [m for m in draft.modules() if m not in theirs])
        try:
            for module in stage.own:
                if any(m in theirs for m in module.modules()):
                    if any(True for _ in module.parameters(recurse=False)):
                        raise RuntimeError(
                            f"the draft's {type(module).__name__} holds parameters of its own "
                            "and a module of the target's: its update cannot leave the "
                            "target's alone"
                        )
                    continue  # a container of both: its own modules enter one by one
                internals.initialize_layerwise(module)
        except BaseException:
            stage.abort()
            raise
        return stage

    def hold_back(self, layer: Any, info: Any) -> bool:
        """vLLM's layerwise reload has processed ``layer``: keep its processed tensors, and
        what the copy into its original storage needs, until the update's end."""
        if layer not in self.own or self.ended:
            return False
        loaded = [(name, None) for name, _ in info.loaded_weights]  # the call's tensors let go
        self.held[layer] = dataclasses.replace(info, loaded_weights=loaded)
        return True

    def feed(self, weights: list[tuple[str, Any]]) -> Any:
        """The draft's tensors of one call, to the draft's own ``load_weights`` (a part of
        the draft: its MTP completeness check off); what it returns. A layer the call left
        incomplete keeps copies of what it was given, not the caller's tensors."""
        with internals.mtp_partial_load(), internals.holding_back(self.hold_back):
            loaded = self.draft.load_weights(weights)
        self._own_pending()
        return loaded

    def _own_pending(self) -> None:
        """vLLM's layerwise reload keeps each tensor it is given until the tensor's layer is
        whole; the caller may free or refill its tensors once its call returns (a bucket of
        a reused buffer), so a layer split across calls waits with copies of its own."""
        import torch

        for module in self.own:
            info = internals.layerwise_info(module)
            if info is None or not info.can_load():
                continue
            for _, bound in info.loaded_weights:
                for key, value in bound.arguments.items():
                    if key == "param" or not isinstance(value, torch.Tensor):
                        continue
                    if not getattr(value, _OWNED, False):
                        copy = value.detach().clone()
                        setattr(copy, _OWNED, True)
                        bound.arguments[key] = copy

    def commit(self, model_config: Any, part: str, layout: str) -> None:
        """Every held-back layer's values exchanged into its original storage (CUDA graphs
        were captured on it), then vLLM's end of the reload for the rest (attention layers,
        every post-load step). A failure of either puts every layer back as it was (the
        previous values are what the exchange left in the processed tensors) and is raised."""
        if self.ended:
            raise RuntimeError("the draft's staged update has ended already")
        exchanged: list[tuple[Any, Any]] = []
        finalizing = False
        try:
            for layer, info in self.held.items():
                exchanged += internals.exchange_kernel_tensors(layer, info)
            finalizing = True
            internals.finalize_layerwise(self.draft, model_config, part, layout)
        except BaseException as exc:
            internals.undo_exchange(exchanged)
            self.abort()
            if finalizing:  # what vLLM derived from the new weights, derived again from these
                try:
                    for module in self.own:
                        if internals.is_deferred_attention(module):
                            internals.process_attention(module, model_config.dtype)
                except Exception as again:
                    exc.add_note(f"deriving the draft's attention tensors again failed: {again}")
            raise
        self.ended = True
        self.held.clear()
        self._flags()

    def abort(self) -> None:
        """Every draft layer back on its original tensors, as they were (once)."""
        if self.ended:
            return
        self.ended = True
        for layer, info in self.held.items():
            internals.place_kernel_tensors(layer, info)
        self.held.clear()
        for module in self.own:
            info = internals.layerwise_info(module)
            if info is not None and info.kernel_tensors is not None:
                internals.place_kernel_tensors(module, info)
            if info is not None and (info.can_load() or info.kernel_tensors is not None):
                info.reset()
        self._flags()

    def _flags(self) -> None:
        """vLLM's layerwise reload turns torchao's own reload off on the module it starts
        from: each module it started from here gets its setting back."""
        for module in self.own:
            if "_original_do_torchao_reload" in vars(module):
                module._do_torchao_reload = vars(module).pop("_original_do_torchao_reload")


@dataclass
class Carry:
    """One update of the target that carries the draft, from its start to its end: the
    target's load (decided at the start, reported at the end) and the draft's tensors as
    the target's tap passes them on, staged as they come (:meth:`feed`)."""

    trigger: policy.Reload
    scope: loadscope.Scope
    #: The updated model's load (the target's, or the draft's in vLLM's draft session).
    active: load.Active
    #: The layer's part this update is carried by, and the layout it is on by.
    part: str
    layout: str
    target: Any = None
    draft: Any = None
    #: The draft's load at the end (None: no draft follows this update).
    draft_call: calls.Call | None = None
    stage: Stage | None = None

    @property
    def report_only(self) -> bool:
        """Whether the update is only reported (the ``reload`` setting off, as the update's
        load read it: vLLM's and the caller's calls run exactly as they are)."""
        snapshot = self.active.load.snapshot
        return snapshot is not None and str(snapshot.reload.value) == "off"

    @property
    def passing(self) -> hold.Pass | None:
        tap = self.active.load.tap
        return tap if isinstance(tap, hold.Pass) else None

    def feed(self) -> Any:
        """The draft's tensors of the call that just returned, into the draft (its layers
        staged at the first of them; once the draft's load of a call has failed, no more:
        the draft is left as it was); what the draft's ``load_weights`` returned."""
        passing = self.passing
        if passing is None:
            return None
        weights = passing.drain()
        if not weights or self.draft is None or passing.failure is not None:
            return None
        started = time.perf_counter()
        try:
            if self.stage is None:
                self.stage = Stage.open(self.draft, self.target)
            return self.stage.feed(weights)
        except Exception as exc:  # the draft's load fails at the update's end, saying this
            passing.failure = exc
            return None
        finally:
            passing.chunks += 1
            passing.seconds += time.perf_counter() - started

    def update_draft(self) -> None:
        """The draft's load at the update's end: decided, then made or dropped."""
        call = self.draft_call
        assert call is not None
        committed: list[bool] = []

        def commit(_config: LoadConfig | None) -> None:
            passing, stage = self.passing, self.stage
            if passing is not None and passing.failure is not None:
                raise passing.failure
            assert stage is not None and passing is not None
            read, stats = draftread.current(), figures.current()
            if read is not None:
                read.skip(sharing.targets(self.draft, self.target))
                passed = drafting.passed_sources(passing)
                read.sources.update(stream=passed["stream"], storage=passed["storage"])
            if stats is not None:  # the tensors the draft took, as a load yields them
                stats.tensors = len(passing.received)
            stage.commit(call.model_config, self.part, self.layout)
            committed.append(True)

        try:
            load.run(lambda: call, commit, self.trigger)
        finally:
            if not committed and self.stage is not None:
                self.stage.abort()

    def end(self, exc: BaseException | None) -> None:
        """The update's end: its model's ``loaded`` (or ``load_failed``), then, after a
        target update that ended well, the draft's; the draft is never left half-updated.
        Raises what the layer's own steps raise (its callers report it, never over the
        caller's outcome)."""
        try:
            load.end(self.active, exc)
            if exc is None and self.draft_call is not None:
                self.update_draft()  # decided: with the setting off, it keeps its weights
        finally:
            if self.stage is not None:
                self.stage.abort()
            self.scope.close()
