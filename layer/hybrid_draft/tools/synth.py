"""Synthetic checkpoints with real MTP layouts: tests, the compose default model, the benchmark.

A layout is the ordered list of tensors a Hugging Face export of an architecture holds
(names, shapes, dtypes) plus its ``config.json``. Tensors are written in export order and
packed greedily into shards, so the MTP layer lands where a real export puts it (the last
shard or two) unless it is asked to have a shard of its own. Weights are seeded random
values, or, with ``draft="agrees"``, the same with the tensors :mod:`hybrid_draft.tools.agree`
sets so that the MTP draft agrees with its target (make-checkpoint's default);
``fill="sparse"`` writes the headers only and leaves the data as a hole, which gives
full-size layouts (a 688 GB DeepSeek-V3) that cost no disk and read as zeros.

Only the standard library is needed, except for ``fill="normal"`` (numpy) and the tokenizer
(the ``tokenizers`` package, present wherever vLLM is).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hybrid_draft.core import checkpoint

DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4, "U8": 1}


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor: its export name, shape and safetensors dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "BF16"

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass
class Layout:
    """An architecture's ``config.json`` and its tensors in export order."""

    config: dict[str, Any]
    tensors: list[Tensor]
    is_mtp: frozenset[str] = field(default_factory=frozenset)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _linear(out: list[Tensor], name: str, rows: int, cols: int, dtype: str, fp8: bool) -> None:
    if fp8:
        out.append(Tensor(f"{name}.weight", (rows, cols), "F8_E4M3"))
        out.append(Tensor(f"{name}.weight_scale_inv", (-(-rows // 128), -(-cols // 128)), "F32"))
    else:
        out.append(Tensor(f"{name}.weight", (rows, cols), dtype))


def _mlp(out: list[Tensor], prefix: str, p: dict[str, Any], moe: bool, fp8: bool = False) -> None:
    """The DeepSeek/GLM MLP: routed experts, a router with its score bias, and shared
    experts in a MoE layer; gate/up/down projections in a dense one."""
    h = p["hidden_size"]
    if moe:
        e, mi = p["n_routed_experts"], p["moe_intermediate_size"]
        out.append(Tensor(f"{prefix}gate.weight", (e, h)))
        out.append(Tensor(f"{prefix}gate.e_score_correction_bias", (e,), "F32"))
        for j in range(e):
            _linear(out, f"{prefix}experts.{j}.gate_proj", mi, h, "BF16", fp8)
            _linear(out, f"{prefix}experts.{j}.up_proj", mi, h, "BF16", fp8)
            _linear(out, f"{prefix}experts.{j}.down_proj", h, mi, "BF16", fp8)
        prefix, inter = f"{prefix}shared_experts.", mi * p["n_shared_experts"]
    else:
        inter = p["intermediate_size"]
    _linear(out, f"{prefix}gate_proj", inter, h, "BF16", fp8)
    _linear(out, f"{prefix}up_proj", inter, h, "BF16", fp8)
    _linear(out, f"{prefix}down_proj", h, inter, "BF16", fp8)


def _with_nextn_layer(
    config: dict[str, Any], p: dict[str, Any], block: Any, *, own_embed_and_head: bool
) -> Layout:
    """A DeepSeek/GLM export: embedding, ``N`` blocks, norm and head, then the MTP layer
    ``N`` (its input norms and projection, one more block, its shared head's norm, and in
    DeepSeek's export its own copies of the embedding and the head)."""
    h, v, n = p["hidden_size"], p["vocab_size"], p["num_hidden_layers"]
    tensors = [Tensor("model.embed_tokens.weight", (v, h))]
    for i in range(n):
        tensors += block(f"model.layers.{i}.", i)
    tensors += [Tensor("model.norm.weight", (h,)), Tensor("lm_head.weight", (v, h))]
    mp = f"model.layers.{n}."
    mtp = [Tensor(f"{mp}embed_tokens.weight", (v, h))] if own_embed_and_head else []
    mtp += [
        Tensor(f"{mp}enorm.weight", (h,)),
        Tensor(f"{mp}hnorm.weight", (h,)),
        Tensor(f"{mp}eh_proj.weight", (h, 2 * h)),
        *block(mp, n),
        Tensor(f"{mp}shared_head.norm.weight", (h,)),
    ]
    if own_embed_and_head:
        mtp.append(Tensor(f"{mp}shared_head.head.weight", (v, h)))
    return Layout(config, tensors + mtp, frozenset(t.name for t in mtp))


# --- Qwen3.5 (dense text model, gated delta-net + full attention, mtp.* head) -------------

QWEN3_5_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests: the smallest shapes vLLM's CPU path accepts.
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
    # The compose default: head dims GPU attention and FLA kernels support (128).
    "default": dict(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
}


def qwen3_5(preset: str = "tiny", **overrides: int) -> Layout:
    """A Qwen3.5 text checkpoint (``Qwen3_5ForCausalLM``) with one MTP layer under ``mtp.``."""
    p = {**QWEN3_5_PRESETS[preset], **overrides}
    n = p["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    config = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        **p,
        "hidden_act": "silu",
        "linear_conv_kernel_dim": 4,
        "layer_types": layer_types,
        "mtp_num_hidden_layers": 1,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
    }
    h, inter = p["hidden_size"], p["intermediate_size"]
    hd, nh, nkv = p["head_dim"], p["num_attention_heads"], p["num_key_value_heads"]
    kd = p["linear_key_head_dim"] * p["linear_num_key_heads"]
    vd = p["linear_value_head_dim"] * p["linear_num_value_heads"]
    nv = p["linear_num_value_heads"]

    def layer(prefix: str, kind: str) -> list[Tensor]:
        t = [Tensor(f"{prefix}input_layernorm.weight", (h,))]
        if kind == "full_attention":
            a = f"{prefix}self_attn."
            t += [
                Tensor(f"{a}q_proj.weight", (nh * hd * 2, h)),
                Tensor(f"{a}k_proj.weight", (nkv * hd, h)),
                Tensor(f"{a}v_proj.weight", (nkv * hd, h)),
                Tensor(f"{a}o_proj.weight", (h, nh * hd)),
                Tensor(f"{a}q_norm.weight", (hd,)),
                Tensor(f"{a}k_norm.weight", (hd,)),
            ]
        else:
            a = f"{prefix}linear_attn."
            conv = 2 * kd + vd
            t += [
                Tensor(f"{a}in_proj_qkv.weight", (conv, h)),
                Tensor(f"{a}in_proj_z.weight", (vd, h)),
                Tensor(f"{a}in_proj_b.weight", (nv, h)),
                Tensor(f"{a}in_proj_a.weight", (nv, h)),
                Tensor(f"{a}conv1d.weight", (conv, 1, 4)),
                Tensor(f"{a}dt_bias", (nv,)),
                Tensor(f"{a}A_log", (nv,)),
                Tensor(f"{a}norm.weight", (p["linear_value_head_dim"],)),
                Tensor(f"{a}out_proj.weight", (h, vd)),
            ]
        t += [
            Tensor(f"{prefix}post_attention_layernorm.weight", (h,)),
            Tensor(f"{prefix}mlp.gate_proj.weight", (inter, h)),
            Tensor(f"{prefix}mlp.up_proj.weight", (inter, h)),
            Tensor(f"{prefix}mlp.down_proj.weight", (h, inter)),
        ]
        return t

    tensors = [Tensor("model.embed_tokens.weight", (p["vocab_size"], h))]
    for i, kind in enumerate(layer_types):
        tensors += layer(f"model.layers.{i}.", kind)
    tensors += [Tensor("model.norm.weight", (h,)), Tensor("lm_head.weight", (p["vocab_size"], h))]
    mtp = [
        Tensor("mtp.fc.weight", (h, 2 * h)),
        Tensor("mtp.pre_fc_norm_embedding.weight", (h,)),
        Tensor("mtp.pre_fc_norm_hidden.weight", (h,)),
        *layer("mtp.layers.0.", "full_attention"),
        Tensor("mtp.norm.weight", (h,)),
    ]
    return Layout(config, tensors + mtp, frozenset(t.name for t in mtp))


# --- DeepSeek-V3 (MLA attention, optional MoE and FP8 block scales) -----------------------

_DEEPSEEK_V3_TINY: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
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
)

DEEPSEEK_V3_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _DEEPSEEK_V3_TINY,
    # What vLLM's CPU build serves (its end-to-end test, the local CPU image) on every x86
    # host: the tiny shapes with DeepSeek's real MLA ranks. The reference CPU_MLA backend
    # takes head sizes (kv_lora_rank + qk_rope_head_dim) 320, 512 and 576; the AMX_MLA
    # backend, which vLLM picks wherever AMX tiles are available, declares 576 only and
    # VNNI-packs W_UK (heads, kv_lora_rank, qk_nope_head_dim) and W_UV (heads, v_head_dim,
    # kv_lora_rank) with convert_weight_packed, which wants out features a multiple of 16
    # and in features a multiple of 32: qk_nope_head_dim and v_head_dim 32 meet both
    # (tests/e2e/test_isa.py asks the real kernels).
    "cpu": {
        **_DEEPSEEK_V3_TINY,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
    },
    # The real DeepSeek-V3/R1 shapes: 61 layers, 256 experts, FP8 with 128x128 scales.
    "full": dict(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
    ),
}


def deepseek_v3(
    preset: str = "tiny", *, moe: bool = True, fp8: bool = False, **overrides: int
) -> Layout:
    """A DeepSeek-V3 checkpoint with ``num_nextn_predict_layers=1`` (the MTP layer is layer N).

    ``moe=False`` keeps every layer, the MTP layer included, dense: the CUDA build of vLLM
    has no CPU MoE kernels (they live in ``vllm._C`` of the CPU build), and the draft's
    weight rule does not depend on it.
    """
    p = {**DEEPSEEK_V3_PRESETS[preset], **overrides}
    n = p["num_hidden_layers"]
    if not moe:
        p["first_k_dense_replace"] = n + 1
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **p,
        "num_key_value_heads": p["num_attention_heads"],
        "num_nextn_predict_layers": 1,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "rope_theta": 10000,
    }
    if fp8:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    h, nh = p["hidden_size"], p["num_attention_heads"]
    qk = p["qk_nope_head_dim"] + p["qk_rope_head_dim"]

    def block(prefix: str, idx: int) -> list[Tensor]:
        t: list[Tensor] = [Tensor(f"{prefix}input_layernorm.weight", (h,))]
        a = f"{prefix}self_attn."
        _linear(t, f"{a}q_a_proj", p["q_lora_rank"], h, "BF16", fp8)
        t.append(Tensor(f"{a}q_a_layernorm.weight", (p["q_lora_rank"],)))
        _linear(t, f"{a}q_b_proj", nh * qk, p["q_lora_rank"], "BF16", fp8)
        _linear(
            t, f"{a}kv_a_proj_with_mqa", p["kv_lora_rank"] + p["qk_rope_head_dim"], h, "BF16", fp8
        )
        t.append(Tensor(f"{a}kv_a_layernorm.weight", (p["kv_lora_rank"],)))
        _linear(
            t,
            f"{a}kv_b_proj",
            nh * (p["qk_nope_head_dim"] + p["v_head_dim"]),
            p["kv_lora_rank"],
            "BF16",
            fp8,
        )
        _linear(t, f"{a}o_proj", h, nh * p["v_head_dim"], "BF16", fp8)
        t.append(Tensor(f"{prefix}post_attention_layernorm.weight", (h,)))
        _mlp(t, f"{prefix}mlp.", p, idx >= p["first_k_dense_replace"], fp8)
        return t

    return _with_nextn_layer(config, p, block, own_embed_and_head=True)


# --- GLM-4.5 MoE (GQA attention with bias, MoE from layer 1, one MTP layer) ----------------

GLM4_MOE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
    ),
    # What vLLM's CPU build serves: its CPU attention refuses head_dim 16, takes 32.
    "cpu": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
    ),
}


def glm4_moe(preset: str = "tiny", *, moe: bool = True, **overrides: int) -> Layout:
    """A GLM-4.5-style ``Glm4MoeForCausalLM`` checkpoint with one MTP layer (layer N)."""
    p = {**GLM4_MOE_PRESETS[preset], **overrides}
    n = p["num_hidden_layers"]
    if not moe:
        p["first_k_dense_replace"] = n + 1
    config = {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        **p,
        "num_nextn_predict_layers": 1,
        "attention_bias": True,
        "use_qk_norm": False,
        "partial_rotary_factor": 0.5,
        "routed_scaling_factor": 2.5,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "rope_theta": 1000000,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    h, hd = p["hidden_size"], p["head_dim"]
    nh, nkv = p["num_attention_heads"], p["num_key_value_heads"]

    def block(prefix: str, idx: int) -> list[Tensor]:
        a = f"{prefix}self_attn."
        t = [
            Tensor(f"{prefix}input_layernorm.weight", (h,)),
            Tensor(f"{a}q_proj.weight", (nh * hd, h)),
            Tensor(f"{a}q_proj.bias", (nh * hd,)),
            Tensor(f"{a}k_proj.weight", (nkv * hd, h)),
            Tensor(f"{a}k_proj.bias", (nkv * hd,)),
            Tensor(f"{a}v_proj.weight", (nkv * hd, h)),
            Tensor(f"{a}v_proj.bias", (nkv * hd,)),
            Tensor(f"{a}o_proj.weight", (h, nh * hd)),
            Tensor(f"{prefix}post_attention_layernorm.weight", (h,)),
        ]
        _mlp(t, f"{prefix}mlp.", p, idx >= p["first_k_dense_replace"])
        return t

    return _with_nextn_layer(config, p, block, own_embed_and_head=False)


# --- Qwen3 (plain dense transformer, no MTP): a standalone draft model --------------------


def qwen3(preset: str = "tiny", **overrides: int) -> Layout:
    """A dense ``Qwen3ForCausalLM``: the kind of model ``method: draft_model`` runs."""
    p = {**QWEN3_5_PRESETS[preset], "num_hidden_layers": 2, **overrides}
    for key in (
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
    ):
        p.pop(key, None)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **p,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    h, inter, hd = p["hidden_size"], p["intermediate_size"], p["head_dim"]
    nh, nkv = p["num_attention_heads"], p["num_key_value_heads"]
    tensors = [Tensor("model.embed_tokens.weight", (p["vocab_size"], h))]
    for i in range(p["num_hidden_layers"]):
        a = f"model.layers.{i}."
        tensors += [
            Tensor(f"{a}input_layernorm.weight", (h,)),
            Tensor(f"{a}self_attn.q_proj.weight", (nh * hd, h)),
            Tensor(f"{a}self_attn.k_proj.weight", (nkv * hd, h)),
            Tensor(f"{a}self_attn.v_proj.weight", (nkv * hd, h)),
            Tensor(f"{a}self_attn.o_proj.weight", (h, nh * hd)),
            Tensor(f"{a}self_attn.q_norm.weight", (hd,)),
            Tensor(f"{a}self_attn.k_norm.weight", (hd,)),
            Tensor(f"{a}post_attention_layernorm.weight", (h,)),
            Tensor(f"{a}mlp.gate_proj.weight", (inter, h)),
            Tensor(f"{a}mlp.up_proj.weight", (inter, h)),
            Tensor(f"{a}mlp.down_proj.weight", (h, inter)),
        ]
    tensors += [Tensor("model.norm.weight", (h,)), Tensor("lm_head.weight", (p["vocab_size"], h))]
    return Layout(config, tensors)


ARCHITECTURES: dict[str, Callable[..., Layout]] = {
    "qwen3_5": qwen3_5,
    "deepseek_v3": deepseek_v3,
    "glm4_moe": glm4_moe,
    "qwen3": qwen3,
}
#: Each architecture's presets (``qwen3`` takes Qwen3.5's shapes).
PRESETS = {
    "qwen3_5": QWEN3_5_PRESETS,
    "deepseek_v3": DEEPSEEK_V3_PRESETS,
    "glm4_moe": GLM4_MOE_PRESETS,
    "qwen3": QWEN3_5_PRESETS,
}
#: vLLM's CPU build serves these (``hybrid-draft make-checkpoint DIR --arch A --preset cpu``).
CPU_SERVABLE = ("deepseek_v3", "glm4_moe")


# --- sharding and writing ------------------------------------------------------------------


def shard(
    layout: Layout,
    *,
    shard_bytes: int | None = None,
    num_shards: int | None = None,
    mtp_own_shard: bool = False,
) -> list[list[Tensor]]:
    """Pack tensors in export order into shards of about ``shard_bytes``, or into exactly
    ``num_shards`` shards of about equal size.

    With ``mtp_own_shard`` the MTP tensors go to a final shard of their own (counted in
    ``num_shards``), the layout a test needs to see shard pruning; otherwise they fall where
    the packing puts them, as in a real export.
    """
    body = [t for t in layout.tensors if not (mtp_own_shard and t.name in layout.is_mtp)]
    tail = [t for t in layout.tensors if mtp_own_shard and t.name in layout.is_mtp]
    shards: list[list[Tensor]] = []
    if shard_bytes is not None:
        size = 0
        for t in body:
            if not shards or (shards[-1] and size + t.nbytes > shard_bytes):
                shards.append([])
                size = 0
            shards[-1].append(t)
            size += t.nbytes
    else:
        count = max(1, (num_shards or 1) - (1 if tail else 0))
        total = sum(t.nbytes for t in body) or 1
        shards = [[] for _ in range(count)]
        start = 0
        for t in body:  # a tensor goes to the shard its first byte falls in
            shards[min(count - 1, start * count // total)].append(t)
            start += t.nbytes
        shards = [s for s in shards if s]
    if tail:
        shards.append(tail)
    return shards


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _header(tensors: list[Tensor]) -> tuple[bytes, int]:
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        meta[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


def _normal_bytes(t: Tensor, rng: object) -> bytes:
    import numpy as np

    count = t.nbytes // DTYPE_BYTES[t.dtype]
    if t.name.endswith(("norm.weight", "layernorm.weight")) and t.dtype in ("BF16", "F32"):
        values = np.ones(count, dtype=np.float32)
    else:
        values = rng.standard_normal(count, dtype=np.float32) * np.float32(0.02)  # type: ignore[attr-defined]
    if t.dtype == "F32":
        return values.tobytes()
    if t.dtype == "BF16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    if t.dtype == "F16":
        return values.astype(np.float16).tobytes()
    if t.dtype == "F8_E4M3":
        # Small finite e4m3 codes (sign, exponent 0-6, any mantissa): never NaN.
        codes = rng.integers(0, 0x37, count, dtype=np.uint8)  # type: ignore[attr-defined]
        signs = rng.integers(0, 2, count, dtype=np.uint8) << 7  # type: ignore[attr-defined]
        return bytes((codes | signs).tobytes())
    return bytes(t.nbytes)


def _noise_blocks(seed: int) -> Iterator[bytes]:
    import random

    rnd = random.Random(seed)
    block = rnd.randbytes(16 << 20)
    while True:
        yield block


def _write_data(
    f: object, tensors: list[Tensor], fill: str, seed: int, construction: Any = None
) -> None:
    if fill == "normal":
        import numpy as np

        rng = np.random.default_rng(seed)
        for t in tensors:
            data = _normal_bytes(t, rng)  # drawn whatever follows: the others keep theirs
            value = construction.value(t.name, t.shape) if construction is not None else None
            if value is not None:
                from hybrid_draft.tools import agree

                data = agree.to_bytes(value, t.dtype)
            f.write(data)  # type: ignore[attr-defined]
        return
    # "noise": fast incompressible bytes for large benchmark checkpoints.
    remaining = sum(t.nbytes for t in tensors)
    for block in _noise_blocks(seed):
        if remaining <= 0:
            break
        chunk = block[: min(len(block), remaining)]
        f.write(chunk)  # type: ignore[attr-defined]
        remaining -= len(chunk)


#: Present in a directory while make-checkpoint writes into it, removed when it is done: a
#: directory holding it is make-checkpoint's own unfinished output, safe to write again.
MARKER = ".hybrid-draft-make-checkpoint"

#: How :func:`write_file` names the file it writes before renaming it into place.
PARTIAL = ".{}.partial"


class TargetError(ValueError):
    """A target directory make-checkpoint cannot write into (one line naming it)."""


def is_complete(directory: str | os.PathLike[str]) -> bool:
    """A checkpoint is complete once its config and its index (or single shard) are there.

    :func:`write_checkpoint` writes the index last, so a half-written one is not complete.
    """
    d = Path(directory)
    return (d / "config.json").is_file() and (
        (d / checkpoint.INDEX_NAME).is_file() or (d / "model.safetensors").is_file()
    )


def target_state(directory: str | os.PathLike[str]) -> str:
    """What is at ``directory``: ``missing`` or ``empty`` (free to write), ``partial``
    (make-checkpoint's own unfinished output), ``complete`` (a checkpoint) or ``occupied``
    (anything else). :class:`TargetError` when it is not a directory.

    ``partial`` is whatever a make-checkpoint killed at any point leaves: the marker, the
    marker's own unfinished file (killed before the marker was renamed into place), or
    nothing but unfinished files."""
    d = Path(directory)
    try:
        st = os.stat(d)
    except FileNotFoundError:
        return "missing"
    except NotADirectoryError:
        raise TargetError(f"{d}: a parent of the target is not a directory") from None
    if not stat.S_ISDIR(st.st_mode):
        raise TargetError(f"{d}: exists and is not a directory")
    if os.path.lexists(d / MARKER) or os.path.lexists(d / PARTIAL.format(MARKER)):
        return "partial"  # the second: killed while writing the marker itself
    if is_complete(d):
        return "complete"
    with os.scandir(d) as entries:
        names = [e.name for e in entries]
    if not names:
        return "empty"
    return "partial" if all(_is_partial_name(n) for n in names) else "occupied"


#: Every name make-checkpoint writes (the checkpoint's, the tokenizer's and the marker).
_WRITES = re.compile(
    r"config\.json|generation_config\.json|tokenizer(_config)?\.json"
    r"|model(-\d{5,}-of-\d{5,})?\.safetensors|"
    + re.escape(checkpoint.INDEX_NAME)
    + "|"
    + re.escape(MARKER)
)


def _is_partial_name(name: str) -> bool:
    """Whether ``name`` is what :func:`write_file` names one of make-checkpoint's files
    before it is finished."""
    prefix, suffix = PARTIAL.split("{}")
    inner = name[len(prefix) : -len(suffix)]
    return name.startswith(prefix) and name.endswith(suffix) and bool(_WRITES.fullmatch(inner))


@contextlib.contextmanager
def marked(directory: str | os.PathLike[str]) -> Iterator[None]:
    """Write into ``directory`` (created if need be) under :data:`MARKER`, removed at the end
    only if the writes all succeeded."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    write_file(d / MARKER, lambda f: f.write(b"make-checkpoint is writing here\n"))
    yield
    os.unlink(d / MARKER)


def write_file(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` through a new file beside it, renamed over ``path`` at the end: never
    through a symbolic link (the rename replaces a link, not what it points to), and never
    a half-written file under the final name."""
    tmp = path.with_name(PARTIAL.format(path.name))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of an interrupted run (a link is removed, not followed)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_text(path: Path, text: str) -> None:
    write_file(path, lambda f: f.write(text.encode()))


def write_checkpoint(
    out_dir: str | os.PathLike[str],
    layout: Layout,
    shards: list[list[Tensor]],
    *,
    fill: str = "normal",
    seed: int = 0,
    draft: str | None = None,
) -> Path:
    """Write ``config.json``, the shards and, last, the safetensors index; return the directory.

    ``fill``: ``normal`` (finite seeded values, numpy), ``noise`` (fast random bytes) or
    ``sparse`` (headers only; the data is a hole in the file). ``draft``: ``agrees`` (with
    ``fill="normal"``: the MTP draft agrees with its target by construction,
    :mod:`hybrid_draft.tools.agree`), ``random``, or None (no claim in the index). Each file is
    written by :func:`write_file` (never through a symbolic link).
    """
    if fill not in ("normal", "noise", "sparse"):
        raise ValueError(f"fill={fill!r}: accepted values are normal, noise, sparse")
    from hybrid_draft.tools import agree

    construction = None
    claim: dict[str, str] | None = None
    if draft == agree.AGREES:
        if fill != "normal":
            raise ValueError(f"fill={fill!r} writes no values a draft could agree with")
        construction = agree.Construction(layout.config, seed)
        claim = construction.claim()
    elif draft == agree.RANDOM:
        claim = {"draft": agree.RANDOM if layout.is_mtp else agree.NONE}
    elif draft is not None:
        raise ValueError(f"draft={draft!r}: accepted values are agrees, random, None")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_text(out / "config.json", json.dumps(layout.config, indent=2) + "\n")
    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in enumerate(shards):
        name = shard_name(i, len(shards))
        header, size = _header(tensors)

        def write(
            f: IO[bytes],
            header: bytes = header,
            size: int = size,
            i: int = i,
            tensors: list[Tensor] = tensors,
        ) -> None:
            f.write(header)
            if fill == "sparse":
                f.truncate(len(header) + size)
            else:
                _write_data(f, tensors, fill, seed * 100003 + i, construction)

        write_file(out / name, write)
        weight_map.update({t.name: name for t in tensors})
        total += size
    metadata: dict[str, Any] = {"total_size": total}
    if claim is not None:
        metadata[agree.CLAIM_KEY] = claim
    index = {"metadata": metadata, "weight_map": weight_map}
    _write_text(out / checkpoint.INDEX_NAME, json.dumps(index, indent=1) + "\n")
    return out


def write_tokenizer(out_dir: str | os.PathLike[str], vocab_size: int) -> None:
    """A byte-level BPE tokenizer with no merges: any text encodes, no download needed.

    Ids 0 and 1 are ``<s>`` and ``</s>``, the 256 byte symbols follow, and plain added
    tokens ``<t258>``... fill the rest of the model's vocabulary, so every id the random
    model can produce decodes to text.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1}
    for sym in sorted(alphabet):
        vocab[sym] = len(vocab)
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is below the {len(vocab)} byte-level tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(
        [
            AddedToken(f"<t{i}>", special=False, normalized=False)
            for i in range(len(vocab), vocab_size)
        ]
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_text(out / "tokenizer.json", tok.to_str(pretty=True))
    _write_text(
        out / "tokenizer_config.json",
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 4096,
                "chat_template": (
                    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant: {% endif %}"
                ),
            },
            indent=2,
        )
        + "\n",
    )
    _write_text(
        out / "generation_config.json", json.dumps({"bos_token_id": 0, "eos_token_id": 1}) + "\n"
    )
