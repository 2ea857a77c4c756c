"""Checkpoint-weight rules for the MTP drafts whose vLLM class has none.

vLLM 0.33 drops the safetensors shards in which a draft wants nothing only when the draft
class defines ``is_unused_checkpoint_weight(name)``. Qwen3.5, Qwen3-Next, NemotronH and the
CUDA DeepSeek V3.2/V4 drafts do; the other MTP drafts (DeepSeek-V3, GLM, MiMo, Kimi, ...) do
not, so even lazy safetensors opens and walks every shard of a checkpoint hundreds of GB
large. Each rule here restates what one ``load_weights`` keeps, and the tests prove the two
sets equal on real vLLM. A rule is installed only on a class that lacks one, and only on a
class whose ``load_weights`` is the very function it was derived from.

The rules are data: a :class:`Keep` (which names a ``load_weights`` keeps) per function,
built from two shapes, numbered MTP layers (:class:`Layers`) and name filters. A rule that
keeps too little cannot pass silently: the shards it drops hold weights the model then
lacks, and vLLM's own "weights were not initialized" check fails the load. Where a
``load_weights`` also looks at things a name cannot tell (the parameters it built, the
number of speculative tokens), the rule keeps the superset: more reads, never a miss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Rule = Callable[[Any, str], bool]
_MARK = "__hybrid_draft_rule__"
ROTARY = ("rotary_emb.inv_freq",)
#: What vLLM's ``AutoWeightsLoader`` drops before it looks at a name.
AUTO = (
    "rotary_pos_emb.inv_freq",
    "rotary_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
)
#: Where vLLM's ``get_spec_layer_idx_from_weight_name`` looks for MTP layer ``N``.
SPEC_PREFIXES = ("model.layers.", "layers.", "model.language_model.layers.")


def _attr(config: Any, name: str, default: int = 0) -> int:
    value = getattr(config, name, None)
    return default if value is None else int(value)


@dataclass(frozen=True)
class Layers:
    """Numbered MTP layers: ``{prefix}{index}.``, ``count`` of them from ``first`` on.

    A numbered layer outside that span is unused: a target layer, or an MTP layer the
    draft does not build.
    ``first``/``count`` are config attributes (or a number, or a function of the config).
    ``drop``: sub-names ``load_weights`` skips inside these layers; ``later_drop``: skipped
    in all of them but the first (the shared embedding the DeepSeek family loads once).
    """

    prefixes: tuple[str, ...] = SPEC_PREFIXES
    first: str | int = "num_hidden_layers"
    count: str | int | Callable[[Any], int] = "num_nextn_predict_layers"
    drop: tuple[str, ...] = ()
    later_drop: tuple[str, ...] = ()

    def span(self, config: Any) -> tuple[int, int]:
        first = self.first if isinstance(self.first, int) else _attr(config, self.first)
        if callable(self.count):
            count = int(self.count(config))
        else:
            count = self.count if isinstance(self.count, int) else _attr(config, self.count)
        return first, count

    def index(self, name: str) -> tuple[int, str] | None:
        """The layer number and the rest of the name, for a name under one of the prefixes."""
        for prefix in self.prefixes:
            if name.startswith(prefix):
                number, dot, rest = name[len(prefix) :].partition(".")
                if dot and number.isdigit():
                    return int(number), rest
        return None


@dataclass(frozen=True)
class Keep:
    """What one ``load_weights`` keeps of a checkpoint; :meth:`is_unused` answers for a name.

    Applied in order: ``rename`` (prefix rewrites the loader applies first), ``drop``
    (sub-names it always skips), ``dropped_if`` (names skipped while a config flag is set:
    a tied LM head), ``layers`` (the MTP layers), then ``names`` (exact), ``prefixes``,
    ``contains`` and ``kept_if`` (a name kept only while a config flag is set).

    ``reads``: which config the class holds as ``self.config``: the target's (``target``,
    what ``vllm_config.model_config`` is when vLLM builds a draft) or the draft's own
    (``draft``, rewritten by ``SpeculativeConfig.hf_config_override``). ``text_config``:
    the class reads the text config inside it, and so does the rule.
    """

    doc: str
    layers: Layers | tuple[Layers, ...] | None = None
    names: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    contains: tuple[str, ...] = ()
    kept_if: tuple[tuple[str, str], ...] = ()
    dropped_if: tuple[tuple[str, str], ...] = ()
    rename: tuple[tuple[str, str], ...] = ()
    drop: tuple[str, ...] = ROTARY
    text_config: bool = False
    reads: str = "target"

    def is_unused(self, config: Any, name: str) -> bool:
        """Whether ``load_weights`` leaves the checkpoint tensor ``name`` unread."""
        try:
            return self._judge(_View(self, config), name)
        except Exception:  # a rule must never fail a load: keep what it cannot judge
            return False

    def bind(self, config: Any) -> Callable[[str], bool]:
        """:meth:`is_unused` for one config whose values are read once, not once per name: a
        plan asks for every tensor (92,000 on DeepSeek-V3), and a transformers config's
        attribute costs more than the rule itself."""
        try:
            view = _View(self, config)
        except Exception:
            return lambda name: self.is_unused(config, name)

        def is_unused(name: str) -> bool:
            try:
                return self._judge(view, name)
            except Exception:  # as is_unused: keep what it cannot judge
                return False

        return is_unused

    def _judge(self, view: _View, name: str) -> bool:
        for old, new in self.rename:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        if any(s in name for s in self.drop):
            return True
        if any(name == n and view.flag(flag) for n, flag in self.dropped_if):
            return True
        for layers in (self.layers,) if isinstance(self.layers, Layers) else self.layers or ():
            if (found := layers.index(name)) is None:
                continue
            number, rest = found
            first, count = view.span(layers)
            if not first <= number < first + count:
                return True  # a target layer, or an MTP layer the draft does not build
            if any(s in rest for s in layers.drop):
                return True
            return number != first and any(s in rest for s in layers.later_drop)
        if name in self.names or name.startswith(self.prefixes):
            return False
        if any(s in name for s in self.contains):
            return False
        return not any(name == n and view.flag(flag) for n, flag in self.kept_if)


class _View:
    """The config values one rule reads, each read the first time it is asked for (a value
    that cannot be read raises each time, as reading it directly would)."""

    def __init__(self, keep: Keep, config: Any) -> None:
        if keep.text_config:
            config = getattr(config, "text_config", None) or config
        self.config = config
        self._spans: dict[int, tuple[int, int]] = {}
        self._flags: dict[str, Any] = {}

    def span(self, layers: Layers) -> tuple[int, int]:
        key = id(layers)
        if key not in self._spans:
            self._spans[key] = layers.span(self.config)
        return self._spans[key]

    def flag(self, name: str) -> Any:
        if name not in self._flags:
            self._flags[name] = getattr(self.config, name, False)
        return self._flags[name]


def _hy_v4_mtp_layers(config: Any) -> int:
    """HY V4 exports one MTP head under num_nextn_predict_layers 1 or 2."""
    n = _attr(config, "num_nextn_predict_layers")
    return max(n - 1, 1) if n >= 1 else 0


# --- the rules, one per load_weights function (module, class that defines it) -------------

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
#: ``AutoWeightsLoader`` loads a tied LM head once, through the embedding.
TIED = ((HEAD, "tie_word_embeddings"),)
#: DeepSeek-V3's MTP layer N: the shared embedding is read from the first MTP layer only.
DEEPSEEK_LAYERS = Layers(later_drop=("embed_tokens",))

_M = "vllm.model_executor.models."
RULES: dict[tuple[str, str], Keep] = {
    (_M + "deepseek_mtp", "DeepSeekMTP"): Keep(
        "DeepSeek-V3 MTP layers, plus the target's top-level embedding",
        DEEPSEEK_LAYERS,
        names=(EMBED,),
    ),
    (_M + "glm4_moe_mtp", "Glm4MoeMTP"): Keep(
        "GLM-4.5 MTP layers, plus the embedding and the LM head",
        DEEPSEEK_LAYERS,
        names=(EMBED, HEAD),
    ),
    (_M + "glm4_moe_lite_mtp", "Glm4MoeLiteMTP"): Keep(
        "GLM-4.7-Flash MTP layers (their own embedding and head)", DEEPSEEK_LAYERS
    ),
    (_M + "mimo_mtp", "MiMoMTP"): Keep(
        "MiMo model.mtp_layers.*, the embedding and the LM head",
        contains=("mtp_layers", "embed_tokens", "lm_head"),
        drop=AUTO,
    ),
    (_M + "mimo_v2_mtp", "MiMoV2MTP"): Keep(
        "MiMo-V2 model.mtp.layers.* (the ones vLLM builds), the embedding and the LM head",
        Layers(("model.mtp.layers.",), first=0, count=1),
        contains=("model.embed_tokens",),
        prefixes=("lm_head",),
    ),
    (_M + "ernie_mtp", "ErnieMTP"): Keep(
        "ERNIE-4.5 model.mtp_* block, the embedding and the LM head",
        contains=("mtp", "embed_tokens", "lm_head"),
        drop=AUTO,
        dropped_if=TIED,
    ),
    (_M + "exaone_moe_mtp", "ExaoneMoeMTP"): Keep(
        "K-EXAONE mtp.* head, the embedding and the LM head",
        prefixes=("mtp.",),
        contains=("embed_tokens", "lm_head"),
        drop=AUTO,
        dropped_if=TIED,
    ),
    (_M + "longcat_flash_mtp", "LongCatFlashMTP"): Keep(
        "LongCat-Flash model.mtp.* (its own embedding included)", contains=("model.mtp",)
    ),
    (_M + "glm_ocr_mtp", "GlmOcrMTP"): Keep(
        "GLM-OCR MTP layers, plus a top-level embedding and the LM head",
        DEEPSEEK_LAYERS,
        names=(EMBED, HEAD),
        text_config=True,
    ),
    (_M + "openpangu_mtp", "OpenPanguMTP"): Keep(
        "openPangu MTP layers (their own embedding and head)", DEEPSEEK_LAYERS
    ),
    (_M + "exaone4_5_mtp", "Exaone4_5_MTP"): Keep(
        "EXAONE 4.5 mtp.* head, the embedding and the LM head",
        prefixes=("mtp.",),
        contains=("embed_tokens", "lm_head"),
        drop=AUTO,
        dropped_if=TIED,
    ),
    (_M + "nemotron_parse3_5_mtp", "ParseAuxMTPModel"): Keep(
        "Parse 3.5 decoder.extra_proj.0 / extra_heads.0 and the decoder embedding",
        names=("decoder.embed_tokens.weight",),
        prefixes=("decoder.extra_heads.0.", "decoder.extra_proj.0."),
        drop=AUTO,
    ),
    ("vllm.models.kimi_k3.nvidia.mtp", "KimiK3MTP"): Keep(
        "Kimi-K3 MTP layers but the attention-residual weights the draft block lacks",
        Layers(drop=("self_attention_res_", "mlp_res_"), later_drop=("embed_tokens",)),
        rename=(("language_model.", ""),),
        text_config=True,
    ),
    ("vllm.models.minimax_m3.nvidia.mtp", "MiniMaxM3MTP"): Keep(
        "MiniMax-M3 model.mtp.layers.* (num_mtp_modules), the embedding and the LM head",
        Layers(("model.mtp.layers.",), first=0, count="num_mtp_modules"),
        names=(EMBED, HEAD),
        rename=(("language_model.", ""),),
        reads="draft",
    ),
    ("vllm.models.glm5next.common.mtp", "Glm5NextMTP"): Keep(
        "GLM-5-Next MTP layers (model.language_model.* read as model.*)",
        DEEPSEEK_LAYERS,
        rename=(("model.language_model.", "model."),),
        text_config=True,
    ),
    ("vllm.models.hy_v4.nvidia.mtp", "HYV4MTP"): Keep(
        "HY V4 MTP layers (or model.mtp_layers.*) but their embedding and head copies, "
        "plus the target's embedding and LM head",
        (
            Layers(
                ("model.layers.",), count=_hy_v4_mtp_layers, drop=("embed_tokens", "shared_head")
            ),
            Layers(
                ("model.mtp_layers.",),
                first=0,
                count=_hy_v4_mtp_layers,
                drop=("embed_tokens", "shared_head"),
            ),
        ),
        names=(EMBED, HEAD),
        drop=(),
    ),
    ("vllm.models.qwen4_exp.nvidia.mtp", "Qwen4ExpMTP"): Keep(
        "Qwen4-Exp mtp.* (but the final mixer's block_inject_weight), embedding, LM head",
        prefixes=(
            "embed_tokens.",
            "model.mtp.",
            "mtp.",
            "model.shared_head.head.",
            "shared_head.head.",
            "model.lm_head.",
            "model.embed_tokens.",
            "lm_head.",
        ),
        rename=(("model.language_model.", ""), ("language_model.", "")),
        drop=(*AUTO, "hyper_connection_mixer.block_inject_weight"),
        dropped_if=TIED,
        text_config=True,
    ),
    ("vllm.models.inkling.nvidia.mtp", "InklingMTP"): Keep(
        "Inkling model.mtp.* (depth blocks up to num_nextn_predict_layers) and embed_norm",
        Layers(("model.mtp.layers.",), first=0),
        contains=(".mtp.",),
        kept_if=(("model.llm.embed_norm.weight", "use_embed_norm"),),
        drop=(),
        reads="draft",
    ),
    (_M + "step3p5_mtp", "Step3p5MTP"): Keep(
        "Step-3.5 MTP layers and any embed_tokens (read as the draft's embedding)",
        Layers(),
        contains=("embed_tokens",),
        drop=(*ROTARY, "tok_embeddings"),
    ),
    ("vllm.models.step5.nvidia.mtp", "Step5MTP"): Keep(
        "Step5 MTP layers and any embed_tokens (read as the draft's embedding)",
        Layers(),
        contains=("embed_tokens",),
        drop=(*ROTARY, "tok_embeddings"),
        reads="draft",
        text_config=True,
    ),
    (_M + "hy_v3_mtp", "HYV3MTP"): Keep(
        "HY-V3 MTP layers but their embedding and head copies, plus the target's two",
        Layers(drop=("embed_tokens", "shared_head")),
        names=(EMBED, HEAD),
        drop=(*ROTARY, "rotary_emb.cos_cached", "rotary_emb.sin_cached"),
    ),
    (_M + "bailing_moe_mtp", "BailingMoeV25MTPModel"): Keep(
        "Ling-2.5 MTP layers, the word embedding and the LM head",
        Layers(("model.layers.",)),
        names=("model.word_embeddings.weight", HEAD),
        reads="draft",
    ),
    (_M + "bailing_moe_v3_mtp", "BailingMoeV3MTPModel"): Keep(
        "Ling-3 MTP layers, the word embedding and the LM head",
        Layers(("model.layers.",)),
        names=("model.word_embeddings.weight", HEAD),
        reads="draft",
    ),
}


def deepseek_mtp_unused(config: Any, name: str) -> bool:
    """``DeepSeekMTP.load_weights``: MTP layers plus the target's top-level embedding."""
    return RULES[(_M + "deepseek_mtp", "DeepSeekMTP")].is_unused(config, name)


def glm4_moe_mtp_unused(config: Any, name: str) -> bool:
    """``Glm4MoeMTP.load_weights``: MTP layers plus the embedding and the LM head."""
    return RULES[(_M + "glm4_moe_mtp", "Glm4MoeMTP")].is_unused(config, name)


def loader_of(cls: type) -> type | None:
    """The class in ``cls``'s MRO that defines the ``load_weights`` it runs."""
    return next((k for k in cls.__mro__ if "load_weights" in vars(k)), None)


def rule_for(cls: type) -> Keep | None:
    """Our rule for ``cls``: the one derived from the ``load_weights`` it runs, if any."""
    owner = loader_of(cls)
    return RULES.get((owner.__module__, owner.__name__)) if owner is not None else None


def rule_source(cls: type) -> str:
    """``vllm`` (the class's own rule), ``hybrid-draft`` (one of ours) or ``none``."""
    own = getattr(cls, "is_unused_checkpoint_weight", None)
    if own is not None and not getattr(own, _MARK, False):
        return "vllm"
    return "hybrid-draft" if rule_for(cls) is not None else "none"


def install(cls: type) -> str:
    """Give ``cls`` our rule when it has none; return the rule's source afterwards."""
    source = rule_source(cls)
    own = vars(cls).get("is_unused_checkpoint_weight")
    if source != "hybrid-draft" or own is not None:
        return source
    rule = rule_for(cls)
    assert rule is not None
    derived_from = getattr(cls, "load_weights", None)

    def is_unused_checkpoint_weight(self: Any, name: str) -> bool:
        # A subclass that loads differently keeps every shard: never prune on a guess.
        if type(self).load_weights is not derived_from:
            return False
        return rule.is_unused(self.config, name)

    is_unused_checkpoint_weight.__doc__ = f"hybrid-draft rule: {rule.doc}"
    setattr(is_unused_checkpoint_weight, _MARK, (rule, derived_from))
    cls.is_unused_checkpoint_weight = is_unused_checkpoint_weight  # type: ignore[attr-defined]
    return source


def config_for(cls: type, target: Any, draft: Any) -> Any:
    """The config a built ``cls`` holds as ``self.config``: ``target`` is the target's HF
    config, ``draft`` the draft's (after ``hf_config_override``). vLLM builds most MTP
    drafts with the target's ``vllm_config.model_config``; a class without our rule gets
    the draft's, as before."""
    rule = rule_for(cls) if rule_source(cls) == "hybrid-draft" else None
    return target if rule is not None and rule.reads == "target" else draft


def probe_for(cls: type, target: Any, draft: Any) -> Callable[[str], bool] | None:
    """:func:`probe` with the config the built class would hold (see :func:`config_for`)."""
    return probe(cls, config_for(cls, target, draft))


def probe(cls: type, config: Any) -> Callable[[str], bool] | None:
    """The class's rule evaluated without building the model (None if it has none).

    Rules read only ``self.config`` (vLLM's and ours), so an instance that was never
    initialised, holding just the draft's config, answers exactly as the model would.
    """
    method = getattr(cls, "is_unused_checkpoint_weight", None)
    if method is None:
        return None
    ours = getattr(method, _MARK, None)
    if isinstance(ours, tuple) and getattr(cls, "load_weights", None) is ours[1]:
        keep: Keep = ours[0]
        return keep.bind(config)  # our rule, as the installed method answers, read once
    stub: Any = object.__new__(cls)
    object.__setattr__(stub, "config", config)
    return lambda name: bool(stub.is_unused_checkpoint_weight(name))
