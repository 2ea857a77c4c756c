"""Which MTP draft class vLLM builds for a checkpoint, and its weight rule, without loading it.

Follows vLLM's own path: the checkpoint's config through ``get_config``, rewritten by
``SpeculativeConfig.hf_config_override`` (what ``method: mtp`` does), then the draft
architecture through the model registry. No ``ModelConfig`` is built (that inspects the
model class in a subprocess), so ``hybrid-draft plan`` stays well under a second.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

from hybrid_draft.adapter import rules


@dataclass(frozen=True)
class Draft:
    draft_class: str | None
    rule_source: str
    #: The draft's effective rule under hybrid-draft (None: it has none).
    is_unused: Callable[[str], bool] | None
    #: The rule stock vLLM applies (only when the class ships one).
    vllm_rule: Callable[[str], bool] | None


def mtp_draft(model_dir: str) -> Draft:
    from vllm.config.speculative import SpeculativeConfig
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.config import get_config

    config = get_config(model_dir, trust_remote_code=False)
    before = list(getattr(config, "architectures", None) or [])
    target = copy.deepcopy(config)  # the override rewrites the config in place
    config = SpeculativeConfig.hf_config_override(config)
    after = list(getattr(config, "architectures", None) or [])
    if not after or after == before:
        return Draft(None, "none", None, None)
    cls = ModelRegistry._try_load_model_cls(after[0])
    if cls is None:
        return Draft(after[0], "none", None, None)
    source = rules.rule_source(cls)
    if source == "vllm":
        rule = rules.probe(cls, config)
        return Draft(cls.__name__, source, rule, rule)
    if source == "hybrid-draft":
        ours = rules.rule_for(cls)
        assert ours is not None
        return Draft(cls.__name__, source,
                     functools.partial(ours, rules.config_for(cls, target, config)), None)
    return Draft(cls.__name__, source, None, None)



#: Drafts with MTP in their name that load a checkpoint of their own, and what it is.
OWN_CHECKPOINT = {
    "Gemma4MTPModel": "method mtp, but Gemma 4's assistant checkpoint of its own: every "
                      "tensor there is the draft's, loaded whole",
    "EagleDeepSeekMTPModel": "an EAGLE head in DeepSeek-MTP form, with a checkpoint of its "
                             "own, loaded whole",
}


def is_mtp(architecture: str) -> bool:
    """An MTP draft: one read from the target's own checkpoint."""
    return "MTP" in architecture and architecture not in OWN_CHECKPOINT


def draft_classes(mtp_only: bool = False) -> list[dict[str, str]]:
    """Every speculative draft architecture the installed vLLM registers (or only the MTP
    ones: half the imports), its class, its kind, and whose checkpoint-weight rule prunes
    it (vLLM's, ours, none), with why.

    A class that fails to import here (a CUDA-only module on a CPU host) is listed with
    the error, not raised.
    """
    import importlib

    from vllm.model_executor.models.registry import (
        _SPECULATIVE_DECODING_MODELS,
        ModelRegistry,
    )

    out = []
    for arch in _SPECULATIVE_DECODING_MODELS:
        registered = ModelRegistry.models.get(arch)
        module = getattr(registered, "module_name", "?")
        name = getattr(registered, "class_name", "?")
        kind = "mtp" if is_mtp(arch) else "standalone"
        if mtp_only and kind != "mtp":
            continue
        row = {"architecture": arch, "class": name, "kind": kind, "rule": "none"}
        try:
            cls = getattr(importlib.import_module(module), name)
        except Exception as exc:  # a CUDA-only module: say so, list the rest
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            ours = [k for k in rules.RULES if k[1] == name and k[0].startswith(module)]
            row["detail"] = (f"{module} does not import here ({type(exc).__name__}: "
                             f"{reason[:120]})"
                             + ("; hybrid-draft has a rule for it where it imports"
                                if ours else ""))
            out.append(row)
            continue
        row["class"] = cls.__name__
        row["rule"] = rules.rule_source(cls)
        row["detail"] = _detail(cls, arch, kind, row["rule"])
        out.append(row)
    return out


def _detail(cls: type, arch: str, kind: str, source: str) -> str:
    where = f"{cls.__module__}.{cls.__name__}"
    if source == "vllm":
        owner = next(k for k in cls.__mro__ if "is_unused_checkpoint_weight" in vars(k))
        inherited = "" if owner is cls else f", inherited from {owner.__name__}"
        return f"vLLM's own is_unused_checkpoint_weight ({where}{inherited})"
    if source == "hybrid-draft":
        rule = rules.rule_for(cls)
        assert rule is not None
        loader = rules.loader_of(cls)
        shared = "" if loader is cls else f"; {loader.__name__}.load_weights, shared"
        return f"{rule.doc} ({where}{shared})"
    if kind == "standalone":
        return f"{OWN_CHECKPOINT.get(arch, 'a checkpoint of its own, loaded whole')} ({where})"
    if rules.loader_of(cls) is None:
        return f"no load_weights on this platform: vLLM's stub ({where})"
    return f"no rule for its load_weights ({where})"


def rules_summary(classes: list[dict[str, str]]) -> str:
    """One line: how many of the MTP draft classes prune their checkpoint, and by whose rule."""
    mtp = [c for c in classes if c["kind"] == "mtp"]
    pruned = [c for c in mtp if c["rule"] != "none"]
    by = {source: sum(c["rule"] == source for c in pruned) for source in ("vllm",
                                                                          "hybrid-draft")}
    line = (f"{len(pruned)} of {len(mtp)} MTP draft classes prune their checkpoint "
            f"({by['vllm']} vLLM, {by['hybrid-draft']} hybrid-draft)")
    rest = [c["class"] for c in mtp if c["rule"] == "none"]
    return line + (f"; not: {', '.join(rest)}" if rest else "")
