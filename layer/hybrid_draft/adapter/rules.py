"""Checkpoint-weight rules for MTP drafts whose vLLM class has none.

vLLM 0.33 drops the safetensors shards in which a draft wants nothing only when the draft
class defines ``is_unused_checkpoint_weight(name)``. Qwen3.5, Qwen3-Next, NemotronH and the
DeepSeek V3.2/V4 drafts do; ``DeepSeekMTP`` (DeepSeek-V3/R1) and the GLM-4.x MoE MTP drafts
do not, so even lazy safetensors opens and walks every shard of a 600+ GB checkpoint. Each
rule here restates exactly what the class's ``load_weights`` keeps (tests prove the two
sets are equal on real vLLM), and is installed only on a class that lacks one.

A rule that keeps too little cannot pass silently: the shards it drops hold weights the
model then lacks, and vLLM's own "weights were not initialized" check fails the load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.model_executor.models.utils import get_spec_layer_idx_from_weight_name

Rule = Callable[[Any, str], bool]
_MARK = "__hybrid_draft_rule__"


def _spec_layer_rule(config: Any, name: str, top_level: tuple[str, ...]) -> bool:
    """Shared shape of the DeepSeek/GLM MTP ``load_weights``: True means the name is unused.

    Kept: the MTP layers' tensors, and ``top_level`` names the class loads outside them.
    Dropped: rotary caches, and the shared embedding of a second or later MTP layer
    (``load_weights`` loads the embedding from the first MTP layer only).
    """
    if "rotary_emb.inv_freq" in name:
        return True
    layer = get_spec_layer_idx_from_weight_name(config, name)
    if layer is None:
        return name not in top_level
    return layer != config.num_hidden_layers and "embed_tokens" in name


def deepseek_mtp_unused(config: Any, name: str) -> bool:
    """``DeepSeekMTP.load_weights``: MTP layers plus the target's top-level embedding."""
    return _spec_layer_rule(config, name, ("model.embed_tokens.weight",))


def glm4_moe_mtp_unused(config: Any, name: str) -> bool:
    """``Glm4MoeMTP.load_weights``: MTP layers plus the embedding and the LM head."""
    return _spec_layer_rule(config, name, ("model.embed_tokens.weight", "lm_head.weight"))


#: (module, class) -> the rule derived from that class's load_weights.
RULES: dict[tuple[str, str], Rule] = {
    ("vllm.model_executor.models.deepseek_mtp", "DeepSeekMTP"): deepseek_mtp_unused,
    ("vllm.model_executor.models.glm4_moe_mtp", "Glm4MoeMTP"): glm4_moe_mtp_unused,
}


def rule_source(cls: type) -> str:
    """``vllm`` (the class's own rule), ``hybrid-draft`` (one of ours) or ``none``."""
    own = getattr(cls, "is_unused_checkpoint_weight", None)
    if own is not None and not getattr(own, _MARK, False):
        return "vllm"
    if own is not None or (cls.__module__, cls.__name__) in RULES:
        return "hybrid-draft"
    return "none"


def install(cls: type) -> str:
    """Give ``cls`` our rule when it has none; return the rule's source afterwards."""
    source = rule_source(cls)
    if source != "hybrid-draft" or getattr(cls, "is_unused_checkpoint_weight", None):
        return source
    rule = RULES[(cls.__module__, cls.__name__)]
    derived_from = cls.load_weights

    def is_unused_checkpoint_weight(self: Any, name: str) -> bool:
        # A subclass that loads differently keeps every shard: never prune on a guess.
        if type(self).load_weights is not derived_from:
            return False
        return rule(self.config, name)

    is_unused_checkpoint_weight.__doc__ = f"hybrid-draft rule: {rule.__doc__}"
    setattr(is_unused_checkpoint_weight, _MARK, True)
    cls.is_unused_checkpoint_weight = is_unused_checkpoint_weight  # type: ignore[attr-defined]
    return source


def probe(cls: type, config: Any) -> Callable[[str], bool] | None:
    """The class's rule evaluated without building the model (None if it has none).

    Rules read only ``self.config`` (vLLM's and ours), so an instance that was never
    initialised, holding just the draft's config, answers exactly as the model would.
    """
    if getattr(cls, "is_unused_checkpoint_weight", None) is None:
        return None
    stub = object.__new__(cls)
    object.__setattr__(stub, "config", config)
    return lambda name: bool(stub.is_unused_checkpoint_weight(name))
