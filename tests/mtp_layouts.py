"""Tiny checkpoints in the tensor names of real MTP model families, for the rule proofs.

A family is data: a ``config.json`` shrunk to tiny dimensions, and its tensor names as
templates with shapes written in those dimensions. The names come from each family's
public checkpoint (its ``model.safetensors.index.json`` or a published weight list), or,
where no checkpoint is public, from the names vLLM's own loader reads; ``source`` says
which. Only the dimensions are shrunk: every name the draft's ``load_weights`` sees is one
a real export holds, next to target-layer names it must leave alone.

Templates: ``{i}`` a target layer (its position in ``layers``), ``{n}`` an MTP layer
(``mtp_layers``, default: the first MTP layer index), ``{e}`` a routed expert (``E`` of
them). A shape is ``"V,H"``-style expressions over ``dims``, optionally ``":F32"``-suffixed
for its dtype. Where the CPU cannot build a class as configured (no CUDA stream, no Triton,
no sparse-attention or swigluoai MoE kernel), ``cuda_standins`` names what stands in for
that piece while it is built; the class and its load_weights run unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybrid_draft.tools import synth


@dataclass(frozen=True)
class Family:
    draft: str  # the vLLM draft class the checkpoint resolves to
    source: str  # where the tensor names come from
    config: dict[str, Any]
    dims: dict[str, int]
    top: dict[str, str]  # names outside any layer
    layers: tuple[dict[str, str], ...]  # target layers 0, 1, ... ({i})
    mtp: dict[str, str]  # one MTP layer, {n}
    mtp_layers: tuple[int, ...] | None = None
    speculative: dict[str, Any] = field(default_factory=dict)
    #: Further files the checkpoint ships (a remote-code config), and engine arguments.
    files: dict[str, str] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    #: How the proof runs its load_weights (docs/rules.md says why): "engine"
    #: (vLLM's EngineArgs and load_eagle_model) or "direct" (the class built from this config,
    #: "plain" or as the config class vLLM registers for its model_type).
    route: str = "engine"
    direct_config: str = "plain"
    #: The class imports Triton kernels while it is built: provable only where Triton is.
    needs_triton: bool = False
    #: CUDA-only things the class needs while it is built, stood in for on the CPU (by
    #: name, see ``STANDINS``); its forward uses them, its load_weights does not.
    cuda_standins: tuple[str, ...] = ()

    def first_mtp(self) -> int:
        text = self.config.get("text_config", self.config)
        return int(text.get("num_hidden_layers", 0))


def _no_cuda_stream(real: Any) -> Any:
    return type("NoCudaStream", (), {"__init__": lambda self, *a, **k: None})


def _moe_kernel_as_silu(real: Any) -> Any:
    """The CPU has no swigluoai MoE kernel: pick the kernel as for silu (CUDA has both)."""
    import dataclasses

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    return lambda moe_config: real(
        moe_config=dataclasses.replace(moe_config, activation=MoEActivation.SILU)
    )


def _sparse_attention_as_dense(real: Any) -> Any:
    """The CPU has no sparse-attention backend: pick the dense one (CUDA has both)."""

    def pick(selected_backend: Any, attn_selector_config: Any, num_heads: Any = None) -> Any:
        config = attn_selector_config._replace(use_sparse=False)
        return real(selected_backend, attn_selector_config=config, num_heads=num_heads)

    return classmethod(lambda cls, *a, **k: pick(*a, **k))


#: name -> (object path, attribute, factory of the stand-in given the real one).
STANDINS = {
    "sparse_attention_as_dense": (
        "vllm.platforms.cpu:CpuPlatform",
        "get_attn_backend_cls",
        _sparse_attention_as_dense,
    ),
    "cuda_stream": ("torch.cuda", "Stream", _no_cuda_stream),
    "moe_kernel_as_silu": (
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
        "select_unquantized_moe_backend",
        _moe_kernel_as_silu,
    ),
}


def _shape(expr: str, dims: dict[str, int]) -> tuple[tuple[int, ...], str]:
    expr, _, dtype = expr.partition(":")
    shape = tuple(int(eval(part, {}, dict(dims))) for part in expr.split(",") if part)
    return shape, dtype or "BF16"


def _expand(templates: dict[str, str], dims: dict[str, int], **fmt: Any) -> list[synth.Tensor]:
    out: list[synth.Tensor] = []
    for template, expr in templates.items():
        experts = range(dims["E"]) if "{e}" in template else [None]
        for e in experts:
            shape, dtype = _shape(expr, dims)
            out.append(synth.Tensor(template.format(e=e, **fmt), shape, dtype))
    return out


def layout(f: Family) -> synth.Layout:
    """The family's checkpoint: top-level tensors, target layers, then the MTP layers."""
    tensors = _expand(f.top, f.dims)
    for i, block in enumerate(f.layers):
        tensors += _expand(block, f.dims, i=i)
    mtp: list[synth.Tensor] = []
    for n in f.mtp_layers if f.mtp_layers is not None else (f.first_mtp(),):
        mtp += _expand(f.mtp, f.dims, n=n)
    names = [t.name for t in tensors + mtp]
    dupes = {n for n in names if names.count(n) > 1}
    assert not dupes, f"{f.draft}: duplicate names {sorted(dupes)[:3]}"
    return synth.Layout(f.config, tensors + mtp, frozenset(t.name for t in mtp))


# --- building blocks: the name patterns families share ------------------------------------


def prefixed(prefix: str, block: dict[str, str]) -> dict[str, str]:
    return {prefix + k: v for k, v in block.items()}


#: DeepSeek-V3-style multi-head latent attention (shapes in Q/KV ranks and head dims).
MLA = {
    "self_attn.q_a_proj.weight": "QR,H",
    "self_attn.q_a_layernorm.weight": "QR",
    "self_attn.q_b_proj.weight": "NH*(DN+DR),QR",
    "self_attn.kv_a_proj_with_mqa.weight": "KR+DR,H",
    "self_attn.kv_a_layernorm.weight": "KR",
    "self_attn.kv_b_proj.weight": "NH*(DN+DV),KR",
    "self_attn.o_proj.weight": "H,NH*DV",
}
#: Grouped-query attention.
GQA = {
    "self_attn.q_proj.weight": "NH*HD,H",
    "self_attn.k_proj.weight": "NKV*HD,H",
    "self_attn.v_proj.weight": "NKV*HD,H",
    "self_attn.o_proj.weight": "H,NH*HD",
}
GQA_BIAS = {
    "self_attn.q_proj.bias": "NH*HD",
    "self_attn.k_proj.bias": "NKV*HD",
    "self_attn.v_proj.bias": "NKV*HD",
}
NORMS = {"input_layernorm.weight": "H", "post_attention_layernorm.weight": "H"}
DENSE = {"mlp.gate_proj.weight": "I,H", "mlp.up_proj.weight": "I,H", "mlp.down_proj.weight": "H,I"}
#: Routed experts one tensor each, a router with a score-correction bias, a shared expert.
MOE = {
    "mlp.gate.weight": "E,H",
    "mlp.gate.e_score_correction_bias": "E:F32",
    "mlp.experts.{e}.gate_proj.weight": "MI,H",
    "mlp.experts.{e}.up_proj.weight": "MI,H",
    "mlp.experts.{e}.down_proj.weight": "H,MI",
    "mlp.shared_experts.gate_proj.weight": "MI,H",
    "mlp.shared_experts.up_proj.weight": "MI,H",
    "mlp.shared_experts.down_proj.weight": "H,MI",
}
#: DeepSeek-V3's MTP layer head: input norms, projection, shared head (own embedding/head).
NEXTN = {
    "enorm.weight": "H",
    "hnorm.weight": "H",
    "eh_proj.weight": "H,2*H",
    "shared_head.norm.weight": "H",
}
NEXTN_OWN = {"embed_tokens.weight": "V,H", "shared_head.head.weight": "V,H"}
TOP = {"model.embed_tokens.weight": "V,H", "model.norm.weight": "H", "lm_head.weight": "V,H"}

MLA_DIMS = dict(V=512, H=64, I=128, MI=32, E=4, NH=4, QR=32, KR=32, DN=16, DR=16, DV=16)
MLA_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.8,
    topk_method="noaux_tc",
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    bos_token_id=0,
    eos_token_id=1,
)


def _l(block: dict[str, str]) -> dict[str, str]:
    return prefixed("model.layers.{i}.", block)


def _n(block: dict[str, str]) -> dict[str, str]:
    return prefixed("model.layers.{n}.", block)


FAMILIES: dict[str, Family] = {}


def family(name: str, f: Family) -> Family:
    FAMILIES[name] = f
    return f


# GLM-4.7-Flash: DeepSeek-V3's layout (MLA, MoE from layer 1, an MTP layer 47 with its own
# embedding and head). Names and config: zai-org/GLM-4.7-Flash config.json and its weight
# list (48 shards, 9,703 tensors), as published in a public model report.
family(
    "glm4_moe_lite",
    Family(
        "Glm4MoeLiteMTP",
        "zai-org/GLM-4.7-Flash config.json + weight list",
        config=dict(
            MLA_CONFIG,
            architectures=["Glm4MoeLiteForCausalLM"],
            model_type="glm4_moe_lite",
            num_hidden_layers=2,
            num_nextn_predict_layers=1,
            partial_rotary_factor=1.0,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        dims=MLA_DIMS,
        top=TOP,
        layers=(_l({**NORMS, **MLA, **DENSE}), _l({**NORMS, **MLA, **MOE})),
        mtp=_n({**NEXTN, **NEXTN_OWN, **NORMS, **MLA, **MOE}),
    ),
)

# MiMo-7B: Qwen2 attention with biases; its MTP layer lives under model.mtp_layers.0. Names
# and config: XiaomiMiMo/MiMo-7B (copy in jj8127/mimo_kor: config.json,
# model.safetensors.index.json). The config's model_type "mimo" needs the checkpoint's own
# code; its fields are Qwen2's plus num_nextn_predict_layers, so it is read as qwen2.
_QWEN2 = dict(V=512, H=64, I=128, NH=4, NKV=2, HD=16)
family(
    "mimo",
    Family(
        "MiMoMTP",
        "XiaomiMiMo/MiMo-7B via jj8127/mimo_kor config.json + index",
        config=dict(
            architectures=["MiMoForCausalLM"],
            model_type="qwen2",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            rope_theta=640000,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
            hidden_act="silu",
            use_sliding_window=False,
            max_window_layers=2,
            attention_bias=True,
            num_nextn_predict_layers=1,
            bos_token_id=0,
            eos_token_id=1,
        ),
        dims=_QWEN2,
        top=TOP,
        layers=(_l({**NORMS, **GQA, **GQA_BIAS, **DENSE}),) * 2,
        mtp=prefixed(
            "model.mtp_layers.0.",
            {
                **NORMS,
                **GQA,
                **GQA_BIAS,
                **DENSE,
                "final_layernorm.weight": "H",
                "hidden_layernorm.weight": "H",
                "token_layernorm.weight": "H",
                "input_proj.weight": "H,2*H",
            },
        ),
        mtp_layers=(0,),
    ),
)


# MiMo-V2-Flash: three MTP blocks under model.mtp.layers.{0,1,2} (vLLM builds the first),
# sliding-window attention with a sink bias in them. Config: XiaomiMiMo/MiMo-V2-Flash's
# fields (as a public fixture restates them); MTP names: the checkpoint's model.mtp.layers.*
# (its public quantisation ignore-lists name them), shrunk.
_MIMO_V2 = dict(V=512, H=64, I=128, MI=32, E=4, NH=4, NKV=2, HD=16, DV=8)
_MIMO_V2_ATTN = {
    "self_attn.q_proj.weight": "NH*HD,H",
    "self_attn.k_proj.weight": "NKV*HD,H",
    "self_attn.v_proj.weight": "NKV*DV,H",
    "self_attn.o_proj.weight": "H,NH*DV",
    "self_attn.attention_sink_bias": "NH:F32",
}
family(
    "mimo_v2",
    Family(
        "MiMoV2MTP",
        "MiMo-V2-Flash config (public fixture), names (public ignore-lists, vLLM)",
        config=dict(
            architectures=["MiMoV2FlashForCausalLM"],
            model_type="mimo_v2_flash",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            v_head_dim=8,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=16,
            swa_v_head_dim=8,
            rope_theta=5000000,
            swa_rope_theta=10000,
            partial_rotary_factor=0.334,
            attention_value_scale=0.707,
            layernorm_epsilon=1e-5,
            rms_norm_eps=1e-5,
            hybrid_layer_pattern=[0, 1],
            moe_layer_freq=[0, 1],
            sliding_window=128,
            sliding_window_size=128,
            attention_chunk_size=128,
            add_swa_attention_sink_bias=True,
            add_full_attention_sink_bias=False,
            attention_bias=False,
            n_routed_experts=4,
            moe_intermediate_size=32,
            num_experts_per_tok=2,
            scoring_func="sigmoid",
            n_shared_experts=None,
            n_group=1,
            topk_group=1,
            topk_method="noaux_tc",
            norm_topk_prob=True,
            routed_scaling_factor=None,
            num_nextn_predict_layers=3,
            hidden_act="silu",
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
            bos_token_id=0,
            eos_token_id=1,
        ),
        dims=_MIMO_V2,
        top=TOP,
        layers=(
            _l({**NORMS, **_MIMO_V2_ATTN, **DENSE}),
            _l({**NORMS, **_MIMO_V2_ATTN, **{k: v for k, v in MOE.items() if "shared" not in k}}),
        ),
        mtp=prefixed(
            "model.mtp.layers.{n}.",
            {
                "enorm.weight": "H",
                "hnorm.weight": "H",
                "eh_proj.weight": "H,2*H",
                "input_layernorm.weight": "H",
                **_MIMO_V2_ATTN,
                "pre_mlp_layernorm.weight": "H",
                **DENSE,
                "final_layernorm.weight": "H",
            },
        ),
        mtp_layers=(0, 1, 2),
    ),
)


_GQA_DIMS = dict(V=512, H=64, I=128, MI=32, E=4, NH=4, NKV=2, HD=16)
QK_NORM = {"self_attn.q_norm.weight": "HD", "self_attn.k_norm.weight": "HD"}
_EXPERTS = {k: v for k, v in MOE.items() if ".experts." in k}

# ERNIE-4.5-21B-A3B: a flat model.mtp_* block (emb/hidden norms, linear projection, a dense
# decoder block). Names: baidu/ERNIE-4.5-21B-A3B-PT's 12 MTP keys, as a public test quotes
# its index, and vLLM's ErnieMTP mapper; shrunk.
family(
    "ernie",
    Family(
        "ErnieMTP",
        "ERNIE-4.5-21B-A3B-PT MTP keys (as a public test quotes its index) + vLLM mapper",
        config=dict(
            architectures=["Ernie4_5_MoeForCausalLM"],
            model_type="ernie4_5_moe",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            hidden_act="silu",
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            use_bias=False,
            moe_intermediate_size=32,
            moe_k=2,
            moe_num_experts=4,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=1,
            moe_layer_interval=1,
            num_nextn_predict_layers=1,
            rope_theta=500000.0,
            torch_dtype="bfloat16",
            bos_token_id=0,
            eos_token_id=1,
        ),
        dims=_GQA_DIMS,
        top=TOP,
        layers=(
            _l({**NORMS, **GQA, **DENSE}),
            _l(
                {
                    **NORMS,
                    **GQA,
                    **_EXPERTS,
                    "mlp.gate.weight": "E,H",
                    "mlp.moe_statics.e_score_correction_bias": "1,E:F32",
                    "mlp.shared_experts.gate_proj.weight": "MI,H",
                    "mlp.shared_experts.up_proj.weight": "MI,H",
                    "mlp.shared_experts.down_proj.weight": "H,MI",
                }
            ),
        ),
        mtp={
            "model.mtp_emb_norm.0.weight": "H",
            "model.mtp_hidden_norm.0.weight": "H",
            "model.mtp_linear_proj.0.weight": "H,2*H",
            **prefixed("model.mtp_block.0.", {**NORMS, **GQA, **DENSE}),
        },
    ),
)

# K-EXAONE (ExaoneMoe): a Qwen3-Next-style mtp.* head (fc, two input norms, layers, norm).
# Config: transformers' ExaoneMoeConfig fields; names: the mtp.* keys vLLM's ExaoneMoeMTP
# loads (no public index was found).
family(
    "exaone_moe",
    Family(
        "ExaoneMoeMTP",
        "vLLM's ExaoneMoeMTP loader (mtp.* keys; no public index found)",
        config=dict(
            architectures=["ExaoneMoeForCausalLM"],
            model_type="exaone_moe",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            hidden_act="silu",
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            sliding_window=128,
            sliding_window_pattern=4,
            layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            n_group=1,
            topk_group=1,
            num_nextn_predict_layers=1,
            rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
            torch_dtype="bfloat16",
            bos_token_id=0,
            eos_token_id=1,
        ),
        dims=_GQA_DIMS,
        top=TOP,
        layers=(_l({**NORMS, **GQA, **QK_NORM, **DENSE}), _l({**NORMS, **GQA, **QK_NORM, **MOE})),
        mtp={
            "mtp.fc.weight": "H,2*H",
            "mtp.pre_fc_norm_embedding.weight": "H",
            "mtp.pre_fc_norm_hidden.weight": "H",
            "mtp.norm.weight": "H",
            **prefixed("mtp.layers.0.", {**NORMS, **GQA, **QK_NORM, **DENSE}),
        },
    ),
)

# LongCat-Flash: the MTP head under model.mtp.* in its own naming (enorm.m, hnorm.m,
# transformer_layer.mlp, its own embedding). Names: the meituan-longcat/LongCat-Flash-Chat
# keys vLLM's LongCatFlashMTP maps one by one (the same list appears in public ports).
family(
    "longcat",
    Family(
        "LongCatFlashMTP",
        "LongCat-Flash checkpoint keys vLLM's LongCatFlashMTP maps one by one",
        config=dict(
            architectures=["LongcatFlashForCausalLM"],
            model_type="longcat_flash",
            vocab_size=512,
            hidden_size=64,
            num_layers=1,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            hidden_act="silu",
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            ffn_hidden_size=128,
            intermediate_size=128,
            moe_intermediate_size=32,
            mla_scale_q_lora=True,
            mla_scale_kv_lora=True,
            zero_expert_type="identity",
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
            moe_topk=2,
            n_routed_experts=4,
            zero_expert_num=2,
            expert_ffn_hidden_size=32,
            routed_scaling_factor=6.0,
            num_nextn_predict_layers=1,
            torch_dtype="bfloat16",
            rope_parameters={"rope_theta": 10000000.0, "rope_type": "default"},
            bos_token_id=0,
            eos_token_id=1,
        ),
        dims=dict(MLA_DIMS, I=128),
        top=TOP,
        layers=(
            _l(
                {
                    **prefixed("self_attn.0.", {k[10:]: v for k, v in MLA.items()}),
                    **prefixed("self_attn.1.", {k[10:]: v for k, v in MLA.items()}),
                    "input_layernorm.0.weight": "H",
                    "input_layernorm.1.weight": "H",
                    "post_attention_layernorm.0.weight": "H",
                    "post_attention_layernorm.1.weight": "H",
                    "mlp.router.classifier.weight": "E+2,H",
                    "mlp.router.e_score_correction_bias": "E+2:F32",
                    "mlp.experts.{e}.gate_proj.weight": "MI,H",
                    "mlp.experts.{e}.up_proj.weight": "MI,H",
                    "mlp.experts.{e}.down_proj.weight": "H,MI",
                    "mlps.0.gate_proj.weight": "I,H",
                    "mlps.0.up_proj.weight": "I,H",
                    "mlps.0.down_proj.weight": "H,I",
                }
            ),
        ),
        mtp={
            "model.mtp.embed_tokens.weight": "V,H",
            "model.mtp.norm.weight": "H",
            **prefixed(
                "model.mtp.layers.0.",
                {
                    "eh_proj.weight": "H,2*H",
                    "enorm.m.weight": "H",
                    "hnorm.m.weight": "H",
                    **NORMS,
                    **MLA,
                    "transformer_layer.mlp.gate_proj.weight": "I,H",
                    "transformer_layer.mlp.up_proj.weight": "I,H",
                    "transformer_layer.mlp.down_proj.weight": "H,I",
                },
            ),
        },
    ),
)


# GLM-OCR: GLM-4V naming (model.language_model.*), an MTP layer 16 with its own embedding
# and head copies. Names: zai-org/GLM-OCR's weight list (as a public port documents it).
_GLM_OCR_LAYER = {
    **NORMS,
    "post_self_attn_layernorm.weight": "H",
    "post_mlp_layernorm.weight": "H",
    **GQA,
    "mlp.gate_up_proj.weight": "2*I,H",
    "mlp.down_proj.weight": "H,I",
}
family(
    "glm_ocr",
    Family(
        "GlmOcrMTP",
        "zai-org/GLM-OCR weight list (model.language_model.layers.16.*)",
        config=dict(
            architectures=["GlmOcrForConditionalGeneration"],
            model_type="glm_ocr",
            num_nextn_predict_layers=1,
            tie_word_embeddings=False,
            text_config=dict(
                model_type="glm_ocr_text",
                vocab_size=512,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                rms_norm_eps=1e-5,
                max_position_embeddings=4096,
                num_nextn_predict_layers=1,
                hidden_act="silu",
                attention_bias=False,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [1, 1, 2],
                    "partial_rotary_factor": 0.5,
                },
            ),
            vision_config=dict(
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                patch_size=14,
                spatial_merge_size=2,
                temporal_patch_size=2,
            ),
            torch_dtype="bfloat16",
            bos_token_id=0,
            eos_token_id=1,
        ),
        dims=_GQA_DIMS,
        top={
            "model.language_model.embed_tokens.weight": "V,H",
            "model.language_model.norm.weight": "H",
            "lm_head.weight": "V,H",
            "model.visual.patch_embed.proj.weight": "32,3,2,14,14",
        },
        layers=(prefixed("model.language_model.layers.{i}.", _GLM_OCR_LAYER),) * 2,
        mtp=prefixed("model.language_model.layers.{n}.", {**_GLM_OCR_LAYER, **NEXTN, **NEXTN_OWN}),
    ),
)

# openPangu-Ultra-MoE: DeepSeek-V3's MTP layout with sandwich norms. Its config is read by
# the configuration file the checkpoint ships (model_type pangu_ultra_moe), as here.
# Names: DeepSeek-V3's plus the sandwich norms vLLM's OpenPangu builds (no index found).
_PANGU_CONFIG = """from transformers import PretrainedConfig


class PanguUltraMoEConfig(PretrainedConfig):
    model_type = "pangu_ultra_moe"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
"""
_PANGU_LAYER = {**NORMS, "pre_mlp_layernorm.weight": "H", "post_mlp_layernorm.weight": "H", **MLA}
family(
    "openpangu",
    Family(
        "OpenPanguMTP",
        "DeepSeek-V3 layout + vLLM's OpenPangu sandwich norms (no index)",
        config=dict(
            MLA_CONFIG,
            architectures=["PanguUltraMoEForCausalLM"],
            model_type="pangu_ultra_moe",
            num_hidden_layers=2,
            num_nextn_predict_layers=1,
            sandwich_norm=True,
            router_enable_expert_bias=True,
            rope_theta=25600000,
            attention_bias=False,
            auto_map={"AutoConfig": "configuration_openpangu_moe.PanguUltraMoEConfig"},
        ),
        dims=MLA_DIMS,
        top=TOP,
        layers=(_l({**_PANGU_LAYER, **DENSE}), _l({**_PANGU_LAYER, **MOE})),
        mtp=_n({**NEXTN, **NEXTN_OWN, **_PANGU_LAYER, **MOE}),
        files={"configuration_openpangu_moe.py": _PANGU_CONFIG},
        engine={"trust_remote_code": True},
    ),
)


# HY-V3 (Tencent Hunyuan V3): GQA with q/k norms and MoE (router.gate, expert_bias,
# shared_mlp); its MTP layer N holds enorm/hnorm/eh_proj/final_layernorm and a head copy
# (shared_head.weight) the loader skips for the target's lm_head. No public index was
# found: the names are the ones vLLM's HYV3MTP loader reads, as its comments describe the
# checkpoint.
_HY_LAYER = {**NORMS, **GQA, **QK_NORM}
_HY_MOE = {
    "mlp.router.gate.weight": "E,H",
    "mlp.expert_bias": "E:F32",
    "mlp.experts.{e}.gate_proj.weight": "MI,H",
    "mlp.experts.{e}.up_proj.weight": "MI,H",
    "mlp.experts.{e}.down_proj.weight": "H,MI",
    "mlp.shared_mlp.gate_proj.weight": "MI,H",
    "mlp.shared_mlp.up_proj.weight": "MI,H",
    "mlp.shared_mlp.down_proj.weight": "H,MI",
}
family(
    "hy_v3",
    Family(
        "HYV3MTP",
        "vLLM's HYV3MTP loader (no public HY-V3 index found)",
        config=dict(
            architectures=["HYV3ForCausalLM"],
            model_type="hy_v3",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            qk_norm=True,
            route_norm=True,
            hidden_act="silu",
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            moe_intermediate_size=32,
            expert_hidden_dim=32,
            router_scaling_factor=2.826,
            first_k_dense_replace=1,
            num_nextn_predict_layers=1,
            torch_dtype="bfloat16",
            rope_parameters={"rope_theta": 11158840.0, "rope_type": "default"},
            bos_token_id=0,
            eos_token_id=1,
        ),
        dims=_GQA_DIMS,
        top=TOP,
        layers=(_l({**_HY_LAYER, **DENSE}), _l({**_HY_LAYER, **_HY_MOE})),
        mtp=_n(
            {
                "enorm.weight": "H",
                "hnorm.weight": "H",
                "eh_proj.weight": "H,2*H",
                "final_layernorm.weight": "H",
                "shared_head.weight": "V,H",
                **_HY_LAYER,
                **_HY_MOE,
            }
        ),
    ),
)

# Ling-2.5 (BailingMoeV2_5): Bailing's naming (model.word_embeddings, attention.* with
# attention.dense), MLA and MoE in the MTP layer N. Names: those vLLM's loader normalises
# (attention.dense -> o_proj, gate.e_score_correction_bias); no public index was found.
_BAILING_MLA = {
    k.replace("self_attn.", "attention.").replace("o_proj", "dense"): v for k, v in MLA.items()
}
_BAILING_MOE = {k.replace("shared_experts", "shared_experts"): v for k, v in MOE.items()}
_BAILING_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_experts=4,
    num_shared_experts=1,
    num_experts_per_tok=2,
    num_experts_per_token=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    head_dim=16,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
    torch_dtype="bfloat16",
    bos_token_id=0,
    eos_token_id=1,
    use_bias=False,
    use_qkv_bias=False,
    moe_shared_expert_intermediate_size=32,
    embedding_dropout=0.0,
    rope_parameters={"rope_type": "default", "rope_theta": 6000000.0},
)
_BAILING_TOP = {
    "model.word_embeddings.weight": "V,H",
    "model.norm.weight": "H",
    "lm_head.weight": "V,H",
}
_BAILING_MTP = {
    "enorm.weight": "H",
    "hnorm.weight": "H",
    "eh_proj.weight": "H,2*H",
    "final_layernorm.weight": "H",
    **NORMS,
    **_BAILING_MLA,
    **_BAILING_MOE,
}
family(
    "bailing_v25",
    Family(
        "BailingMoeV25MTPModel",
        "names vLLM's BailingMoeV25MTPModel normalises (no index)",
        config=dict(
            _BAILING_CONFIG,
            architectures=["BailingMoeV2_5ForCausalLM"],
            model_type="bailing_hybrid",
            layer_group_size=2,
            linear_head_dim=16,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
            short_conv_kernel_size=4,
        ),
        dims=MLA_DIMS,
        top=_BAILING_TOP,
        layers=(
            _l({**NORMS, **_BAILING_MLA, **DENSE}),
            _l({**NORMS, **_BAILING_MLA, **_BAILING_MOE}),
        ),
        mtp=_n(_BAILING_MTP),
        engine={"mamba_block_size": 128},
    ),
)

# Ling-3 (BailingMoeV3): MLA under attention.* (vLLM maps it to self_attn.*), MoE, an MTP
# layer N; its config is read by the configuration file the checkpoint ships. Names: the
# BailingMoeV3 export as vLLM's BailingMoeV3 mapper reads it, attention.dense included (no
# public index found).
family(
    "bailing_v3",
    Family(
        "BailingMoeV3MTPModel",
        "vLLM's BailingMoeV3 loader (attention.* names)",
        config=dict(
            _BAILING_CONFIG,
            architectures=["BailingMoeV3ForCausalLM"],
            model_type="bailing_moe_v3",
            auto_map={"AutoConfig": "configuration_bailing_moe_v3.BailingMoeV3Config"},
        ),
        dims=MLA_DIMS,
        top=_BAILING_TOP,
        layers=(_l({**NORMS, **_BAILING_MLA, **DENSE}), _l({**NORMS, **_BAILING_MLA, **MOE})),
        mtp=_n(_BAILING_MTP),
        files={
            "configuration_bailing_moe_v3.py": _PANGU_CONFIG.replace(
                "PanguUltraMoEConfig", "BailingMoeV3Config"
            ).replace("pangu_ultra_moe", "bailing_moe_v3")
        },
        engine={"trust_remote_code": True},
    ),
)

# EXAONE 4.5 (vision-language): the K-EXAONE mtp.* head next to model.language_model.*
# text weights. Names: those vLLM's Exaone4_5_MTP reads (mtp.* plus
# model.language_model.embed_tokens); no public index was found.
_EXAONE4_LAYER = {
    **GQA,
    **QK_NORM,
    **DENSE,
    "post_attention_layernorm.weight": "H",
    "post_feedforward_layernorm.weight": "H",
}
family(
    "exaone4_5",
    Family(
        "Exaone4_5_MTP",
        "vLLM's Exaone4_5_MTP loader (mtp.*, model.language_model.*; no index found)",
        config=dict(
            architectures=["Exaone4_5_ForConditionalGeneration"],
            model_type="exaone4_5",
            vocab_size=512,
            num_nextn_predict_layers=1,
            tie_word_embeddings=False,
            image_token_id=67,
            video_token_id=68,
            text_config=dict(
                model_type="exaone4",
                vocab_size=512,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                hidden_act="silu",
                max_position_embeddings=4096,
                rms_norm_eps=1e-5,
                sliding_window=128,
                sliding_window_pattern=4,
                rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
                bos_token_id=0,
                eos_token_id=1,
            ),
            vision_config=dict(
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                patch_size=14,
                spatial_merge_size=2,
                temporal_patch_size=2,
            ),
            torch_dtype="bfloat16",
        ),
        dims=_GQA_DIMS,
        top={
            "model.language_model.embed_tokens.weight": "V,H",
            "model.language_model.norm.weight": "H",
            "lm_head.weight": "V,H",
            "model.visual.patch_embed.proj.weight": "32,3,2,14,14",
        },
        layers=(prefixed("model.language_model.layers.{i}.", _EXAONE4_LAYER),) * 2,
        mtp={
            "mtp.fc.weight": "H,2*H",
            "mtp.pre_fc_norm_embedding.weight": "H",
            "mtp.pre_fc_norm_hidden.weight": "H",
            "mtp.norm.weight": "H",
            **prefixed("mtp.layers.0.", _EXAONE4_LAYER),
        },
    ),
)

# Nemotron Parse 3.5: an auxiliary one-step head (decoder.extra_proj.0 / extra_heads.0) on
# an MBart decoder next to a RADIO encoder. Names: the Parse-3.5 checkpoint keys vLLM's
# nemotron_parse3_5 lists (decoder.extra_heads.0.*, decoder.extra_proj.0.*), MBart's
# decoder layers, shrunk. The target's config needs its own code and a RADIO encoder, so
# the draft is built directly from its decoder config (route "direct").
_MBART = {
    "self_attn.q_proj.weight": "H,H",
    "self_attn.q_proj.bias": "H",
    "self_attn.k_proj.weight": "H,H",
    "self_attn.k_proj.bias": "H",
    "self_attn.v_proj.weight": "H,H",
    "self_attn.v_proj.bias": "H",
    "self_attn.out_proj.weight": "H,H",
    "self_attn.out_proj.bias": "H",
    "self_attn_layer_norm.weight": "H",
    "self_attn_layer_norm.bias": "H",
    "fc1.weight": "I,H",
    "fc1.bias": "I",
    "fc2.weight": "H,I",
    "fc2.bias": "H",
    "final_layer_norm.weight": "H",
    "final_layer_norm.bias": "H",
}
family(
    "parse_aux",
    Family(
        "ParseAuxMTPModel",
        "nvidia Nemotron Parse 3.5 keys (vLLM nemotron_parse3_5)",
        config=dict(
            architectures=["RadioMBartPrefixForCausalLM"],
            model_type="radio_mbart",
            decoder=dict(
                vocab_size=512, d_model=64, causal_vision_prefix=True, add_cross_attention=False
            ),
            navit_packing=True,
        ),
        dims=dict(V=512, H=64, I=128),
        top={
            "decoder.embed_tokens.weight": "V,H",
            "decoder.layernorm_embedding.weight": "H",
            "decoder.layer_norm.weight": "H",
            "encoder.model.patch_generator.embedder.weight": "H,48",
            "lm_head.weight": "V,H",
        },
        layers=(prefixed("decoder.layers.{i}.", _MBART),) * 2,
        mtp={
            "decoder.extra_heads.0.weight": "H,H",
            "decoder.extra_heads.0.bias": "H",
            "decoder.extra_proj.0.weight": "H,H",
            "decoder.extra_proj.0.bias": "H",
        },
        route="direct",
    ),
)

# Kimi-K3 (KimiK3ForConditionalGeneration over a Kimi-Linear text model): the text weights
# under language_model.*, MLA attention, block_sparse_moe experts (w1/w2/w3), an MTP
# layer N in DeepSeek's form, and per-layer attention-residual weights the draft does not
# use. No public checkpoint: names are those vLLM's KimiK3MTP loader reads and names.
_KIMI_MLA = {
    "self_attn.q_proj.weight": "NH*(DN+DR),H",
    "self_attn.kv_a_proj_with_mqa.weight": "KR+DR,H",
    "self_attn.kv_a_layernorm.weight": "KR",
    "self_attn.kv_b_proj.weight": "NH*(DN+DV),KR",
    "self_attn.o_proj.weight": "H,NH*DV",
}
# block_sparse_moe experts as Kimi-K3 and MiniMax-M3 name them; only the router's
# correction bias sits elsewhere (under gate. in Kimi-K3).
_BLOCK_SPARSE_EXPERTS = {
    "block_sparse_moe.gate.weight": "E,H",
    "block_sparse_moe.experts.{e}.w1.weight": "MI,H",
    "block_sparse_moe.experts.{e}.w2.weight": "H,MI",
    "block_sparse_moe.experts.{e}.w3.weight": "MI,H",
    "block_sparse_moe.shared_experts.gate_proj.weight": "MI,H",
    "block_sparse_moe.shared_experts.up_proj.weight": "MI,H",
    "block_sparse_moe.shared_experts.down_proj.weight": "H,MI",
}
_KIMI_MOE = {**_BLOCK_SPARSE_EXPERTS, "block_sparse_moe.gate.e_score_correction_bias": "E:F32"}
_KIMI_RES = {"self_attention_res_norm.weight": "H", "mlp_res_norm.weight": "H"}
family(
    "kimi_k3",
    Family(
        "KimiK3MTP",
        "vLLM's KimiK3MTP loader (no public Kimi-K3 index)",
        config=dict(
            architectures=["KimiK3ForConditionalGeneration"],
            model_type="kimi_k3",
            text_config=dict(
                model_type="kimi_linear",
                vocab_size=512,
                hidden_size=64,
                head_dim=16,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                hidden_act="silu",
                rms_norm_eps=1e-6,
                q_lora_rank=None,
                kv_lora_rank=32,
                qk_nope_head_dim=16,
                qk_rope_head_dim=0,
                v_head_dim=16,
                mla_use_nope=True,
                num_experts=4,
                num_experts_per_token=2,
                num_shared_experts=1,
                moe_intermediate_size=32,
                first_k_dense_replace=1,
                num_nextn_predict_layers=1,
                max_position_embeddings=4096,
                tie_word_embeddings=False,
                bos_token_id=0,
                eos_token_id=1,
                rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
            ),
            torch_dtype="bfloat16",
        ),
        dims=dict(MLA_DIMS, DR=0),
        top={
            "language_model.model.embed_tokens.weight": "V,H",
            "language_model.model.norm.weight": "H",
            "language_model.lm_head.weight": "V,H",
            "vision_tower.patch_embed.proj.weight": "32,3,14,14",
        },
        layers=(
            prefixed(
                "language_model.model.layers.{i}.", {**NORMS, **_KIMI_MLA, **DENSE, **_KIMI_RES}
            ),
            prefixed(
                "language_model.model.layers.{i}.", {**NORMS, **_KIMI_MLA, **_KIMI_MOE, **_KIMI_RES}
            ),
        ),
        mtp=prefixed(
            "language_model.model.layers.{n}.",
            {**NEXTN, **NEXTN_OWN, **NORMS, **_KIMI_MLA, **_KIMI_MOE, **_KIMI_RES},
        ),
        engine={"mamba_block_size": 128},  # the MLA backend: tests/hostcpu.py
        cuda_standins=("cuda_stream",),
    ),
)

# MiniMax-M3 (vision-language): language_model.* text weights, MTP modules under
# language_model.model.mtp.layers.{i} with a transformer_layer (sparse-index attention,
# block_sparse_moe experts w1/w2/w3). Names: the bundled-checkpoint keys a public MiniMax-M3
# loader test lists (language_model.model.mtp.layers.0.transformer_layer.self_attn.
# index_q_proj, ...), as vLLM's MiniMaxM3MTP maps them; shrunk.
_MM3_ATTN = {
    "self_attn.q_proj.weight": "NH*HD,H",
    "self_attn.k_proj.weight": "NKV*HD,H",
    "self_attn.v_proj.weight": "NKV*HD,H",
    "self_attn.o_proj.weight": "H,NH*HD",
    "self_attn.index_q_proj.weight": "NKV*HD,H",
    "self_attn.index_k_proj.weight": "HD,H",
    "self_attn.q_norm.weight": "HD",
    "self_attn.k_norm.weight": "HD",
    "self_attn.index_q_norm.weight": "HD",
    "self_attn.index_k_norm.weight": "HD",
}
_MM3_MOE = {**_BLOCK_SPARSE_EXPERTS, "block_sparse_moe.e_score_correction_bias": "E:F32"}
family(
    "minimax_m3",
    Family(
        "MiniMaxM3MTP",
        "MiniMax-M3 bundled checkpoint keys (public loader test) + vLLM",
        config=dict(
            architectures=["MiniMaxM3SparseForConditionalGeneration"],
            model_type="minimax_m3_vl",
            hidden_size=64,
            text_config=dict(
                model_type="minimax_m3_text",
                vocab_size=512,
                hidden_size=64,
                intermediate_size=32,
                dense_intermediate_size=128,
                shared_intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=4096,
                rms_norm_eps=1e-6,
                use_gemma_norm=True,
                rope_theta=5000000,
                rotary_dim=8,
                partial_rotary_factor=0.5,
                hidden_act="swigluoai",
                swiglu_alpha=1.702,
                swiglu_beta=1.0,
                swiglu_limit=7.0,
                use_qk_norm=True,
                qk_norm_type="per_head",
                num_local_experts=4,
                num_experts_per_tok=2,
                n_shared_experts=1,
                scoring_func="sigmoid",
                use_routing_bias=True,
                routed_scaling_factor=2.0,
                num_mtp_modules=1,
                moe_layer_freq=[0, 1],
                tie_word_embeddings=False,
                sparse_attention_config=dict(
                    use_sparse_attention=True,
                    sparse_index_dim=16,
                    sparse_num_index_heads=2,
                    sparse_topk_blocks=16,
                    sparse_block_size=128,
                    sparse_disable_index_value=[0, 1],
                    sparse_score_type="max",
                    sparse_init_block=0,
                    sparse_local_block=1,
                    sparse_attention_freq=[0, 1],
                ),
            ),
            torch_dtype="bfloat16",
        ),
        dims=_GQA_DIMS,
        top={
            "language_model.model.embed_tokens.weight": "V,H",
            "language_model.model.norm.weight": "H",
            "language_model.lm_head.weight": "V,H",
            "vision_tower.patch_embed.proj.weight": "32,3,14,14",
        },
        layers=(
            prefixed("language_model.model.layers.{i}.", {**NORMS, **GQA, **DENSE}),
            prefixed("language_model.model.layers.{i}.", {**NORMS, **_MM3_ATTN, **_MM3_MOE}),
        ),
        mtp=prefixed(
            "language_model.model.mtp.layers.{n}.",
            {
                "eh_proj.weight": "H,2*H",
                "enorm.weight": "H",
                "hnorm.weight": "H",
                "final_layernorm.weight": "H",
                **prefixed("transformer_layer.", {**NORMS, **_MM3_ATTN, **_MM3_MOE}),
            },
        ),
        mtp_layers=(0,),
        cuda_standins=("moe_kernel_as_silu",),
    ),
)

# Inkling: depth blocks under model.mtp.layers.{i} (input_proj, embed/hidden norms, a full
# decoder block with fused-attention source names wq_du/wk_dv/wv_dv/wr_du and dense
# w13_dn/w2_md), a chain norm, and the backbone's embed_norm. Config: the shape a public
# Inkling fixture restates (text_config + mtp_config); names: vLLM's InklingMTP loader.
family(
    "inkling",
    Family(
        "InklingMTP",
        "Inkling fixture config + vLLM's InklingMTP loader names",
        config=dict(
            architectures=["InklingForConditionalGeneration"],
            model_type="inkling_mm_model",
            text_config=dict(
                model_type="inkling_model",
                vocab_size=512,
                unpadded_vocab_size=500,
                hidden_size=64,
                intermediate_size=32,
                dense_intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                d_rel=4,
                rel_extent=16,
                local_layer_ids=[0],
                sliding_window_size=32,
                swa_num_attention_heads=4,
                swa_num_key_value_heads=2,
                swa_head_dim=16,
                rms_norm_eps=1e-6,
                use_embed_norm=True,
                use_sconv=True,
                sconv_kernel_size=4,
                dense_mlp_idx=1,
                n_routed_experts=4,
                n_shared_experts=1,
                num_experts_per_tok=2,
                route_scale=8.0,
                use_gate_bias=True,
                use_global_scale=True,
                norm_after_topk=True,
                gate_activation="sigmoid",
                shared_expert_sink=True,
                log_scaling_n_floor=None,
                log_scaling_alpha=0.1,
                logits_mup_width_multiplier=4.0,
                model_max_length=4096,
            ),
            mtp_config=dict(
                num_nextn_predict_layers=2, chain_hidden_post_norm=False, local_layer_ids=[0]
            ),
            torch_dtype="bfloat16",
            eos_token_id=1,
        ),
        dims=_GQA_DIMS,
        top={
            "model.llm.embed.weight": "V,H",
            "model.llm.embed_norm.weight": "H",
            "model.llm.unembed.weight": "V,H",
            "model.llm.norm.weight": "H",
        },
        layers=(
            {
                "model.llm.layers.{i}.attn_norm.weight": "H",
                "model.llm.layers.{i}.attn.wq_du.weight": "NH*HD,H",
                "model.llm.layers.{i}.attn.wo_ud.weight": "H,NH*HD",
                "model.llm.layers.{i}.mlp_norm.weight": "H",
                "model.llm.layers.{i}.mlp.w13_dn.weight": "2*I,H",
            },
        )
        * 2,
        mtp={
            f"model.mtp.layers.{i}.{k}": v
            for i, rel in ((0, "4,32"), (1, "4,16"))
            for k, v in {
                "hidden_norm.weight": "H",
                "embed_norm.weight": "H",
                "input_proj.weight": "H,2*H",
                "transformer_block.attn_norm.weight": "H",
                "transformer_block.attn.wq_du.weight": "NH*HD,H",
                "transformer_block.attn.wk_dv.weight": "NKV*HD,H",
                "transformer_block.attn.wv_dv.weight": "NKV*HD,H",
                "transformer_block.attn.wr_du.weight": "NH*4,H",
                "transformer_block.attn.wo_ud.weight": "H,NH*HD",
                "transformer_block.attn.rel_logits_proj.proj": rel,
                "transformer_block.attn.q_norm.weight": "HD",
                "transformer_block.attn.k_norm.weight": "HD",
                "transformer_block.attn.k_sconv.weight": "NKV*HD,1,4",
                "transformer_block.attn.v_sconv.weight": "NKV*HD,1,4",
                "transformer_block.mlp_norm.weight": "H",
                "transformer_block.mlp.global_scale": "1:F32",
                "transformer_block.mlp.w13_dn.weight": "2*I,H",
                "transformer_block.mlp.w2_md.weight": "H,I",
                "transformer_block.attn_sconv.weight": "H,1,4",
                "transformer_block.mlp_sconv.weight": "H,1,4",
            }.items()
        },
        mtp_layers=(0,),
        speculative={"num_speculative_tokens": 2},
        engine={"dtype": "bfloat16"},
    ),
)

# GLM-5-Next (Glm5NextForConditionalGeneration): text weights under model.language_model.*,
# an MTP layer N in DeepSeek's form (MLA without RoPE, a sparse indexer, MoE). No public
# checkpoint: names are those vLLM's Glm5NextMTP loader reads.
family(
    "glm5_next",
    Family(
        "Glm5NextMTP",
        "vLLM's Glm5NextMTP loader (no public GLM-5-Next index)",
        config=dict(
            architectures=["Glm5NextForConditionalGeneration"],
            model_type="glm5_next",
            text_config=dict(
                model_type="glm5_next_text",
                vocab_size=512,
                hidden_size=64,
                intermediate_size=128,
                moe_intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                n_shared_experts=1,
                n_routed_experts=4,
                routed_scaling_factor=2.5,
                kv_lora_rank=32,
                q_lora_rank=32,
                qk_rope_head_dim=0,
                v_head_dim=16,
                qk_nope_head_dim=16,
                qk_head_dim=16,
                n_group=1,
                topk_group=1,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                hidden_act="silu",
                max_position_embeddings=4096,
                rms_norm_eps=1e-5,
                index_topk=16,
                index_head_dim=16,
                index_n_heads=2,
                head_dim=0,
                linear_head_dim=16,
                linear_num_heads=4,
                linear_conv_kernel_dim=4,
                hc_mult=2,
                num_nextn_predict_layers=1,
                first_k_dense_replace=1,
                mla_use_nope=True,
                mhc=False,
                hc_eps=1e-6,
                hc_sinkhorn_iters=20,
                index_kpool=16,
                indexer_rope_interleave=False,
                linear_lower_bound=-5.0,
                index_kpool_always_select_tail=True,
                swiglu_limit=10.0,
                scoring_func="sigmoid",
                topk_method="noaux_tc",
                layer_types=["linear_attention", "full_attention"],
                mlp_layer_types=["dense", "sparse"],
                tie_word_embeddings=False,
                bos_token_id=0,
                eos_token_id=1,
            ),
            torch_dtype="bfloat16",
        ),
        dims=dict(MLA_DIMS, DR=0),
        top={
            "model.language_model.embed_tokens.weight": "V,H",
            "lm_head.weight": "V,H",
            "model.language_model.norm.weight": "H",
        },
        layers=(
            prefixed(
                "model.language_model.layers.{i}.",
                {
                    **NORMS,
                    "linear_attn.in_proj.weight": "H,H",
                    "linear_attn.out_proj.weight": "H,H",
                    **DENSE,
                },
            ),
            prefixed("model.language_model.layers.{i}.", {**NORMS, **MLA, **MOE}),
        ),
        mtp=prefixed(
            "model.language_model.layers.{n}.",
            {
                **NEXTN,
                "embed_tokens.weight": "V,H",
                **NORMS,
                **MLA,
                **MOE,
                "self_attn.indexer.index_kpool_compress_ape": "16,16",
                "self_attn.indexer.index_kpool_compress_gate": "16,H",
                "self_attn.indexer.wq_b.weight": "32,QR",
                "self_attn.indexer.wk.weight": "16,H",
                "self_attn.indexer.weights_proj.weight": "2,H",
                "self_attn.indexer.k_norm.weight": "16",
                "self_attn.indexer.k_norm.bias": "16",
            },
        ),
        engine={"mamba_block_size": 128},  # the MLA backend: tests/hostcpu.py
        cuda_standins=("sparse_attention_as_dense",),
    ),
)

# HY V4 (Tencent): DeepSeek-style MLA with a lightning indexer, MoE, independent
# hyper-connections; the MTP head as layer N (enorm/hnorm/eh_proj/final_layernorm and a
# skipped embed/head copy) or as model.mtp_layers.{i}. No public checkpoint: names are
# those vLLM's HYV4MTP loader reads.
family(
    "hy_v4",
    Family(
        "HYV4MTP",
        "vLLM's HYV4MTP loader (no public HY V4 index)",
        config=dict(
            MLA_CONFIG,
            architectures=["HYV4ForCausalLM"],
            model_type="hy_v4",
            num_hidden_layers=2,
            num_nextn_predict_layers=1,
            head_dim=16,
            index_topk=16,
            index_head_dim=16,
            index_n_heads=2,
            enable_ihc=False,
            hc_mult=2,
            hc_magnitude=2.0,
            hc_eps=1e-6,
            gated_mla=False,
            learnable_sink=False,
            swiglu_limit=10.0,
            enable_lm_head_fp32=False,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        ),
        dims=MLA_DIMS,
        top=TOP,
        layers=(_l({**NORMS, **MLA, **DENSE}), _l({**NORMS, **MLA, **MOE})),
        mtp=_n(
            {
                "enorm.weight": "H",
                "hnorm.weight": "H",
                "eh_proj.weight": "H,2*H",
                "final_layernorm.weight": "H",
                "shared_head.norm.weight": "H",
                **NEXTN_OWN,
                **NORMS,
                **MLA,
                **MOE,
            }
        ),
        cuda_standins=("sparse_attention_as_dense",),
    ),
)

_QWEN4_ATTN = {
    "self_attn.q_proj.weight": "2*NH*HD,H",
    "self_attn.k_proj.weight": "NKV*HD,H",
    "self_attn.v_proj.weight": "NKV*HD,H",
    "self_attn.o_proj.weight": "H,NH*HD",
    **QK_NORM,
}
_QWEN4_MLP = {
    "mlp.gate.weight": "E,H",
    "mlp.shared_expert_gate.weight": "1,H",
    "mlp.shared_expert.gate_proj.weight": "MI,H",
    "mlp.shared_expert.up_proj.weight": "MI,H",
    "mlp.shared_expert.down_proj.weight": "H,MI",
    **_EXPERTS,
}
_QWEN4_HC = {
    f"{kind}_hyper_connection.{k}": v
    for kind in ("attn", "mlp")
    for k, v in {
        "hc_norm.weight": "2*H",
        "input_mix_weight_down.weight": "8,2*H",
        "block_inject_weight.weight": "2,2*H",
        "input_mix_weight_up.weight": "2*H,8",
    }.items()
}

# Qwen4-Exp: Qwen3.5-style mtp.* head (fc, pre-fc norms, layers, norm) with hyper-connection
# mixers; text weights under model.language_model.*. No public checkpoint: names are those
# vLLM's Qwen4ExpMTP remapping reads.
family(
    "qwen4_exp",
    Family(
        "Qwen4ExpMTP",
        "vLLM's Qwen4ExpMTP loader (no public Qwen4-Exp index)",
        config=dict(
            architectures=["Qwen4ExpForConditionalGeneration"],
            model_type="qwen4_exp",
            text_config=dict(
                model_type="qwen4_exp_text",
                vocab_size=512,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                hidden_act="silu",
                max_position_embeddings=4096,
                rms_norm_eps=1e-6,
                tie_word_embeddings=False,
                linear_conv_kernel_dim=4,
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                num_experts_per_tok=2,
                num_experts=4,
                hc_count=2,
                hc_lowrank=8,
                mtp_num_hidden_layers=1,
                layer_types=["linear_attention", "full_attention"],
                rope_parameters={
                    "rope_theta": 10000.0,
                    "rope_type": "default",
                    "partial_rotary_factor": 0.25,
                },
            ),
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
        ),
        dims=_GQA_DIMS,
        top={
            "model.language_model.embed_tokens.weight": "V,H",
            "lm_head.weight": "V,H",
            "model.language_model.norm.weight": "H",
        },
        layers=(
            prefixed(
                "model.language_model.layers.{i}.",
                {
                    "linear_attn.in_proj_qkv.weight": "H,H",
                    "linear_attn.out_proj.weight": "H,H",
                    **{k: v for k, v in _QWEN4_MLP.items()},
                    **_QWEN4_HC,
                },
            ),
            prefixed(
                "model.language_model.layers.{i}.", {**_QWEN4_ATTN, **_QWEN4_MLP, **_QWEN4_HC}
            ),
        ),
        mtp={
            "mtp.fc_embedding.weight": "H,H",
            "mtp.fc_hidden.weight": "H,H",
            "mtp.pre_fc_norm_embedding.weight": "H",
            "mtp.pre_fc_norm_hidden.weight": "2*H",
            "mtp.hyper_connection_mixer.hc_norm.weight": "2*H",
            "mtp.hyper_connection_mixer.input_mix_weight_down.weight": "8,2*H",
            "mtp.hyper_connection_mixer.block_inject_weight.weight": "2,2*H",
            "mtp.hyper_connection_mixer.input_mix_weight_up.weight": "2*H,8",
            **prefixed("mtp.layers.0.", {**_QWEN4_ATTN, **_QWEN4_MLP, **_QWEN4_HC}),
        },
        engine={"mamba_block_size": 128},
    ),
)

# Step-3.5-Flash: GQA with a head-wise gate and q/k norms, MoE with stacked experts
# (moe.gate_proj/up_proj/down_proj hold all experts), a share_expert, MTP layers N.. with
# enorm/hnorm/eh_proj/shared_head (its head named output). Names: those vLLM's Step3p5MTP
# maps (no public index was found); its MTP layers dense, as vLLM can load them only so.
# transformers' Step3p7TextConfig (which vLLM registers for step3p5) is per-layer and
# covers only num_hidden_layers, so vLLM cannot build the MTP layer from it: the proof
# builds the class from the plain config the checkpoint's own code would give.
family(
    "step3p5",
    Family(
        "Step3p5MTP",
        "vLLM's Step3p5MTP loader (no public Step-3.5 index found)",
        config=dict(
            architectures=["Step3p5ForCausalLM"],
            model_type="step3p5",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_attention_groups=2,
            num_key_value_heads=2,
            head_dim=16,
            hidden_act="silu",
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            moe_num_experts=4,
            moe_top_k=2,
            moe_intermediate_size=32,
            share_expert_dim=32,
            moe_router_scaling_factor=1.0,
            use_moe_router_bias=True,
            need_fp32_gate=True,
            norm_expert_weight=True,
            swiglu_limits=None,
            swiglu_limits_shared=None,
            sliding_window=None,
            att_impl_type="GQA",
            num_nextn_predict_layers=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            layer_types=["full_attention"] * 2,
            mtp_layer_types=["full_attention"],
            mlp_layer_types=["dense", "sparse"],
            mtp_mlp_layer_types=["dense"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            torch_dtype="bfloat16",
            bos_token_id=0,
            eos_token_id=1,
        ),
        dims=_GQA_DIMS,
        top=TOP,
        layers=(
            _l({**NORMS, **GQA, **QK_NORM, **DENSE}),
            _l(
                {
                    **NORMS,
                    **GQA,
                    **QK_NORM,
                    "moe.gate.weight": "E,H",
                    "moe.router_bias": "E:F32",
                    "moe.gate_proj.weight": "E,MI,H",
                    "moe.up_proj.weight": "E,MI,H",
                    "moe.down_proj.weight": "E,H,MI",
                    "share_expert.gate_proj.weight": "MI,H",
                    "share_expert.up_proj.weight": "MI,H",
                    "share_expert.down_proj.weight": "H,MI",
                }
            ),
        ),
        mtp=_n(
            {
                "enorm.weight": "H",
                "hnorm.weight": "H",
                "eh_proj.weight": "H,2*H",
                "shared_head.norm.weight": "H",
                "shared_head.output.weight": "V,H",
                **NORMS,
                **GQA,
                **QK_NORM,
                **DENSE,
            }
        ),
        route="direct",
    ),
)

# Step5: like Step-3.5 (MTP layers N.. with enorm/hnorm/eh_proj/shared_head.output), GQA
# with q/k norms. No public checkpoint: names are those vLLM's Step5MTP loader reads.
family(
    "step5",
    Family(
        "Step5MTP",
        "vLLM's Step5MTP loader (no public Step5 index)",
        config=dict(
            architectures=["Step5ForCausalLM"],
            model_type="step5",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_attention_groups=2,
            num_hidden_layers=2,
            head_dim=16,
            max_seq_len=4096,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            use_moe=False,
            num_nextn_predict_layers=1,
            tie_word_embeddings=False,
            sparse_config={"enabled": False},
            rope_theta=500000,
            zero_centered=True,
            norm_dtype="bf16",
            rope_parameters={"rope_theta": 500000, "rope_type": "default"},
            torch_dtype="bfloat16",
            bos_token_id=0,
            eos_token_id=1,
        ),
        dims=_GQA_DIMS,
        top=TOP,
        layers=(_l({**NORMS, **GQA, **QK_NORM, **DENSE}),) * 2,
        mtp=_n(
            {
                "enorm.weight": "H",
                "hnorm.weight": "H",
                "eh_proj.weight": "H,2*H",
                "shared_head.norm.weight": "H",
                "shared_head.output.weight": "V,H",
                **NORMS,
                **GQA,
                **QK_NORM,
                **DENSE,
            }
        ),
        route="direct",
        direct_config="registered",
        needs_triton=True,
    ),
)
