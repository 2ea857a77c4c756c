"""``hybrid-draft plan``: what a same-checkpoint MTP draft reads under each loader, no weights read.

Given the shard headers and the draft's checkpoint-weight rule, each row follows from what
vLLM 0.33's loaders and this layer's do with that checkpoint on this host:

- ``instanttensor``: stock vLLM's second pass (no hybrid-draft): InstantTensor reads every
  tensor of every shard it opens; shards are dropped only by a rule vLLM itself ships;
- ``instanttensor_pruned``: mode ``instanttensor`` under hybrid-draft: the same pass over
  the shards the draft's rule leaves (vLLM's or this layer's);
- ``lazy``: stock vLLM lazy safetensors (no hybrid-draft). It opens the same shards as
  stock InstantTensor and copies out only the tensors the draft keeps, but vLLM's iterator
  calls ``get_tensor`` on every tensor, which maps it and faults in its first pages: the
  kernel reads up to about two readahead windows of each one the draft throws away
  (measured with safetensors 0.8: 16 MiB of a 32 MiB tensor at 8 MiB readahead);
- ``lazy_pruned``: the same iterator over the rule-pruned shards: a user's own lazy
  ``draft_load_config`` under hybrid-draft (the layer keeps that loader, installs the rule);
- ``auto``: modes ``auto`` and ``safetensors`` (and the selective fallback). With a rule,
  lazy safetensors over the shards that hold a kept tensor, skipping every rejected tensor
  before it is touched (the ``safetensors_filtered`` loader, ``tensor_filter: true``); with
  no rule, stock lazy safetensors over every shard; a rule that keeps nothing leaves vLLM's
  own lazy path (which then fails the load: see ``no_draft_tensors``);
- ``selective``: mode ``selective``, InstantTensor streaming only the kept tensors. Where it
  cannot run here (no rule, a rule that keeps nothing, no CUDA, an InstantTensor without
  ``tensor_filter``) the row is the ``auto`` row plus the decision's ``fallback`` code and
  ``detail``: what the draft load would really do.

Per row: ``shards`` (the files the mode opens), ``tensors`` and ``bytes`` (the tensors it
reads whole: every tensor of those shards for InstantTensor, the draft's kept tensors for
the others; null where the class has no rule, since only its ``load_weights`` knows what
it keeps) and ``touched_tensors`` (tensors the loader opens at all).

``warnings`` (:data:`WARNINGS`) name what would make the draft load fail or waste reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hybrid_draft import policy
from hybrid_draft.checkpoint import Shard

Rule = Callable[[str], bool]
MODES = ("instanttensor", "instanttensor_pruned", "lazy", "lazy_pruned", "auto", "selective")

#: Warning codes (stable) and what each means; ``detail`` says it for the checkpoint at hand.
WARNINGS = {
    "no_draft_tensors": "the config declares MTP layers but the shards hold none of the "
    "draft's own tensors: vLLM cannot load this draft",
    "no_rule": "the draft class has no checkpoint-weight rule: every mode opens every shard, "
    "lazy ones touch every tensor, and selective falls back",
    "draft_class_unavailable": "vLLM cannot import the draft class on this host, so its "
    "rule is unknown here",
    "needs_trust_remote_code": "the config's model type is defined by code shipped with the "
    "checkpoint: vLLM loads it only with --trust-remote-code",
    "unknown_model_type": "neither transformers nor vLLM knows the config's model type",
    "unsupported_architecture": "vLLM does not register the checkpoint's architecture: it "
    "cannot load the target",
}


def is_own_tensor(name: str) -> bool:
    """Whether a tensor the draft keeps is its own (its MTP layers), not one it shares.

    The MTP layers sit under a numbered layer (``model.layers.61.``, ``model.mtp_layers.0.``)
    or an ``mtp`` name (``mtp.fc.weight``); the tensors a draft shares with the target, its
    embedding, final norm and LM head, are top-level (``model.embed_tokens.weight``,
    ``lm_head.weight``). A draft that keeps only shared tensors has no layers to load.
    """
    return any(part.isdigit() or "mtp" in part.lower() for part in name.split("."))


@dataclass(frozen=True)
class Reads:
    shards: list[str]
    #: Tensors read whole and their bytes (None: unknown, the class has no rule).
    tensors: int | None
    nbytes: int | None
    #: Tensors the loader opens at all (for stock lazy: every tensor of its shards).
    touched_tensors: int
    #: Why a mode falls back to another row here (a ``selective_fallback`` code), and how.
    fallback: str | None = None
    detail: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "shards": self.shards,
            "tensors": self.tensors,
            "bytes": self.nbytes,
            "touched_tensors": self.touched_tensors,
        }
        if self.fallback:
            out.update(fallback=self.fallback, detail=self.detail)
        return out


def prune(shards: list[Shard], is_unused: Rule | None) -> list[Shard]:
    """vLLM's ``filter_safetensors_files_by_weight_name``: drop all-unused shards (never all)."""
    if is_unused is None:
        return shards
    kept = [s for s in shards if not all(is_unused(t.name) for t in s.tensors)]
    return kept or shards


def _whole(shards: list[Shard]) -> Reads:
    count = sum(len(s.tensors) for s in shards)
    return Reads([s.name for s in shards], count, sum(s.nbytes for s in shards), count)


def _lazy(shards: list[Shard], is_unused: Rule | None) -> Reads:
    """vLLM's lazy iterator: touches every tensor, the draft copies what it keeps."""
    touched = sum(len(s.tensors) for s in shards)
    if is_unused is None:
        return Reads([s.name for s in shards], None, None, touched)
    kept = [t for s in shards for t in s.tensors if not is_unused(t.name)]
    return Reads([s.name for s in shards], len(kept), sum(t.nbytes for t in kept), touched)


def _selected(shards: list[Shard], is_unused: Rule) -> Reads:
    """Only the kept tensors, from only the shards that hold one (the filtered loaders)."""
    names, count, nbytes = [], 0, 0
    for s in shards:
        kept = [t for t in s.tensors if not is_unused(t.name)]
        if kept:
            names.append(s.name)
            count += len(kept)
            nbytes += sum(t.nbytes for t in kept)
    return Reads(names, count, nbytes, count)


def evaluated(shards: list[Shard], rule: Rule | None) -> Rule | None:
    """The rule as a set lookup: evaluated once per name, however many rows ask."""
    if rule is None or isinstance(getattr(rule, "__self__", None), set):
        return rule  # none, or evaluated already
    unused = {t.name for s in shards for t in s.tensors if rule(t.name)}
    return unused.__contains__


def modes(
    shards: list[Shard],
    is_unused: Rule | None,
    vllm_rule: Rule | None,
    selective_blocker: tuple[str, str] | None = None,
    draft_class: str = "draft",
) -> dict[str, Reads]:
    """Reads per row (see the module doc).

    ``is_unused``: the draft's effective rule (None: it has none); ``vllm_rule``: the rule
    stock vLLM applies (None unless the class ships one); ``selective_blocker``: why
    selective cannot run on this host, as ``(fallback code, detail)`` (None: it can, or the
    caller asks for the selective row as such). The checkpoint's own blockers (no rule, a
    rule that keeps nothing) come first, worded as the selective preflight words them.
    """
    same = vllm_rule is is_unused
    is_unused = evaluated(shards, is_unused)
    vllm_rule = is_unused if same else evaluated(shards, vllm_rule)

    stock = prune(shards, vllm_rule)
    pruned = prune(shards, is_unused)
    if is_unused is None:
        auto = _lazy(shards, None)
        blocker = (
            "no_rule",
            f"{draft_class} has no checkpoint-weight rule to plan its tensors with",
        )
    else:
        selected = _selected(shards, is_unused)
        auto = selected if selected.shards else _lazy(pruned, is_unused)
        blocker = (
            None
            if selected.shards
            else ("empty_plan", f"the {draft_class} rule keeps none of the checkpoint's tensors")
        )
    blocker = blocker or selective_blocker
    if blocker:
        selective = Reads(
            auto.shards,
            auto.tensors,
            auto.nbytes,
            auto.touched_tensors,
            fallback=blocker[0],
            detail=blocker[1],
        )
    else:
        selective = auto
    return {
        "instanttensor": _whole(stock),
        "instanttensor_pruned": _whole(pruned),
        "lazy": _lazy(stock, is_unused),
        "lazy_pruned": _lazy(pruned, is_unused),
        "auto": auto,
        "selective": selective,
    }


def warnings(
    shards: list[Shard],
    draft_class: str | None,
    is_unused: Rule | None,
    mtp_layers: int | None,
    notes: Iterable[tuple[str, str]] = (),
) -> list[dict[str, str]]:
    """What would make this draft's load fail or waste reads (codes: :data:`WARNINGS`).

    ``notes``: findings of the caller's own (e.g. from reading the config), kept first.
    Computed from names alone; the same function backs the load-time decision event.
    """
    out = [{"code": code, "detail": detail} for code, detail in notes]
    if any(w["code"] == "draft_class_unavailable" for w in out):
        return out
    tensors = sum(len(s.tensors) for s in shards)
    if is_unused is None:
        out.append(
            {
                "code": "no_rule",
                "detail": (
                    f"{draft_class} has no checkpoint-weight rule: every mode opens all "
                    f"{len(shards)} shards, lazy ones touch all {tensors:,} tensors, and selective "
                    "falls back"
                ),
            }
        )
        return out
    kept = [t.name for s in shards for t in s.tensors if not is_unused(t.name)]
    if not any(is_own_tensor(n) for n in kept):
        declared = (
            "declares no MTP layers"
            if not mtp_layers
            else f"declares {mtp_layers} MTP layer{'s' if mtp_layers != 1 else ''}"
        )
        shared = (
            f", only the {len(kept)} it shares with the target ({', '.join(kept[:3])}"
            f"{', ...' if len(kept) > 3 else ''})"
            if kept
            else ""
        )
        out.append(
            {
                "code": "no_draft_tensors",
                "detail": (
                    f"the config {declared} but the {len(shards)} shards hold none of "
                    f"{draft_class}'s own tensors{shared}: vLLM cannot load this draft"
                ),
            }
        )
    return out


def auto_decision() -> policy.Decision:
    """What mode ``auto`` decides for a same-checkpoint draft of an InstantTensor target."""
    same = policy.Checkpoint(model=".")
    request = policy.Request(
        role="draft", requested_format=policy.INSTANTTENSOR, method="mtp", model=same, target=same
    )
    return policy.decide(request, "auto")


def report(
    model_dir: str,
    draft_class: str | None,
    rule_source: str,
    shards: list[Shard],
    reads: dict[str, Reads],
    found: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """The JSON object of ``plan --json`` (CONTRACT.md)."""
    decision = auto_decision()
    auto = {
        "action": decision.action,
        "reason": decision.reason,
        "chosen_format": decision.chosen_format,
    }
    if decision.chosen_format == policy.SAFETENSORS:
        auto["tensor_filter"] = rule_source != "none"
    return {
        "model_dir": model_dir,
        "draft_class": draft_class,
        "rule_source": rule_source,
        "checkpoint": {
            "shards": len(shards),
            "tensors": sum(len(s.tensors) for s in shards),
            "bytes": sum(s.nbytes for s in shards),
        },
        "auto": auto,
        "modes": {name: r.as_dict() for name, r in reads.items()},
        "warnings": list(found or []),
    }
