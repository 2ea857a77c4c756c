"""What vLLM replaces in an MTP draft right after loading it, and the guard for when it did not.

vLLM 0.33's proposers swap an MTP draft's input embedding (``model.embed_tokens``), its LM
head (``lm_head``) and each MTP layer's ``shared_head.head`` for the target's as soon as the
draft is loaded: the V1 ``SpecDecodeBaseProposer`` in ``_maybe_share_embeddings`` /
``_maybe_share_lm_head``, model runner v2 in ``load_eagle_model``. The embedding only when
the pipeline-parallel size is 1; neither when the draft class declares its own copy
(``has_own_embed_tokens`` / ``has_own_lm_head`` true: vLLM then compares the loaded
weights, which must therefore be read). Reading those tensors is wasted work: the layer's
draft loaders skip them (:func:`expected` says which, ``planning.shared_kind`` which
tensors), and vLLM's "weights were not initialized" check still guards every other
parameter.

The guard: the skipped parameters are recorded (:class:`Skipped`); after the proposer's
``load_model`` (when the load scope closes, or at the draft's first forward outside one)
:func:`settle` checks each was replaced by the target's and loads from the checkpoint any
that was not, with a ``hybrid_draft.replaced_fallback`` event. A parameter is never left
unset.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hybrid_draft.adapter import internals
from hybrid_draft.core.planning import SHARED_KINDS
from hybrid_draft.events import Sink, emit

#: The draft's parameters the proposer replaces, by kind: module paths as prefixes, with
#: ``*`` standing for an MTP layer's key.
MODULES = {
    "embed": ("model.embed_tokens.",),
    "head": ("lm_head.", "model.layers.*.shared_head.head."),
}
#: Quantization methods of modules whose parameters are loaded as they are (no
#: post-processing to redo after a late load).
_UNQUANTIZED = ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")


def mechanism_problem() -> str | None:
    """Why this vLLM's proposers will not replace an MTP draft's modules (None: they will)."""
    return internals.share_mechanism_problem()


def expected(
    draft: Any, pipeline_parallel_size: int, method: str | None, is_mtp: bool
) -> frozenset[str]:
    """The kinds of module vLLM will replace in this draft (``draft``: its class, or the
    built model, whose attributes are authoritative)."""
    if method != "mtp" or not is_mtp or mechanism_problem() is not None:
        return frozenset()
    kinds = set()
    if pipeline_parallel_size == 1 and not getattr(draft, "has_own_embed_tokens", False):
        kinds.add("embed")
    if not getattr(draft, "has_own_lm_head", False):
        kinds.add("head")
    return frozenset(kinds)


def _matches(name: str, prefix: str) -> bool:
    head, star, tail = prefix.partition("*")
    if not star:
        return name.startswith(prefix)
    if not name.startswith(head):
        return False
    _, dot, rest = name[len(head) :].partition(".")
    return bool(dot) and rest.startswith(tail.lstrip("."))


def kind_of_param(name: str) -> str | None:
    for kind, prefixes in MODULES.items():
        if any(_matches(name, p) for p in prefixes):
            return kind
    return None


def replaceable(model: Any, kinds: Iterable[str]) -> dict[str, str]:
    """The built draft's parameters of ``kinds`` that a later replacement makes moot:
    name -> kind. A quantized module's parameters are excluded (they are loaded and
    post-processed as usual)."""
    kinds = set(kinds)
    out = {}
    modules = dict(model.named_modules())
    for name, _ in model.named_parameters():
        kind = kind_of_param(name)
        if kind is None or kind not in kinds:
            continue
        if quantized(modules.get(name.rpartition(".")[0])):
            continue
        out[name] = kind
    return out


def quantized(module: Any) -> bool:
    """Whether ``module``'s parameters are processed by a quantization method (rather than
    loaded as they are)."""
    method = getattr(module, "quant_method", None)
    return method is not None and type(method).__name__ not in _UNQUANTIZED


def targets(draft: Any, target: Any) -> frozenset[str]:
    """The kinds of the draft's replaceable modules that are the target's now, which a
    reload of the target restores and the draft's reload never reads: each parameter of
    that kind is the target's own (vLLM shared the module), or one of a quantized module
    (vLLM's quantized copy of the target's unquantized head, which it derives anew from
    the target's whenever the target's weights change)."""
    theirs = {id(p) for p in target.parameters()}
    modules = dict(draft.named_modules(remove_duplicate=False))
    found: dict[str, bool] = {}
    for name, param in draft.named_parameters(remove_duplicate=False):
        kind = kind_of_param(name)
        if kind is None:
            continue
        owner = modules.get(name.rpartition(".")[0])
        shared = id(param) in theirs or quantized(owner)
        found[kind] = found.get(kind, True) and shared
    return frozenset(kind for kind, shared in found.items() if shared)


def target_modules(draft: Any, target: Any) -> set[Any]:
    """The draft's modules that are the target's: a module vLLM shared (one of its own
    parameters is the target's), or vLLM's quantized copy of the target's head. A weight
    update of the target updates them; the draft's own update never touches them."""
    theirs = {id(p) for p in target.parameters()}
    out = set()
    for name, module in draft.named_modules():
        direct = list(module.parameters(recurse=False))
        if any(id(p) in theirs for p in direct) or (
            direct and quantized(module) and kind_of_param(f"{name}.weight") is not None
        ):
            out.add(module)
    return out


def partial_load() -> contextlib.AbstractContextManager[Any]:
    """For a ``load_weights`` call with only some of a draft's tensors: vLLM's own switch
    that turns off the MTP classes' "every MTP layer loaded" check for that one call."""
    return internals.mtp_partial_load()


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


_MISSING = object()


def _loader_attr(param: Any) -> str:
    """The attribute ``load_weights`` finds a parameter's loader through: vLLM's own
    parameter classes expose ``weight_loader`` as a property over ``_weight_loader``."""
    return (
        "_weight_loader"
        if isinstance(getattr(type(param), "weight_loader", None), property)
        else "weight_loader"
    )


@contextlib.contextmanager
def only_into(protected: Iterable[Any]) -> Iterator[None]:
    """While open, ``load_weights`` writes nothing into the ``protected`` parameters (the
    target's, after a replacement): their weight loaders are no-ops."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for param in protected:
            attr = _loader_attr(param)
            saved.append((param, attr, param.__dict__.get(attr, _MISSING)))
            setattr(param, attr, _noop)
        yield
    finally:
        for param, attr, loader in saved:
            if loader is _MISSING:
                param.__dict__.pop(attr, None)
            else:
                setattr(param, attr, loader)


@dataclass
class Skipped:
    """One draft load's skipped parameters, until vLLM has had its chance to replace them.

    ``read``: reads the skipped checkpoint tensors of the given kinds (name, tensor), for
    the fallback; ``names``/``nbytes``: the skipped checkpoint tensors by kind.
    """

    model: Any
    params: dict[str, Any]  # parameter name -> the Parameter object the draft built
    kinds: dict[str, str]  # parameter name -> kind
    names: dict[str, list[str]]  # kind -> skipped checkpoint tensor names
    nbytes: dict[str, int]  # kind -> their bytes
    read: Callable[[list[str]], Iterable[tuple[str, Any]]]
    sink: Sink
    settled: bool = field(default=False)

    def unreplaced(self) -> dict[str, Any]:
        """The skipped parameters the draft still holds (vLLM did not replace them)."""
        out = {}
        for name, param in self.params.items():
            try:
                current = self.model.get_parameter(name)
            except AttributeError:  # the module was swapped for one without it
                continue
            if current is param:
                out[name] = param
        return out


def settle(skipped: Skipped) -> None:
    """Load from the checkpoint every skipped parameter vLLM did not replace (once)."""
    if skipped.settled:
        return
    skipped.settled = True
    missing = skipped.unreplaced()
    if not missing:
        return
    kinds = sorted({skipped.kinds[n] for n in missing})
    names = [n for k in kinds for n in skipped.names.get(k, [])]
    # Everything else the draft holds now, the target's replaced modules included, keeps
    # what it has: only the missing parameters take the checkpoint's tensors.
    protected = [p for n, p in skipped.model.named_parameters() if n not in missing]
    with only_into(protected), partial_load():
        skipped.model.load_weights(skipped.read(names))
    emit(
        "hybrid_draft.replaced_fallback",
        "warning",
        sink=skipped.sink,
        role="draft",
        names=names,
        parameters=sorted(missing),
        bytes=sum(skipped.nbytes.get(k, 0) for k in kinds),
        detail="vLLM did not replace these draft parameters with the target's; they were "
        "loaded from the checkpoint",
    )


def on_first_forward(skipped: Skipped) -> None:
    """Settle at the draft's first forward: for a draft loaded outside a load scope."""
    handle: Any = None

    def hook(_module: Any, _args: Any) -> None:
        handle.remove()
        settle(skipped)

    handle = skipped.model.register_forward_pre_hook(hook)


__all__ = ["SHARED_KINDS", "Skipped", "expected", "replaceable", "settle"]
