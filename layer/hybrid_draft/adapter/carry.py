"""An update of the target's weights in place that carries the draft (:class:`Carry`).

Two triggers update a served target's weights in calls the layer does not make: a trainer's
weight-transfer session (``adapter/sessions.py``: ``update_weights`` once per chunk) and a
trainer's direct ``load_weights`` calls on the target (``adapter/direct.py``: verl,
OpenRLHF, AReaL, skyrl-train, TRL, NeMo RL). Both load into the target alone. Here each of
the draft's tensors a call brings is taken by the update's open step (``core/update.py``,
whose rules decide what a step takes and how it ends), and once the call's target load has
returned, while the caller's tensors are still the caller's, they go to the draft's own
``load_weights`` through vLLM's layerwise reload of the draft's own layers (:class:`Stage`):
each layer is processed (materialized, loaded, its quantization or MLA processing run) once
it is whole, and only its copy into the layer's original storage is held back to the step's
end. There the draft's load (``load.run``) takes the step's outcome
(``drafting.session_check``): committed, every held-back layer is copied into its original
storage and vLLM's layerwise reload of the draft finishes; otherwise, or when any part of
that fails, every draft layer holds the previous step's weights as it did before. Never part
one step's and part another's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybrid_draft import settings
from hybrid_draft.adapter import calls, drafting, internals, load, loadscope, sharing
from hybrid_draft.core import draftread, figures, hold, planning, policy, update

if TYPE_CHECKING:
    from vllm.config import LoadConfig

#: Marks a copy :meth:`Stage.feed` made of a tensor a layer waits with.
_OWNED = "_hybrid_draft_owned"


def _put_back(module: Any) -> None:
    """``module`` out of vLLM's layerwise reload, on its own tensors as they are."""
    info = internals.layerwise_info(module)
    if info is not None and info.can_load():
        if info.kernel_tensors is not None:
            internals.place_kernel_tensors(module, info)
        info.reset()


def _nothing_to_load(module: Any) -> bool:
    """Whether ``module`` holds no parameter and no persistent buffer (what a checkpoint
    holds), itself or below."""
    if any(True for _ in module.parameters()):
        return False
    return all(
        name in owner._non_persistent_buffers_set
        for owner in module.modules()
        for name in owner._buffers
    )


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
    #: The parameters the draft's ``load_weights`` said it loaded (None: one call said
    #: nothing), for a step without a plan (:meth:`complete`).
    loaded: set[str] | None = field(default_factory=set)
    #: The draft's modules left out of the staging (the target's, and those with nothing
    #: to load), which its steps never touch.
    theirs: set[Any] = field(default_factory=set)

    @classmethod
    def open(cls, draft: Any, target: Any) -> Stage:
        """Put the draft's own layers into vLLM's layerwise reload. A module of the
        target's (one vLLM shared with the draft, or the very module: vLLM caches its
        rotary embeddings, one object for every layer of the same shape) is left as it is:
        its weights come with the target's own update. So is one that holds nothing a
        checkpoint loads (a rotary embedding's cache, which other models may share), which
        the reload would leave on the meta device until the update's end. vLLM's reload
        takes a layer with everything below it: what it took of these is put back at once.
        A module of the target's that waits in the target's own reload now (a session's)
        is neither taken nor put back: vLLM's reload passes over a layer already in it.
        A failure part way puts back every layer it had put in."""
        theirs = sharing.target_modules(draft, target) | set(target.modules())
        theirs |= {m for m in draft.modules() if _nothing_to_load(m)}
        theirs_now = {m for m in theirs if internals.in_layerwise_reload(m)}
        stage = cls(draft, [m for m in draft.modules() if m not in theirs], theirs=theirs)

        def put_back() -> None:
            for module in draft.modules():
                if module in theirs and module not in theirs_now:
                    _put_back(module)

        try:
            for module in stage.own:
                internals.initialize_layerwise(module)
            put_back()
        except BaseException:
            put_back()
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
        if self.loaded is not None:
            self.loaded = self.loaded | set(loaded) if loaded is not None else None
        return loaded

    def complete(self, target: Any, load_config: Any, quantized: bool) -> bool:
        """Whether the feed gave the draft every tensor it loads: no own layer left waiting
        in vLLM's layerwise reload for some of its elements (its own count), and vLLM's own
        "weights were not initialized" check passing with what the feed loaded and what is
        the target's (it exempts every layer of an unquantized model with a quantization
        method: the count is what sees a linear layer left out). An attention layer waiting
        only for scales is not missing anything."""
        if self.loaded is None:
            return False
        waiting = [m for m in self.own if internals.waits_for_tensors(m)]
        # An attention layer's scales are in a checkpoint only where it is quantized: vLLM's
        # end of the reload keeps its own where none came (and derives the rest).
        if any(not internals.is_deferred_attention(m) for m in waiting):
            return False
        theirs = {id(p) for p in target.parameters()}
        shared = {n for n, p in self.draft.named_parameters() if id(p) in theirs}
        return internals.draft_weights_complete(
            self.draft, load_config, self.loaded | shared, quantized
        )

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
        layers it processes only there, every post-load step), whose own copies into
        original storage are exchanged the same way. A failure of any of it, part way or
        not, puts every layer back as it was (the previous values are what the exchange
        left in the processed tensors; an attention layer's own tensors, which vLLM's end
        writes in place, from a copy made before it) and is raised."""
        if self.ended:
            raise RuntimeError("the draft's staged update has ended already")
        exchanged: list[tuple[Any, Any]] = []
        # Before anything is written: an attention layer's tensors may be views of another
        # layer's weights (MLA's W_UV of kv_b_proj's), which the exchange changes.
        saved = self._attention_tensors()
        finalizing = False

        def exchange(layer: Any, info: Any) -> bool:
            exchanged.extend(internals.exchange_kernel_tensors(layer, info))
            return True

        try:
            for layer, info in self.held.items():
                exchange(layer, info)
            finalizing = True
            # The target's modules, still in the target's own reload in a session's step
            # ended by a repeat, are the target's to finish.
            with internals.holding_back(exchange), internals.outside_reload(self.theirs):
                internals.finalize_layerwise(self.draft, model_config, part, layout)
        except BaseException as exc:
            internals.undo_exchange(exchanged)
            internals.undo_exchange(saved)
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

    def _attention_tensors(self) -> list[tuple[Any, Any]]:
        """Each of the draft's attention layers vLLM's end of the reload processes, its own
        tensors with a copy of their values now: that end writes their scales in place."""
        import torch

        saved = []
        for module in self.own:
            info = internals.layerwise_info(module)
            if info is None or not info.can_load() or info.kernel_tensors is None:
                continue
            if not internals.is_deferred_attention(module):
                continue
            parameters, buffers = info.kernel_tensors
            for tensor in (*parameters.values(), *buffers.values()):
                if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                    saved.append((tensor, tensor.detach().clone()))
        return saved

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


def called(trigger: policy.Reload) -> str:
    """How an update is named in the draft's details."""
    if trigger.source == "direct":
        return "the direct update"
    return f"the {trigger.backend} session" if trigger.backend else "the session"


@dataclass
class Carry:
    """One update of the target that carries the draft, from its start to its end: the
    target's load (decided at the start, reported at the end) and the draft's steps
    (``core/update.py``): each of the draft's tensors a call brings, staged as it comes
    (:meth:`feed`), each step decided and committed or dropped at its end
    (:meth:`end_step`)."""

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
    #: The draft's step open now (None: no draft follows, or the update is only reported).
    step: update.Step | None = None
    #: An invalid setting that refused the update at its start: every call is the caller's
    #: own, and the draft keeps its weights, its load failed with this.
    refused: settings.ConfigError | None = None
    #: vLLM's config of the runner or worker: current while a step ends within a call.
    vllm_config: Any = None

    def __post_init__(self) -> None:
        """The first step, where a draft follows: by the draft's plan (the tap's pass), or
        without one for a draft that reads the target's checkpoint (a caller's own feed of
        it is then checked by vLLM at the end). A draft with a checkpoint of its own keeps
        it: a caller's calls on it are vLLM's own."""
        if self.draft_call is None or self.draft is None or self.report_only:
            return
        passing = self.passing
        if passing is not None:
            needed = tuple(t.name for t in passing.plan.kept if t.name in passing.needed)
            self._open(update.Step(needed, called(self.trigger)))
        elif self.draft_call.request().reads_target_checkpoint:
            self._open(update.Step(None, called(self.trigger)))

    def _open(self, step: update.Step) -> None:
        self.step = step
        passing = self.passing
        if passing is not None:
            passing.step = step
        self.scope.step = step

    @property
    def report_only(self) -> bool:
        """Whether the update is only reported (the ``reload`` setting off, as the update's
        load read it, or an invalid setting: vLLM's and the caller's calls run exactly as
        they are)."""
        snapshot = self.active.load.snapshot
        return snapshot is None or str(snapshot.reload.value) == "off"

    @property
    def passing(self) -> hold.Pass | None:
        tap = self.active.load.tap
        return tap if isinstance(tap, hold.Pass) else None

    def take(self, name: str, tensor: Any, role: update.Role) -> update.Given:
        """``name`` brought by a call on the ``role`` model (the target's calls come here
        through the target's tap, ``hold.Pass``): what it is to the open step. Without a
        plan, a tensor of what vLLM shares with the target is the target's alone."""
        step = self.step
        if step is None or step.ended:
            return update.Given.IGNORED
        if step.needed is None and planning.shared_kind(name) in self._theirs:
            return update.Given.NOT_DRAFTS
        return step.take(name, tensor, role)

    @functools.cached_property
    def _theirs(self) -> frozenset[str]:
        """The kinds of the draft's modules that are the target's (``sharing.targets``)."""
        return sharing.targets(self.draft, self.target)

    def feed(self) -> Any:
        """The draft's tensors of the call that just returned, staged in the draft's own
        layers (at the first of them); where the call brought one again, its step ends
        there (decided, committed or kept) and the next takes the rest. What the draft's
        ``load_weights`` returned."""
        step = self.step
        if step is None:
            return None
        loaded = self._stage(step, step.drain())
        while step.spill:
            with self._configured():
                self.end_step("next_sync")
            step = step.next()
            self._open(step)
            more = self._stage(step, step.drain())
            loaded = more if loaded is None else loaded | (more or set())
        return loaded

    def after_call(self) -> Any:
        """:meth:`feed` once a caller's call has returned, never over that call: a fault of
        the layer's own there is reported, and the open step fails with it."""
        try:
            with loadscope.use(self.scope):
                return self.feed()
        except Exception as fault:
            load.layer_error("the draft's staging", fault, self.active.load.sink)
            if self.step is not None and not self.step.ended:
                self.step.fail(fault)
            return None

    def _configured(self) -> contextlib.AbstractContextManager[Any]:
        """vLLM's config of the runner or worker as the current one, as its own loads run."""
        if self.vllm_config is None:
            return contextlib.nullcontext()
        from vllm.config import set_current_vllm_config

        manager: contextlib.AbstractContextManager[Any] = set_current_vllm_config(self.vllm_config)
        return manager

    def _stage(self, step: update.Step, weights: list[tuple[str, Any]]) -> Any:
        """``weights`` into the draft's staging (once a feed of the step has failed, no more:
        the draft is left as it was)."""
        if not weights or self.draft is None or step.state is update.State.FAILED:
            return None
        started = time.perf_counter()
        try:
            if self.stage is None:
                self.stage = Stage.open(self.draft, self.target)
            loaded = self.stage.feed(weights)
            step.bytes += sum(hold.nbytes(tensor) for _, tensor in weights)
            return loaded
        except Exception as exc:  # the draft's load fails at the step's end, saying this
            step.fail(exc)
            return None
        finally:
            step.calls += 1
            step.seconds += time.perf_counter() - started

    def end_step(self, ended_by: str | None, exc: BaseException | None = None) -> None:
        """The open step's end: decided (``update.Step.end``), then the draft's load at it
        (``load.run``: its decision, then its commit, or its weights kept); the staging is
        gone after it, whatever happened. ``exc``: the target's call that ended it raised."""
        step = self.step
        assert step is not None
        complete = None
        if step.needed is None and self.stage is not None and step.state is update.State.FED:
            complete = self._complete()
        unseen = self.trigger.source == "weight_update" and (
            self.passing is None or not self.passing.offered
        )
        step.end(complete=complete, target_failed=exc is not None, unseen=unseen)
        try:
            self.update_draft(ended_by)
        except Exception as fault:  # a failed step's load_failed said it; else the layer's
            if step.state is not update.State.FAILED:
                load.layer_error("the draft's update", fault, self.active.load.sink)
        finally:
            if self.stage is not None:
                self.stage.abort()
                self.stage = None

    def _complete(self) -> bool:
        """vLLM's check of a step without a plan: every parameter of the draft's loaded."""
        assert self.stage is not None and self.draft_call is not None
        quantized = self.draft_call.model_config.quantization is not None
        try:
            return self.stage.complete(self.target, self.draft_call.load_config, quantized)
        except Exception:  # a check that cannot run proves nothing: the draft is kept
            return False

    def update_draft(self, ended_by: str | None) -> None:
        """The draft's load at a step's end: decided (the step's outcome), then made or
        dropped."""
        assert self.draft_call is not None
        trigger = self.trigger
        if ended_by is not None and trigger.source == "direct":
            trigger = dataclasses.replace(trigger, ended_by=ended_by)
        call = dataclasses.replace(self.draft_call, trigger=trigger)
        committed: list[bool] = []

        def commit(_config: LoadConfig | None) -> None:
            step, stage = self.step, self.stage
            assert step is not None
            if step.failure is not None:
                raise step.failure
            if stage is None:
                raise RuntimeError("the draft's step was committed with nothing staged")
            read, stats = draftread.current(), figures.current()
            if read is not None:
                read.skip(sharing.targets(self.draft, self.target))
                passed = drafting.passed_sources(read.plan, step)
                read.sources.update(stream=passed["stream"], storage=passed["storage"])
            if stats is not None:  # the tensors the draft took, as a load yields them
                stats.tensors = len(step.taken)
            try:
                stage.commit(call.model_config, self.part, self.layout)
            except BaseException as exc:
                step.fail(exc)
                raise
            committed.append(True)

        try:
            load.run(lambda: call, commit, trigger)
        finally:
            if not committed and self.stage is not None:
                self.stage.abort()

    def end(self, exc: BaseException | None, ended_by: str | None = None) -> None:
        """The update's end: its model's ``loaded`` (or ``load_failed``), then the draft's
        step (a target update that failed leaves the draft's weights, saying so); the
        draft is never left half-updated. Raises what the layer's own steps raise (its
        callers report it, never over the caller's outcome)."""
        try:
            if self.refused is not None:
                if self.draft_call is not None:
                    call = self.draft_call
                    load.refused(lambda: call, self.trigger, self.refused)
                return
            load.end(self.active, exc)
            if self.step is not None:
                self.end_step(ended_by, exc)
            elif exc is None and self.draft_call is not None:
                self.update_draft(ended_by)  # decided: with the setting off, it keeps its weights
        finally:
            if self.step is not None:
                self.step.spill.clear()  # the rest of a call that raised: nothing more of it
            if self.stage is not None:
                self.stage.abort()
                self.stage = None
            self.scope.close()
