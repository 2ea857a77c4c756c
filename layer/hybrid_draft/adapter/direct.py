"""A trainer's direct ``load_weights`` calls on the served target: the draft follows.

Most RL frameworks never call vLLM's ``reload_weights`` or its weight-transfer sessions:
they reach the worker (a worker extension, ``collective_rpc``, the engine's driver worker)
and call the **target model's** ``load_weights`` themselves, per tensor (OpenRLHF, TRL,
AReaL over NCCL) or per bucket (verl, skyrl-train), or a model loader's ``load_weights`` on
it with a new checkpoint (AReaL from disk); verl (where it finds ``drafter``) and NeMo RL
feed the draft's ``load_weights`` too. vLLM then updates the target alone. Here such calls
are one more trigger of the one load path (``policy.Reload``, source ``direct``):

- **install** (:func:`install`, when a model runner's ``load_model`` returns): the served
  target and draft are linked to their runner (:class:`Served`), and their classes'
  ``load_weights``, vLLM's ``process_weights_after_loading`` and ``DefaultModelLoader
  .load_weights`` see calls on them; calls the layer makes itself, or vLLM within its own
  loads, reloads and sessions (inside a load scope or a load's figures), pass through;
- **the first call** begins an update (:class:`Update`, a ``carry.Carry``): the target's
  decision (``load.begin``), whose tap is a ``hold.Pass`` of the draft's plan;
- **each call on the target**: vLLM's, with what it is given counted and shown to the pass,
  each of the draft's tensors taken by the update's open step (``core/update.py``); when it
  returns, they go to the draft's own ``load_weights`` through the staging of its own layers
  (``carry.Stage``), while they are still the caller's; a tensor brought again (a list, a
  tuple or a stream alike) ends the step there and begins the next; **a call on the draft**
  (a caller that feeds it itself) takes only what the step has not taken yet (nothing is
  loaded twice), with vLLM's MTP completeness check held to the whole step rather than to
  one call;
- **the end**: the caller's own ``process_weights_after_loading`` on the target (verl, NeMo
  RL), the start of a reload or a session, or, for callers that signal no end, the runner's
  next step or dummy batch (``execute_model``, ``_dummy_run``: before the draft's next
  forward). The target's ``loaded``; then the draft's step, which it takes only whole, or
  keeps its weights whole saying what was missing. vLLM's quantized copies of the target's
  head are derived again, as its own updates do.

A failure in the draft's part never fails the caller's call: the draft keeps its weights and
its update is ``load_failed``. Nor does an invalid setting: the update is refused, said once,
and its calls are the caller's own. With the ``reload`` setting off every call runs as vLLM
and the caller make it, and the update is only reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from hybrid_draft import settings
from hybrid_draft.adapter import calls, carry, internals, load, loadscope, parts
from hybrid_draft.core import draftload, figures, hold, policy
from hybrid_draft.core import update as update_model

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: The attribute linking a served model (and its runner) to the layer's :class:`Served`.
ATTR = "_hybrid_draft_direct"
_WRAPPED = "__hybrid_draft_direct__"
_NONE = object()
#: The checkpoint a model loader's ``load_weights`` on the served target reads (AReaL's sync
#: from disk), while it runs.
_DISK: ContextVar[str | None] = ContextVar("hybrid_draft_disk_sync", default=None)

Role = Literal["target", "draft"]


@dataclass
class Served:
    """One model runner's served target and draft, as a caller's direct calls reach them."""

    runner: Any
    target: Any
    draft: Any
    #: Whether the draft reads its target's checkpoint (as served): it follows the target's
    #: checkpoint when a caller points the target at another (AReaL).
    follows: bool
    update: Update | None = None
    #: Whether the layer ran vLLM's processing of the draft's layers in the update it ended
    #: last: the caller's own processing of the draft after it is not run again.
    processed: bool = False
    #: The layout the ``direct_update`` part is on by, as probed when the runner's load
    #: ended (vLLM's names do not change once imported: an update does not probe again).
    layout: str = ""
    #: The draft's plan an earlier update made, with the checkpoint it was made for: the
    #: next update of that checkpoint takes the draft's names from it again (an update's
    #: plan depends on no setting: it always leaves out what vLLM shares with the target).
    plan: tuple[tuple[Any, ...], Any] | None = None


@dataclass(frozen=True)
class Link:
    """What a served model's attribute :data:`ATTR` holds: its runner's :class:`Served`, and
    which model of it this is."""

    served: Served
    role: Role


def _layers_own() -> bool:
    """Whether the layer, or vLLM inside one of its loads, reloads or sessions, is loading
    now (a load's figures or a load scope is open): such calls are not a caller's."""
    return figures.current() is not None or loadscope.current() is not None


def _link(model: Any) -> Link | None:
    """The link of a served model (through vLLM's CUDA-graph wrapper, which forwards
    attributes), or None."""
    try:
        found = getattr(model, ATTR, None)
    except Exception:  # a wrapper that fails on unknown attributes: not one of ours
        return None
    return found if isinstance(found, Link) else None


# --- install -----------------------------------------------------------------------------


def install(runner: Any) -> None:
    """A model runner's ``load_model`` has returned: link its target and draft, and see
    direct calls on them. Never raises: where the part is off, or anything fails, calls run
    as they do without the layer."""
    try:
        if load.unready() is not None:
            return
        get_draft = getattr(runner, "get_draft_model", None)
        draft = get_draft() if callable(get_draft) else None
        if draft is None:
            return  # no draft model (none, or an n-gram proposer): nothing to carry
        off, layout = parts.late_off("direct_update")
        if off is not None:
            return
        vllm_config = runner.vllm_config
        draft_call = _draft_call(vllm_config, None)
        target = runner.get_model()
        follows = draft_call.request().reads_target_checkpoint
        served = Served(runner, target, draft, follows, layout=layout)
        vars(runner)[ATTR] = served
        roles: tuple[tuple[Any, Role], ...] = ((target, "target"), (draft, "draft"))
        for model, role in roles:
            link = Link(served, role)
            vars(model)[ATTR] = link
            _see_load_weights(model, link)
        _wrap_module_function(internals.PROCESS_WEIGHTS_AFTER_LOADING.path, _through_processing)
        _wrap_loader()
    except Exception as exc:  # the direct calls then run as vLLM's own
        load.layer_error("the direct update's installation", exc, settings.event_sink())


def _see_load_weights(model: Any, link: Link) -> None:
    """``model.load_weights``, on this instance only (its class, which the checkpoint-weight
    rules are derived from, stays as it is): a call outside the layer's own loads is a
    direct update's (:func:`_direct`); every other call is the class's, as it is then."""
    cls = type(model)

    @functools.wraps(cls.load_weights)
    def load_weights(*args: Any, **kwargs: Any) -> Any:
        original = cls.load_weights.__get__(model)
        if _layers_own():
            return original(*args, **kwargs)
        return _direct(link, original, args, kwargs)

    setattr(load_weights, _WRAPPED, True)
    vars(model)["load_weights"] = load_weights


def _wrap_module_function(path: str, through: Callable[..., Any]) -> None:
    """The function at ``path`` (``module:name``) replaced by ``through(original, ...)``."""
    module_name, _, name = path.partition(":")
    module = __import__(module_name, fromlist=["_"])
    original = getattr(module, name)
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return through(original, *args, **kwargs)

    setattr(wrapper, _WRAPPED, True)
    setattr(module, name, wrapper)


def _wrap_loader() -> None:
    """vLLM's ``DefaultModelLoader.load_weights`` on a served target, outside the layer's
    own loads (AReaL's sync from a checkpoint on disk): the update names that checkpoint,
    and what its stream lacked of the draft's tensors is read from it by the draft's plan."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    original = DefaultModelLoader.load_weights
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def load_weights(self: Any, model: Any, model_config: Any) -> Any:
        link = _link(model)
        if link is None or link.role != "target" or _layers_own():
            return original(self, model, model_config)
        path = str(model_config.model)
        token = _DISK.set(path)
        try:
            result = original(self, model, model_config)
        finally:
            _DISK.reset(token)
        update = link.served.update
        if update is not None and update.trigger.weights_path == path:
            update.fill()
        return result

    setattr(load_weights, _WRAPPED, True)
    DefaultModelLoader.load_weights = load_weights  # type: ignore[method-assign]


# --- an update ---------------------------------------------------------------------------


def _draft_call(vllm_config: VllmConfig, trigger: policy.Reload | None) -> calls.Call:
    spec = vllm_config.speculative_config
    assert spec is not None and spec.draft_model_config is not None
    return calls.Call.resolve(
        vllm_config,
        spec.draft_model_config,
        internals.draft_load_config(vllm_config),
        trigger,
    )


@contextlib.contextmanager
def _configured(vllm_config: VllmConfig) -> Iterator[None]:
    """The runner's config as vLLM's current one, as its own loads run."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        yield


def _direct(link: Link, original: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> Any:
    """A caller's call on a served model's ``load_weights``: within the open update, or the
    first of one."""
    served = link.served
    update = served.update or _begin(served)
    if update is None:
        return original(*args, **kwargs)
    if link.role == "target":
        return update.on_target(original, args, kwargs)
    return update.on_draft(original, args, kwargs)


def _begin(served: Served) -> Update | None:
    """A new update, decided (the target's decision emitted), the runner's next step made its
    end; None where the layer cannot carry it (the call then runs as vLLM's own). An invalid
    setting refuses it, reported (``config_error``, the target's ``load_failed``): its calls
    run as vLLM's own and the draft keeps its weights until its end, when the draft's
    ``load_failed`` says so."""
    vllm_config: VllmConfig = served.runner.vllm_config
    trigger = policy.Reload("direct", weights_path=_DISK.get())
    refused: settings.ConfigError | None = None
    try:
        with _configured(vllm_config):
            draft_call = _draft_call(vllm_config, trigger)
            if served.follows:  # the target's checkpoint, wherever the caller pointed it
                _follow(draft_call.model_config, vllm_config.model_config)
            call = calls.Call.resolve(vllm_config, trigger=trigger)
            config = draft_call.model_config
            made_for = (config.model, config.revision, config.model_weights)
            known = served.plan
            scope = loadscope.Scope(
                planned=known[1] if known is not None and known[0] == made_for else None
            )
            with loadscope.use(scope):
                try:
                    active = load.begin(lambda: call, trigger)
                except settings.ConfigError as exc:
                    refused = exc
                    active = load.Active(load.unread(trigger), figures.LoadStats())
    except Exception as exc:  # the call runs as vLLM's own, saying why
        load.layer_error("the direct update's start", exc, settings.event_sink())
        return None
    if active is None:
        return None
    tap = active.load.tap
    if tap is not None and trigger.weights_path is None:  # a sync from disk plans its own
        served.plan = (made_for, tap.plan)
    update = Update(
        trigger=trigger,
        scope=scope,
        active=active,
        part="direct_update",
        layout=served.layout,
        target=served.target,
        draft=served.draft,
        draft_call=draft_call,
        refused=refused,
        vllm_config=vllm_config,
        served=served,
    )
    served.update, served.processed = update, False
    update.end_at_next_step()
    return update


def _follow(draft_config: Any, target_config: Any) -> None:
    """A draft that reads its target's checkpoint points where the target now does."""
    for name in ("model", "model_weights", "revision"):
        setattr(draft_config, name, getattr(target_config, name))


def _weights(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...], Any]:
    """A ``load_weights`` call's weights (``_NONE``: a call of another shape), and the rest."""
    if args:
        return args[0], args[1:], kwargs
    if "weights" in kwargs:
        rest = dict(kwargs)
        return rest.pop("weights"), (), rest
    return _NONE, args, kwargs


@dataclass
class Update(carry.Carry):
    """One direct update of a served target, from its first call to its end."""

    served: Served | None = None
    #: The runner's own attributes of the methods the update hooked (its steps, its dummy
    #: batch), before it hooked them (_NONE: the class's).
    steps: dict[str, Any] = dataclasses.field(default_factory=dict)

    def on_target(self, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """The caller's call on the target: vLLM's load, seen; then the draft's share of it
        (a tensor brought again ends the draft's step there). A call that raises ends the
        update (the target's ``load_failed``, the draft kept, saying why)."""
        weights, rest, more = _weights(args, kwargs)
        started = time.perf_counter()
        try:
            with loadscope.use(self.scope), figures.measuring(self.active.cost):
                if self.report_only or weights is _NONE:
                    result = original(*args, **kwargs)
                else:
                    seen = figures.observed(weights, callers=True)
                    try:
                        result = original(seen, *rest, **more)
                    finally:
                        seen.close()
        except BaseException as exc:
            self._count(started)
            self.finish("failed_call", exc)
            raise
        if not self.report_only and weights is not _NONE:
            self.after_call()
        self._count(started)
        return result

    def on_draft(self, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """The caller's call on the draft itself: what the step has not taken yet of the
        draft's own tensors goes into the same staging (nothing is loaded twice: what the
        target's calls brought in this step is taken already)."""
        weights, _, _ = _weights(args, kwargs)
        step = self.step
        if self.report_only or weights is _NONE or step is None:
            with loadscope.use(self.scope):  # the caller's feed, as vLLM takes it
                return original(*args, **kwargs)
        step.fed += 1
        try:
            for name, tensor in weights:
                self.take(name, tensor, "draft")
        except Exception as fault:  # the caller's own stream failed: its error, as vLLM's
            if self.step is not None and not self.step.ended:
                self.step.fail(fault)
            raise
        loaded = self.after_call()
        return loaded if loaded is not None else set()

    def _count(self, started: float) -> None:
        self.active.calls += 1
        self.active.call_seconds += time.perf_counter() - started

    def fill(self) -> None:
        """After a model loader's ``load_weights`` from a checkpoint: the draft's tensors
        its stream lacked (a loader that left the draft's shards out), read from that
        checkpoint by the draft's plan and passed on, so that the draft follows it."""
        passing, step = self.passing, self.step
        if passing is None or step is None or step.state is update_model.State.FAILED:
            return
        lacking = step.lacking()
        if not lacking:
            return
        assert self.served is not None
        try:
            with _configured(self.served.runner.vllm_config), loadscope.use(self.scope):
                for name, tensor in self._reader()(passing.plan, lacking):
                    if self.take(name, tensor, "target") is update_model.Given.TAKEN:
                        step.read_tensors += 1
                        step.read_bytes += hold.nbytes(tensor)
                self.feed()
        except Exception as exc:  # the draft's update fails at its end, saying this
            if not step.ended:
                step.fail(exc)
            else:  # the step it was for has ended: said here
                load.layer_error("the direct update's read from disk", exc, self.active.load.sink)

    def _reader(self) -> Callable[[Any, list[str]], Any]:
        """The draft's planned reader of the target's format (the layer's registered loader
        of that family), as a function of a plan and names."""
        from vllm.model_executor.model_loader import get_model_loader

        assert self.draft_call is not None
        requested = str(self.draft_call.load_config.load_format).lower()
        family = requested if requested in policy.FILTERED_BY_FAMILY else policy.SAFETENSORS
        config = calls.loader_load_config(
            self.draft_call.load_config, policy.FILTERED_BY_FAMILY[family]
        )
        loader: Any = get_model_loader(config)  # the layer's PlannedDraftLoader

        def read(plan: Any, names: list[str]) -> Any:
            return loader.read(draftload.by_name(plan, names))

        return read

    def end_at_next_step(self) -> None:
        """The runner's next step (``execute_model``) or dummy batch (``_dummy_run``, which
        an idle data-parallel rank runs, the draft's forward too) ends the update first:
        attributes of the runner's own while the update is open, so that steps cost nothing
        more once it has ended."""
        served = self.served
        assert served is not None
        runner = served.runner
        for name, ended_by in internals.RUNNER_STEPS.items():
            if not callable(getattr(runner, name, None)):
                continue  # ended by the caller's processing, a reload or a session only
            self.steps[name] = vars(runner).get(name, _NONE)
            setattr(runner, name, _ending(served, getattr(runner, name), ended_by))

    def _unhook_steps(self) -> None:
        served = self.served
        if served is None:
            return
        for name, own in self.steps.items():
            if own is _NONE:
                vars(served.runner).pop(name, None)
            else:
                setattr(served.runner, name, own)
        self.steps.clear()

    def finish(self, ended_by: str, exc: BaseException | None = None) -> None:
        """The update's end (once): the target's ``loaded`` (or ``load_failed`` for a call
        that raised), the draft's step, the quantized copies of the target's head derived
        again. Never raises over the caller's outcome."""
        served = self.served
        assert served is not None
        if served.update is not self:
            return
        served.update = None
        self._unhook_steps()
        self.trigger = dataclasses.replace(self.trigger, ended_by=ended_by)
        self.active.load = dataclasses.replace(self.active.load, trigger=self.trigger)
        if self.draft_call is not None:
            self.draft_call = dataclasses.replace(self.draft_call, trigger=self.trigger)
        carried = self.step is not None
        try:
            with _configured(served.runner.vllm_config), loadscope.use(self.scope):
                self.end(exc, ended_by)
                if exc is None and carried:
                    internals.refresh_quantized_heads(self.draft)
        except Exception as fault:  # never over the caller's own outcome
            load.layer_error("the direct update's end", fault, self.active.load.sink)
        finally:
            served.processed = carried


def _ending(served: Served, original: Callable[..., Any], ended_by: str) -> Callable[..., Any]:
    """``original`` (a runner's method that runs the draft's forward), ending ``served``'s
    open update first."""

    @functools.wraps(original)
    def method(*args: Any, **kwargs: Any) -> Any:
        finish(served, ended_by)
        return original(*args, **kwargs)

    return method


def finish(served: Served, ended_by: str) -> None:
    """End ``served``'s open update, if any (``ended_by`` says what ended it)."""
    update = served.update
    if update is not None:
        update.finish(ended_by)


def settle(runner: Any, ended_by: str) -> None:
    """Before a reload or a weight-transfer session of ``runner``: its open direct update,
    if any, ends first."""
    served = vars(runner).get(ATTR) if runner is not None else None
    if isinstance(served, Served):
        finish(served, ended_by)


def _through_processing(original: Callable[..., Any], model: Any, *args: Any, **kw: Any) -> Any:
    """vLLM's ``process_weights_after_loading`` called by a caller on a served model: on the
    target it ends the open update (after vLLM's processing of the target); on the draft it
    ends the update too, and is not run again where the layer ran vLLM's processing of the
    draft's layers as it staged them (it would repeat steps that are not idempotent)."""
    link = _link(model)
    if link is None or _layers_own():
        return original(model, *args, **kw)
    served = link.served
    if link.role == "target":
        result = original(model, *args, **kw)
        finish(served, "process_weights_after_loading")
        return result
    finish(served, "process_weights_after_loading")
    if served.processed:
        return None
    return original(model, *args, **kw)
