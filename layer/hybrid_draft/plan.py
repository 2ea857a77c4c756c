"""``hybrid-draft plan``: what a same-checkpoint MTP draft reads under each loader, no weights read.

Given the shard headers and the draft's checkpoint-weight rule, each mode's reads follow
from vLLM 0.33's loaders:

- ``instanttensor``: a second InstantTensor pass as stock vLLM makes it, every tensor of
  every shard it opens (shards are dropped only by a rule vLLM itself ships);
- ``instanttensor_pruned``: the same pass with this layer's rules installed (what mode
  ``instanttensor`` reads under hybrid-draft);
- ``lazy``: stock lazy safetensors; it opens the same shards as stock InstantTensor, and
  copies out only the tensors the draft keeps. The rest are not copied, but vLLM's
  iterator still calls ``get_tensor`` on each, which maps it and faults in its first pages:
  the kernel reads up to about two readahead windows of every such tensor (measured with
  safetensors 0.8: 16 MiB of a 32 MiB tensor at 8 MiB readahead). ``touched_tensors``
  counts them; ``tensors`` and ``bytes`` count what the draft keeps;
- ``lazy_pruned``: lazy safetensors with the rule pruning shards (modes ``auto`` and
  ``safetensors`` under hybrid-draft);
- ``selective``: only the kept tensors, streamed by InstantTensor (mode ``selective``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybrid_draft import policy
from hybrid_draft.checkpoint import Shard

Rule = Callable[[str], bool]
MODES = ("instanttensor", "instanttensor_pruned", "lazy", "lazy_pruned", "selective")


@dataclass(frozen=True)
class Reads:
    shards: list[str]
    tensors: int
    nbytes: int
    #: Tensors the loader materialises at all (for lazy modes: every tensor it opens).
    touched_tensors: int

    def as_dict(self) -> dict[str, Any]:
        return {"shards": self.shards, "tensors": self.tensors, "bytes": self.nbytes,
                "touched_tensors": self.touched_tensors}


def prune(shards: list[Shard], is_unused: Rule | None) -> list[Shard]:
    """vLLM's ``filter_safetensors_files_by_weight_name``: drop all-unused shards (never all)."""
    if is_unused is None:
        return shards
    kept = [s for s in shards if not all(is_unused(t.name) for t in s.tensors)]
    return kept or shards


def _reads(shards: list[Shard], keep: Rule, touch_all: bool) -> Reads:
    tensors = [t for s in shards for t in s.tensors if keep(t.name)]
    touched = sum(len(s.tensors) for s in shards) if touch_all else len(tensors)
    return Reads([s.name for s in shards], len(tensors), sum(t.nbytes for t in tensors),
                 touched)


def _evaluated(shards: list[Shard], rule: Rule | None) -> Rule | None:
    """The rule as a set lookup: evaluated once per name, however many modes ask."""
    if rule is None:
        return None
    unused = {t.name for s in shards for t in s.tensors if rule(t.name)}
    return unused.__contains__


def modes(shards: list[Shard], is_unused: Rule | None, vllm_rule: Rule | None) -> dict[str, Reads]:
    """Reads per mode. ``is_unused``: the draft's effective rule (None: it has none);
    ``vllm_rule``: the rule stock vLLM applies (None unless the class ships one)."""
    same = vllm_rule is is_unused
    is_unused = _evaluated(shards, is_unused)
    vllm_rule = is_unused if same else _evaluated(shards, vllm_rule)

    def every(_name: str) -> bool:
        return True

    def kept(name: str) -> bool:
        return is_unused is None or not is_unused(name)

    stock = prune(shards, vllm_rule)
    pruned = prune(shards, is_unused)
    selective = ([s for s in shards if any(kept(t.name) for t in s.tensors)]
                 if is_unused is not None else [])
    return {
        "instanttensor": _reads(stock, every, True),
        "instanttensor_pruned": _reads(pruned, every, True),
        "lazy": _reads(stock, kept, True),
        "lazy_pruned": _reads(pruned, kept, True),
        "selective": _reads(selective, kept, False),
    }


def auto_decision() -> policy.Decision:
    """What mode ``auto`` decides for a same-checkpoint draft of an InstantTensor target."""
    same = policy.Checkpoint(model=".")
    request = policy.Request(role="draft", requested_format=policy.INSTANTTENSOR, method="mtp",
                             model=same, target=same)
    return policy.decide(request, "auto")


def report(model_dir: str, draft_class: str | None, rule_source: str, shards: list[Shard],
           reads: dict[str, Reads]) -> dict[str, Any]:
    """The JSON object of ``plan --json`` (CONTRACT.md)."""
    decision = auto_decision()
    return {
        "model_dir": model_dir,
        "draft_class": draft_class,
        "rule_source": rule_source,
        "checkpoint": {
            "shards": len(shards),
            "tensors": sum(len(s.tensors) for s in shards),
            "bytes": sum(s.nbytes for s in shards),
        },
        "auto": {"action": decision.action, "reason": decision.reason,
                 "chosen_format": decision.chosen_format},
        "modes": {name: r.as_dict() for name, r in reads.items()},
    }


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"


def table(result: dict[str, Any]) -> str:
    """The human rendering of :func:`report`."""
    ck = result["checkpoint"]
    auto = result["auto"]
    lines = [
        f"checkpoint   {result['model_dir']}: {ck['shards']} shards, {ck['tensors']:,} "
        f"tensors, {_gb(ck['bytes'])}",
        f"draft class  {result['draft_class'] or '(none: no MTP draft for this architecture)'}"
        f"  (weight rule: {result['rule_source']})",
        f"auto         {auto['action']} ({auto['reason']}) -> {auto['chosen_format']}",
        "",
        f"{'mode':<22}{'shards':>8}{'tensors':>10}{'bytes read':>16}{'of checkpoint':>15}"
        f"{'touched':>10}",
    ]
    for name, r in result["modes"].items():
        share = r["bytes"] / ck["bytes"] if ck["bytes"] else 0.0
        lines.append(f"{name:<22}{len(r['shards']):>8}{r['tensors']:>10,}"
                     f"{_gb(r['bytes']):>16}{share:>14.2%}{r['touched_tensors']:>10,}")
    lines.append("(lazy modes also read up to ~2 readahead windows of each touched tensor "
                 "they do not keep)")
    return "\n".join(lines)
