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
   the draft's plan;
2. **each chunk**: vLLM's call, with the target's ``load_weights`` seen as it takes its
   tensors (counted, and offered to the pass: ``figures.observed``); when it returns, while
   the chunk is still the engine's, the draft's tensors of that call go to the draft's own
   ``load_weights``, its own layers (none of the target's) staged in vLLM's layerwise
   reload at the first of them (``carry.Stage``). vLLM processes each draft layer once it is
   whole (MLA and quantized layers too); its copy into the layer's original storage is held
   back;
3. **finish** (after vLLM's own): the target's ``loaded``, then the draft's load
   (``load.run``): decided at the session's end, it takes what the session passed on only
   if that is every one of its tensors (``drafting.session_check``): then each held-back
   layer is copied into its original storage and vLLM's layerwise reload finishes the draft;
   otherwise every draft layer gets its original tensors back, as they were
   (``carry.Carry``, which a trainer's direct ``load_weights`` calls share).

vLLM's own draft session (``start_draft_weight_update``) is left as vLLM runs it and
reported. Where the ``weight_update`` part is off (a ``part_skipped`` event says why), or the
``reload`` setting is off, vLLM's calls run exactly as they are (with the setting off the
session is still reported).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hybrid_draft import settings
from hybrid_draft.adapter import calls, carry, internals, load, loadscope, parts
from hybrid_draft.core import figures, policy

#: The worker's attribute an open session lives in, from its start to its finish.
ATTR = "_hybrid_draft_session"
_NONE = object()


@dataclass
class Session(carry.Carry):
    """One weight-transfer session of one worker, from its start to its finish: the model
    the engine loads into (``model``) seen in each ``update_weights`` call."""

    model: Any = None

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
        self.active.calls += 1
        self.active.call_seconds += time.perf_counter() - started

    @contextlib.contextmanager
    def _seeing(self) -> Iterator[None]:
        """The model's ``load_weights``, for this call: what it is given counted and shown
        to the tap, and, once it returns, the draft's share of it loaded into the draft."""
        model = self.model
        original = model.load_weights
        own = vars(model).get("load_weights", _NONE)  # an attribute of the instance's own

        def load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
            seen = figures.observed(weights, callers=True)
            try:
                result = original(seen, *args, **kwargs)
            finally:
                seen.close()
            self.after_call()
            return result

        model.load_weights = load_weights
        try:
            yield
        finally:
            if own is _NONE:
                vars(model).pop("load_weights", None)
            else:
                model.load_weights = own


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
    return Session(
        trigger=trigger,
        scope=scope,
        active=active,
        part="weight_update",
        layout=layout,
        target=worker.get_model(),
        draft=draft,
        draft_call=None if is_draft else draft_call,
        vllm_config=vllm_config,
        model=model,
    )


def start(worker: Any, original: Callable[[], Any], is_draft: bool) -> Any:
    """vLLM's ``start_weight_update`` (or ``start_draft_weight_update``), then the session."""
    if load.unready() is not None:
        return original()
    off, layout = parts.late_off("weight_update")
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
            session.end(exc)
    except Exception as fault:  # never over vLLM's own outcome
        load.layer_error("the weight update's end", fault, session.active.load.sink)
