"""The draft plan: what one draft load reads, from where, worked out once. Pure: no vLLM.

A :class:`DraftPlan` holds a checkpoint's parsed shard headers and the draft's rules as
plain values (the adapter builds it from what vLLM resolves at load time; ``hybrid-draft
plan`` from a model directory). Everything downstream reads it: the decision event, the
loaders, the one-pass hold, the events and ``plan``/``bench``. No header is parsed twice.

Which tensors a draft keeps comes from its class's checkpoint-weight rule. Of those, the
ones behind the modules vLLM's proposer replaces with the target's right after the draft
loads (:func:`shared_kind`: the input embedding; the LM head and each MTP layer's
``shared_head.head``) are never read on this layer's draft paths: ``replaced``.

What each mode reads of the plan, the rows of ``hybrid-draft plan``, is
:mod:`hybrid_draft.tools.modes`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from hybrid_draft.core.checkpoint import Selection, Shard, TensorInfo

Rule = Callable[[str], bool]
Blocker = tuple[str, str]  # (stable code, detail)
SharedKind = Literal["embed", "head"]
#: The modules vLLM's MTP proposer replaces with the target's, and when (``adapter/sharing``).
SHARED_KINDS: tuple[SharedKind, ...] = ("embed", "head")

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


def shared_kind(name: str) -> SharedKind | None:
    """The replaced module a checkpoint tensor feeds, by name: ``embed`` or ``head``.

    Every MTP ``load_weights`` vLLM 0.33 ships puts a tensor whose module is
    ``embed_tokens`` or ``word_embeddings`` (top-level or an MTP layer's copy) into the
    draft's ``model.embed_tokens``, and an ``lm_head`` or ``shared_head.head`` tensor into
    its ``lm_head`` or an MTP layer's ``shared_head.head``: the modules the proposer swaps
    for the target's. The rule tests prove it class by class; at load time the loaders
    check it against the built model and read whatever the swap did not replace.
    """
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in ("embed_tokens", "word_embeddings"):
        return "embed"
    if module == "lm_head" or ".shared_head.head." in f".{name}":
        return "head"
    return None


def evaluated(shards: Iterable[Shard], rule: Rule | None) -> Rule | None:
    """The rule as a set lookup: evaluated once per name, however many rows ask."""
    if rule is None or isinstance(getattr(rule, "__self__", None), set):
        return rule  # none, or evaluated already
    unused = {t.name for s in shards for t in s.tensors if rule(t.name)}
    return unused.__contains__


def counts(tensors: Iterable[TensorInfo]) -> dict[str, int]:
    """``{"tensors": n, "bytes": b}``: the shape of every count in the events."""
    items = list(tensors)
    return {"tensors": len(items), "bytes": sum(t.nbytes for t in items)}


@dataclass(frozen=True)
class DraftPlan:
    """One draft's load, worked out once from the shard headers and the draft's rules.

    ``rule`` is the draft's effective checkpoint-weight rule (None: it has none) as the
    built class will answer it; ``vllm_rule`` the rule stock vLLM applies (None unless the
    class ships one); ``shared`` the modules vLLM will replace with the target's right
    after this draft loads; ``host_blocker`` why selective streaming cannot run on this
    host; ``notes`` what reading the config found, as ``(code, detail)``.
    """

    shards: tuple[Shard, ...]
    draft_class: str | None = None
    rule_source: str = "none"
    rule: Rule | None = None
    vllm_rule: Rule | None = None
    shared: frozenset[str] = frozenset()
    mtp_layers: int | None = None
    notes: tuple[tuple[str, str], ...] = ()
    host_blocker: Blocker | None = None

    @cached_property
    def is_unused(self) -> Rule | None:
        return evaluated(self.shards, self.rule)

    @cached_property
    def vllm_unused(self) -> Rule | None:
        return (
            self.is_unused
            if self.vllm_rule is self.rule
            else (evaluated(self.shards, self.vllm_rule))
        )

    @cached_property
    def kept(self) -> tuple[TensorInfo, ...]:
        """Every tensor the rule keeps, in file order (empty without a rule)."""
        return tuple(t for _, tensors in self.kept_by_shard for t in tensors)

    @cached_property
    def kept_by_shard(self) -> tuple[tuple[Shard, tuple[TensorInfo, ...]], ...]:
        """The kept tensors of each shard holding one, in file order: what every selection
        starts from, so that a load's selection walks the draft's tensors, not the
        checkpoint's (92,000 on DeepSeek-V3)."""
        unused = self.is_unused
        if unused is None:
            return ()
        out = []
        for shard in self.shards:
            tensors = tuple(t for t in shard.tensors if not unused(t.name))
            if tensors:
                out.append((shard, tensors))
        return tuple(out)

    @cached_property
    def replaced(self) -> dict[str, SharedKind]:
        """The kept tensors behind a module vLLM replaces, and which module."""
        out: dict[str, SharedKind] = {}
        for t in self.kept:
            kind = shared_kind(t.name)
            if kind is not None and kind in self.shared:
                out[t.name] = kind
        return out

    def selection(
        self,
        skip: Callable[[str], bool] | None = None,
        replaced: Iterable[str] | None = None,
    ) -> Selection:
        """What the draft reads: the kept tensors but ``replaced`` (default: all the
        replaced ones) and any ``skip`` says no to (another rank's experts, held ones)."""
        dropped = set(self.replaced if replaced is None else replaced)
        tensors: dict[str, list[TensorInfo]] = {}
        shards: dict[str, Shard] = {}
        for shard, kept in self.kept_by_shard:
            chosen = [
                t for t in kept if t.name not in dropped and not (skip is not None and skip(t.name))
            ]
            if chosen:
                key = shard.location
                tensors[key], shards[key] = chosen, shard
        return Selection(tensors, shards)

    @cached_property
    def selective_blocker(self) -> Blocker | None:
        """Why mode ``selective`` falls back for this draft here (None: it streams)."""
        name = self.draft_class or "draft"
        if self.is_unused is None:
            return ("no_rule", f"{name} has no checkpoint-weight rule to plan its tensors with")
        if not self.kept:
            return ("empty_plan", f"the {name} rule keeps none of the checkpoint's tensors")
        return self.host_blocker

    @cached_property
    def all_tensors(self) -> int:
        return sum(len(s.tensors) for s in self.shards)

    @cached_property
    def all_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def sources(self, held: Iterable[str] = ()) -> dict[str, dict[str, int]]:
        """Where each kept tensor comes from: ``storage``, ``stream`` (``held`` from the
        target's pass) or ``replaced_by_target`` (never read)."""
        held = set(held)
        by_name = {t.name: t for t in self.kept}
        stream = [by_name[n] for n in held if n in by_name and n not in self.replaced]
        replaced = [by_name[n] for n in self.replaced]
        storage = [t for t in self.kept if t.name not in held and t.name not in self.replaced]
        return {
            "storage": counts(storage),
            "stream": counts(stream),
            "replaced_by_target": counts(replaced),
        }

    def reads(self, skip: Callable[[str], bool] | None = None) -> list[TensorInfo]:
        """The kept tensors this rank's draft reads (from a hold or storage): not the
        replaced ones, not what ``skip`` says no to (another rank's experts), in file order."""
        return [
            t
            for t in self.kept
            if t.name not in self.replaced and not (skip is not None and skip(t.name))
        ]

    def holdable(self, budget: int, skip: Callable[[str], bool] | None = None) -> list[TensorInfo]:
        """The draft's tensors the target's pass keeps within ``budget`` bytes, in file order
        (the rest is read by the filtered path)."""
        out, total = [], 0
        for t in self.reads(skip):
            if total + t.nbytes <= budget:
                out.append(t)
                total += t.nbytes
        return out

    def warnings(self) -> list[dict[str, str]]:
        """What would make this draft's load fail or waste reads (codes: :data:`WARNINGS`);
        the config's own findings (``notes``) first."""
        out = [{"code": code, "detail": detail} for code, detail in self.notes]
        if any(w["code"] == "draft_class_unavailable" for w in out):
            return out
        if self.is_unused is None:
            out.append(
                {
                    "code": "no_rule",
                    "detail": (
                        f"{self.draft_class} has no checkpoint-weight rule: every mode opens "
                        f"all {len(self.shards)} shards, lazy ones touch all "
                        f"{self.all_tensors:,} tensors, and selective falls back"
                    ),
                }
            )
            return out
        kept = [t.name for t in self.kept]
        if not any(is_own_tensor(n) for n in kept):
            layers = self.mtp_layers
            declared = (
                "declares no MTP layers"
                if not layers
                else f"declares {layers} MTP layer{'s' if layers != 1 else ''}"
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
                        f"the config {declared} but the {len(self.shards)} shards hold none "
                        f"of {self.draft_class}'s own tensors{shared}: vLLM cannot load this "
                        "draft"
                    ),
                }
            )
        return out
