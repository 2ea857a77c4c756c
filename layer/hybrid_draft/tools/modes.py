"""What a draft reads under each mode, from its plan: the rows of ``hybrid-draft plan`` (and the
shards ``bench`` times). Only the commands ask this; a load reads its own plan.

The rows follow from what vLLM 0.33's loaders and this layer's
do with the checkpoint:

- ``instanttensor``: stock vLLM's second pass (no hybrid-draft): every tensor of every
  shard it opens; shards are dropped only by a rule vLLM itself ships;
- ``instanttensor_pruned``: mode ``instanttensor``: the same pass over the shards the
  draft's rule leaves (vLLM's or this layer's);
- ``lazy``: stock vLLM lazy safetensors: the same shards as stock InstantTensor, copying
  out what the draft keeps; vLLM's iterator calls ``get_tensor`` on every tensor, which
  maps it and faults in its first pages (up to about two readahead windows of each);
- ``lazy_pruned``: the same iterator over the rule-pruned shards (a user's own lazy
  ``draft_load_config``);
- ``auto``: modes ``auto`` and ``safetensors`` (and the selective fallback): lazy
  safetensors over the shards holding a kept tensor, taking only the kept tensors that
  vLLM does not replace (``safetensors_filtered``); with no rule, stock lazy safetensors;
- ``selective``: InstantTensor streaming the same tensors; where it cannot run here the
  ``auto`` row plus the ``fallback`` code and ``detail``;
- ``one_pass``: the target's InstantTensor pass keeps the draft's tensors for it, up to
  the hold budget; the row is what the draft still reads from storage.

For a fastsafetensors or Run:ai target (``load_format``), the stock rows are that format's
(``fastsafetensors``, ``fastsafetensors_pruned``...: the same shards read whole by that
loader), ``auto`` is its filtered read (the same selection, by that library's filter),
``selective`` decides as ``auto`` and is left out, and there is no lazy row.

Per row: ``shards`` (files opened), ``tensors`` and ``bytes`` (read whole; null where the
class has no rule) and ``touched_tensors`` (tensors the loader opens at all).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hybrid_draft.core import policy
from hybrid_draft.core.checkpoint import Selection, Shard
from hybrid_draft.core.planning import DraftPlan, Rule, counts


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
    #: Further keys of the row (``one_pass``: what the target's stream carries).
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "shards": self.shards,
            "tensors": self.tensors,
            "bytes": self.nbytes,
            "touched_tensors": self.touched_tensors,
            **self.extra,
        }
        if self.fallback:
            out.update(fallback=self.fallback, detail=self.detail)
        return out


def prune(shards: Iterable[Shard], is_unused: Rule | None) -> list[Shard]:
    """vLLM's ``filter_safetensors_files_by_weight_name``: drop all-unused shards (never all)."""
    shards = list(shards)
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


def _reads(selection: Selection) -> Reads:
    count = len(selection.names)
    return Reads([_base(f) for f in selection.files], count, selection.nbytes, count)


def _base(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def rows(
    plan: DraftPlan, hold_budget: int | None = None, load_format: str = policy.INSTANTTENSOR
) -> dict[str, Reads]:
    """The reads of each row for a target of ``load_format`` (see the module doc);
    ``one_pass`` when a hold budget is given."""
    unused = plan.is_unused
    stock = prune(plan.shards, plan.vllm_unused)
    pruned = prune(plan.shards, unused)
    if unused is None:
        auto = _lazy(list(plan.shards), None)
    elif plan.kept:
        auto = _reads(plan.selection())
    else:  # a rule that keeps nothing: vLLM's own lazy path (which then fails)
        auto = _lazy(pruned, unused)
    blocker = plan.selective_blocker
    selective = (
        Reads(auto.shards, auto.tensors, auto.nbytes, auto.touched_tensors, *blocker)
        if blocker
        else auto
    )
    if load_format == policy.INSTANTTENSOR:
        rows = {
            "instanttensor": _whole(stock),
            "instanttensor_pruned": _whole(pruned),
            "lazy": _lazy(stock, unused),
            "lazy_pruned": _lazy(pruned, unused),
            "auto": auto,
            "selective": selective,
        }
    else:  # a draft without a rule is not switched: it loads as vLLM loads it (no_plan)
        rows = {
            load_format: _whole(stock),
            f"{load_format}_pruned": _whole(pruned),
            "auto": auto if unused is not None else _whole(stock),
        }
    if hold_budget is not None and unused is not None and plan.kept:
        held = {t.name for t in plan.holdable(hold_budget)}
        rest = _reads(plan.selection(skip=held.__contains__))
        stream = counts(t for t in plan.kept if t.name in held)
        rows["one_pass"] = Reads(
            rest.shards,
            rest.tensors,
            rest.nbytes,
            rest.touched_tensors,
            extra={"stream": stream, "hold_budget": hold_budget},
        )
    return rows


def report(
    plan: DraftPlan,
    model_dir: str,
    hold_budget: int | None = None,
    load_format: str = policy.INSTANTTENSOR,
) -> dict[str, Any]:
    """The JSON object of ``plan --json`` for a target loaded with ``load_format``."""
    decision = auto_decision(load_format)
    if decision.switched and load_format != policy.INSTANTTENSOR and plan.is_unused is None:
        # a fastsafetensors or Run:ai draft is read by its plan or not switched at all
        decision = policy.unplanned(decision, "the draft class has no checkpoint-weight rule")
    auto: dict[str, Any] = {
        "action": decision.action,
        "reason": decision.reason,
        "chosen_format": decision.chosen_format,
    }
    if decision.switched:
        auto["tensor_filter"] = plan.rule_source != "none"
    by_name = {t.name: t for t in plan.kept}
    return {
        "model_dir": model_dir,
        "load_format": load_format,
        "draft_class": plan.draft_class,
        "rule_source": plan.rule_source,
        "checkpoint": {
            "shards": len(plan.shards),
            "tensors": plan.all_tensors,
            "bytes": plan.all_bytes,
        },
        "auto": auto,
        "replaced_by_target": {
            **counts(by_name[n] for n in plan.replaced),
            "modules": sorted(set(plan.replaced.values())),
            "names": sorted(plan.replaced),
        },
        "modes": {name: r.as_dict() for name, r in rows(plan, hold_budget, load_format).items()},
        "warnings": plan.warnings(),
    }


def auto_decision(load_format: str = policy.INSTANTTENSOR) -> policy.Decision:
    """What mode ``auto`` decides for a same-checkpoint draft of a ``load_format`` target."""
    same = policy.Checkpoint(model=".")
    request = policy.Request(
        role="draft",
        requested_format=load_format,
        method="mtp",
        model=same,
        target=same,
    )
    return policy.decide(request, "auto")
