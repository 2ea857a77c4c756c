"""A trainer's weight-transfer session: the draft updated with its target, in the same session.

RL trainers sync a policy's weights into vLLM with its weight-transfer API: per training
step ``start_weight_update``, ``update_weights`` once per chunk, ``finish_weight_update``
(``adapter/workers.py`` hooks the worker's methods, which every route ends in). vLLM's
engine loads each chunk into one model, the target (``engine.model.load_weights`` inside
vLLM's layerwise reload of it), and the draft keeps the previous step's weights. Here the
session is one more trigger of the one load path (``policy.Reload``, source
``weight_update``, with the backend and the session's kind as data):

1. **start** (after vLLM's own): the target's decision (``load.begin``); where a draft that
   reads the target's checkpoint follows, the target decision's tap is a ``hold.Pass`` of
   the draft's plan, and the draft's own layers (none of the target's) enter vLLM's
   layerwise reload (:class:`Stage`);
2. **each chunk**: vLLM's call, with the target's ``load_weights`` seen as it takes its
   tensors (counted, and offered to the pass: ``figures.observed``); when it returns, while
   the chunk is still the engine's, the draft's tensors of that call go to the draft's own
   ``load_weights``. vLLM's layerwise reload processes each draft layer once it is whole
   (MLA and quantized layers too); its copy into the layer's original storage is held back;
3. **finish** (after vLLM's own): the target's ``loaded``, then the draft's load
   (``load.run``): decided at the session's end, it takes what the session passed on only
   if that is every one of its tensors (``drafting.session_check``): then each held-back
   layer is copied into its original storage and vLLM's layerwise reload finishes the draft;
   otherwise every draft layer gets its original tensors back, as they were.

vLLM's own draft session (``start_draft_weight_update``) is left as vLLM runs it and
reported. Where the ``weight_update`` part is off (a ``part_skipped`` event says why), or the
``reload`` setting is off, vLLM's calls run exactly as they are (with the setting off the
session is still reported).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybrid_draft import settings
from hybrid_draft.adapter import calls, drafting, internals, load, loadscope, parts, sharing
from hybrid_draft.core import draftread, figures, hold, policy

if TYPE_CHECKING:
    from vllm.config import LoadConfig

#: The worker's attribute an open session lives in, from its start to its finish.
ATTR = "_hybrid_draft_session"
_NONE = object()


@dataclass
class Stage:
    """The draft's own layers in vLLM's layerwise reload for one session: each processed
    once its tensors are all in, its copy into the layer's original storage held back to the
    session's end, then made (:meth:`commit`) or dropped (:meth:`abort`)."""

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
        the target's own update."""
        theirs = sharing.target_modules(draft, target)
        own = [m for m in draft.modules() if m not in theirs]
        stage = cls(draft, own)
        for module in own:
            if any(m in theirs for m in module.modules()):
                if any(True for _ in module.parameters(recurse=False)):
                    stage.abort()
                    raise RuntimeError(
                        f"the draft's {type(module).__name__} holds parameters of its own and "
                        "a module of the target's: its update cannot leave the target's alone"
                    )
                continue  # a container of both: its own modules enter one by one
            internals.initialize_layerwise(module)
        return stage

    def hold_back(self, layer: Any, info: Any) -> bool:
        """vLLM's layerwise reload has processed ``layer``: keep its processed tensors, and
        what the copy into its original storage needs, until the session's end."""
        if layer not in self.own or self.ended:
            return False
        loaded = [(name, None) for name, _ in info.loaded_weights]  # the chunk's tensors let go
        self.held[layer] = dataclasses.replace(info, loaded_weights=loaded)
        return True

    def feed(self, weights: list[tuple[str, Any]]) -> None:
        """The draft's tensors of one ``load_weights`` call of the target, to the draft's own
        ``load_weights`` (a part of the draft: its MTP completeness check off)."""
        with internals.mtp_partial_load(), internals.holding_back(self.hold_back):
            self.draft.load_weights(weights)

    def commit(self, model_config: Any, layout: str) -> None:
        """Every held-back layer copied into its original storage (CUDA graphs were
        captured on it), then vLLM's end of the reload for the rest (attention layers)."""
        self.ended = True
        for layer, info in self.held.items():
            internals.restore_kernel_tensors(layer, info)
        self.held.clear()
        internals.finalize_layerwise(self.draft, model_config, layout)
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
            if info is not None and info.can_load():
                if info.kernel_tensors is not None:
                    internals.place_kernel_tensors(module, info)
                info.reset()
        self._flags()

    def _flags(self) -> None:
        """vLLM's layerwise reload turns torchao's own reload off on the module it starts
        from: each module it started from here gets its setting back."""
        for module in self.own:
            if "_original_do_torchao_reload" in vars(module):
                module._do_torchao_reload = vars(module).pop("_original_do_torchao_reload")


@dataclass
class Session:
    """One weight-transfer session of one worker, from its start to its finish."""

    trigger: policy.Reload
    scope: loadscope.Scope
    #: The session's model's load (the target's, or the draft's in vLLM's draft session).
    active: load.Active
    #: The model the engine loads into, and whether the session only reports (the
    #: ``reload`` setting off: vLLM's calls run exactly as they are).
    model: Any
    report_only: bool
    layout: str
    target: Any = None
    draft: Any = None
    draft_call: calls.Call | None = None
    stage: Stage | None = None

    @property
    def passing(self) -> hold.Pass | None:
        tap = self.active.load.tap
        return tap if isinstance(tap, hold.Pass) else None

    @contextlib.contextmanager
    def chunk(self) -> Iterator[None]:
        """One ``update_weights`` call: measured as part of the session's load, with the
        model's ``load_weights`` seen (and the draft fed) unless the session only reports."""
        started = time.perf_counter()
        with loadscope.use(self.scope), figures.measuring(self.active.cost):
            if self.report_only:
                yield
            else:
                with self._seeing():
                    yield
        self.active.chunks += 1
        self.active.chunk_seconds += time.perf_counter() - started

    @contextlib.contextmanager
    def _seeing(self) -> Iterator[None]:
        """The model's ``load_weights``, for this call: what it is given counted and shown
        to the tap, and, once it returns, the draft's share of it loaded into the draft."""
        model = self.model
        original = model.load_weights
        own = vars(model).get("load_weights", _NONE)  # an attribute of the instance's own

        def load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(figures.observed(weights), *args, **kwargs)
            self.feed()
            return result

        model.load_weights = load_weights
        try:
            yield
        finally:
            if own is _NONE:
                vars(model).pop("load_weights", None)
            else:
                model.load_weights = own

    def feed(self) -> None:
        """The draft's tensors of the call that just returned, into the draft (once a
        chunk has failed to load into it, no more: the draft is left as it was)."""
        passing, stage = self.passing, self.stage
        if passing is None:
            return
        weights = passing.drain()
        if not weights or stage is None or passing.failure is not None:
            return
        started = time.perf_counter()
        try:
            stage.feed(weights)
        except Exception as exc:  # the draft's load fails at the session's end, saying this
            passing.failure = exc
        finally:
            passing.chunks += 1
            passing.seconds += time.perf_counter() - started

    def update_draft(self) -> None:
        """The draft's load at the session's end: decided, then made or dropped."""
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
                read.sources["stream"] = drafting.passed_sources(passing)["stream"]
            if stats is not None:  # the tensors the draft took, as a load yields them
                stats.tensors = len(passing.received)
            stage.commit(call.model_config, self.layout)
            committed.append(True)

        try:
            load.run(lambda: call, commit, self.trigger)
        finally:
            if not committed and self.stage is not None:
                self.stage.abort()


def _engine_model(worker: Any) -> Any:
    return worker.weight_transfer_engine.model


@contextlib.contextmanager
def _configured(worker: Any) -> Iterator[None]:
    """The worker's config as vLLM's current one, as its own session methods run."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        yield


def _open(worker: Any, is_draft: bool, layout: str) -> Session | None:
    """The session vLLM's start has just begun: decided and, for a target session whose
    draft follows, the draft's own layers staged."""
    vllm_config = worker.vllm_config
    engine = worker.weight_transfer_engine
    model = _engine_model(worker)
    backend = getattr(getattr(engine, "config", None), "backend", None)
    trigger = policy.Reload(
        "weight_update",
        checkpoint_format=internals.in_reload(model),
        backend=str(backend) if backend is not None else None,
        session="draft" if is_draft else "target",
    )
    spec = getattr(vllm_config, "speculative_config", None)
    draft_config = getattr(spec, "draft_model_config", None)
    draft = worker.get_draft_model() if draft_config is not None else None
    draft_call = None
    if draft is not None:
        draft_load = internals.draft_load_config(vllm_config)
        draft_call = calls.Call.resolve(vllm_config, draft_config, draft_load, trigger)
    if is_draft:
        if draft_call is None:
            return None
        call = draft_call
    else:
        call = calls.Call.resolve(vllm_config, trigger=trigger)
    scope = loadscope.Scope()
    with loadscope.use(scope):
        active = load.begin(lambda: call, trigger)
    if active is None:
        return None
    snapshot = active.load.snapshot
    session = Session(
        trigger=trigger,
        scope=scope,
        active=active,
        model=model,
        report_only=snapshot is not None and str(snapshot.reload.value) == "off",
        layout=layout,
        target=worker.get_model(),
        draft=draft,
        draft_call=None if is_draft else draft_call,
    )
    passing = session.passing
    if passing is not None and draft is not None:
        try:
            session.stage = Stage.open(draft, session.target)
        except Exception as exc:  # the draft's load at the end fails, saying this
            passing.failure = exc
    return session


def start(worker: Any, original: Callable[[], Any], is_draft: bool) -> Any:
    """vLLM's ``start_weight_update`` (or ``start_draft_weight_update``), then the session."""
    if load.unready() is not None:
        return original()
    off, layout = parts.weight_update_off()
    if off is not None:
        return original()
    load.read_settings()  # an invalid setting stops the update before vLLM's session begins
    result = original()
    try:
        with _configured(worker):
            session = _open(worker, is_draft, layout)
    except settings.ConfigError:
        raise  # reported (config_error, load_failed): an invalid setting stops the update
    except Exception as exc:  # the session goes on as vLLM's own, saying why
        load.layer_error("the weight update's start", exc, settings.event_sink())
        return result
    if session is not None:
        setattr(worker, ATTR, session)
    return result


def chunk(worker: Any, original: Callable[[], Any]) -> Any:
    """vLLM's ``update_weights`` for one chunk, within the worker's open session."""
    session: Session | None = getattr(worker, ATTR, None)
    if session is None:
        return original()
    try:
        with session.chunk():
            return original()
    except BaseException as exc:  # vLLM ends the session: the draft is left as it was
        _close(worker, session, exc)
        raise


def finish(worker: Any, original: Callable[[], Any]) -> Any:
    """vLLM's ``finish_weight_update``, then the session's events and the draft's update."""
    session: Session | None = getattr(worker, ATTR, None)
    if session is None:
        return original()
    try:
        with loadscope.use(session.scope):
            result = original()
    except BaseException as exc:
        _close(worker, session, exc)
        raise
    _close(worker, session, None)
    return result


def _close(worker: Any, session: Session, exc: BaseException | None) -> None:
    """The session's end: its model's ``loaded`` (or ``load_failed``), then, after a target
    session that ended well, the draft's update; the draft is never left half-updated."""
    with contextlib.suppress(AttributeError):
        delattr(worker, ATTR)
    try:
        with _configured(worker), loadscope.use(session.scope):
            load.end(session.active, exc)
            if exc is None and session.draft_call is not None:
                session.update_draft()  # decided: with the setting off, it keeps its weights
    except Exception as fault:  # never over vLLM's own outcome
        load.layer_error("the weight update's end", fault, session.active.load.sink)
    finally:
        if session.stage is not None:
            session.stage.abort()
        session.scope.close()
