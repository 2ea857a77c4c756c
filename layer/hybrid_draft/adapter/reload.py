"""A reload in place: the draft reloaded with its target, in the same call (:func:`run`).

vLLM reloads a served model's weights in place with a model runner's ``reload_weights``
(after a level-2 sleep's ``wake_up``, or with an RL step's new checkpoint or weight
stream), and reloads the target only: the draft keeps what it had, which after a level-2
sleep is whatever its freed memory holds. The layer wraps that method
(``runners.wrap_reload``) and makes it two loads of ``load.run``, decided, planned, read
and reported as a first load is, with the trigger (``policy.Reload``) as data:

1. the target: vLLM's own ``reload_weights``, unchanged; its stream (vLLM's loader of the
   target's format, or the weights iterator it was given) is tapped for the draft, as at
   the first load (``onepass.tap``), inside a load scope of its own;
2. the draft: from the checkpoint the target reloaded from (a new ``weights_path``'s for a
   draft that reads the target's checkpoint, its own otherwise), or from the iterator,
   taking only its own tensors, from the hold first, and never what it shares with the
   target; loaded into its parameters' own storage by vLLM's own steps of a reload in
   place (``internals.reloading``).

Where the ``reload`` part is off for the runner at hand (a ``hybrid_draft.part_skipped``
event says why), vLLM's call runs exactly as it is.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from hybrid_draft import settings
from hybrid_draft.adapter import calls, draftplan, internals, load, loadscope, parts, sharing
from hybrid_draft.core import checkpoint, draftload, draftread, figures, planning, policy
from hybrid_draft.core.readers import Weights

if TYPE_CHECKING:
    from vllm.config import LoadConfig, VllmConfig


def trigger_of(arguments: Mapping[str, Any]) -> policy.Reload:
    """The reload ``reload_weights``' arguments ask for."""
    source: policy.ReloadSource = "checkpoint"
    if arguments.get("weights_iterator") is not None:
        source = "iterator"
    elif arguments.get("weights_path") is not None:
        source = "weights_path"
    return policy.Reload(source, bool(arguments.get("is_checkpoint_format", True)))


def run(
    runner: Any,
    runner_path: str,
    original: Any,
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``runner.reload_weights(*args, **kwargs)``: the target's reload, then the draft's."""
    bound = signature.bind(runner, *args, **kwargs)
    bound.apply_defaults()

    def vllms() -> Any:
        return original(*bound.args, **bound.kwargs)

    if load.unready() is not None:
        return vllms()
    off, layout = parts.reload_off(runner_path)
    if off is not None:
        return vllms()
    trigger = trigger_of(bound.arguments)
    try:
        vllm_config: VllmConfig = runner.vllm_config
        target_model = runner.get_model()
        draft, draft_call = _draft_of(runner, vllm_config, trigger)
        if trigger.source == "weights_path":
            follow(vllm_config, draft_call, str(bound.arguments["weights_path"]))
    except Exception as exc:  # the reload proceeds as vLLM's own, saying why
        load.layer_error("the reload's preparation", exc, settings.event_sink())
        return vllms()
    iterator = bound.arguments.get("weights_iterator")

    def target(_config: LoadConfig | None) -> Any:
        if iterator is not None:  # seen as the model takes it: counted, and tapped
            bound.arguments["weights_iterator"] = figures.observed(iterator, callers=True)
        return vllms()

    with loadscope.scope():
        result = load.run(lambda: calls.Call.resolve(vllm_config, trigger=trigger), target, trigger)
        if draft_call is not None:
            call = draft_call
            load.run(
                lambda: call,
                lambda config: reload_draft(draft, target_model, call, config, layout),
                trigger,
            )
    return result


def _draft_of(
    runner: Any, vllm_config: VllmConfig, trigger: policy.Reload
) -> tuple[Any, calls.Call | None]:
    """The runner's draft model, and the call that loaded it: the configs vLLM's proposers
    load it with (None: no draft model, an n-gram or suffix proposer's included)."""
    draft = runner.get_draft_model()
    spec = getattr(vllm_config, "speculative_config", None)
    draft_config = getattr(spec, "draft_model_config", None)
    if draft is None or draft_config is None:
        return draft, None
    load_config = internals.draft_load_config(vllm_config)
    return draft, calls.Call.resolve(vllm_config, draft_config, load_config, trigger)


def follow(vllm_config: VllmConfig, draft_call: calls.Call | None, weights_path: str) -> None:
    """vLLM's reload points the target's config at ``weights_path`` as it starts (its model
    and nothing else: no revision, no ``model_weights``). The same is done here first, so
    that the decisions, the draft's plan and the hold see the checkpoint the reload reads;
    a draft that read the target's checkpoint follows it there (a draft with a checkpoint
    of its own keeps it)."""
    follows = draft_call is not None and draft_call.request().reads_target_checkpoint
    configs = [vllm_config.model_config]
    if follows and draft_call is not None:
        configs.append(draft_call.model_config)
    for config in configs:
        config.model = weights_path
        config.model_weights = ""
        config.revision = None


def reload_draft(
    model: Any, target: Any, call: calls.Call, config: LoadConfig | None, layout: str
) -> None:
    """Reload the draft ``model`` in place: by its plan where the layer reads it (the hold
    first, then its own tensors from storage; from a weights iterator, the hold alone),
    else by vLLM's loader of its load config; never what is the target's."""
    read = draftread.current()
    theirs = sharing.targets(model, target)
    weights: Iterable[tuple[str, Any]]
    if read is not None:
        read.sources = draftread.empty_sources()
        read.skip(theirs)
        if call.reloads_from("iterator"):
            needed = read.hold.needed if read.hold is not None else frozenset()
            weights = figures.observed(
                draftload.weights(
                    read, draftload.reads(read, lambda n: n not in needed), not_in_stream
                )
            )
        else:
            weights = _loader(config or call.load_config).reload_weights(
                model, call.model_config, read
            )
    else:
        loader = _loader(config or call.load_config)
        every = loader.get_all_weights(call.model_config, model)
        weights = ((n, t) for n, t in every if planning.shared_kind(n) not in theirs)
    with internals.reloading(model, call.model_config, draftplan.device_of(call), layout):
        model.load_weights(weights)


def _loader(config: LoadConfig) -> Any:
    from vllm.model_executor.model_loader import get_model_loader

    return get_model_loader(config)


def not_in_stream(selection: checkpoint.Selection) -> Weights:
    """A draft reloaded from a weights iterator reads nothing from storage: the checkpoint
    holds another step's weights. Its decision made sure the stream gave it everything."""
    names = selection.names
    raise RuntimeError(
        f"the reload's weights iterator did not give the draft {len(names)} of its tensors "
        f"({', '.join(names[:4])}...)"
    )
    yield  # pragma: no cover - a generator, as a reader is
