"""Checkpoints whose MTP draft agrees with its target by construction, and the claim they make.

A draft loaded wrong is no error anywhere: vLLM serves, the draft proposes, the target
rejects every proposal. On a checkpoint of random weights every proposal is rejected anyway,
so only a draft that must agree with its target shows whether it was loaded right: here the
target rejects nothing, unless a tensor of the draft is wrong or missing.

The construction (the same for every architecture; each names its tensors in :data:`SCHEMES`):

- **Every block passes its input through.** Each attention's output projection
  (``self_attn.o_proj``, Qwen3.5's gated delta-net ``linear_attn.out_proj``) and each MLP's
  down projection (dense, routed and shared experts) is zero, in the target and in the MTP
  layer. The target's last hidden state is then its current token's embedding, and its next
  token a function of the current token alone: ``f(t) = argmax_j head_j . (w_f * e_t / rms(e_t))``
  with ``w_f`` the final norm's weights.
- **A structured embedding and head.** The hidden dimensions are paired into planes; every
  token but 0 and 1 owns one slot, a plane and one of :data:`ANGLES` angles in it (none on an
  axis), and its embedding is the unit vector at that angle in that plane. Tokens 0 and 1
  (``<s>``, ``</s>``) share other tokens' slots. Head row ``j >= 2`` is the unit vector of one
  slot divided by ``w_f``, rows 0 and 1 are zero: a token's logits are ``sqrt(H) cos`` of the
  angle to each slot of its own plane (exactly 0 for the other planes), so its successor wins
  by ``sqrt(H) (1 - cos(2 pi / ANGLES))``, 7.6 % of its logit with 16 angles: bfloat16's
  roundings (under 1 %) cannot flip it. Where the vocabulary outnumbers 16 slots per plane
  (over 8 tokens per hidden dimension), a slot is a group of ``g`` planes and one angle in
  each, the unit vector spread over them, and the margin 7.6 % / ``g``. A scale that differs
  between a plane's two dimensions turns the angles in it: a ratio of 2.25 turns three in four
  past the midpoint to a neighbour.
- **The draft computes the target's next prediction.** The MTP layer takes the next token's
  embedding ``e`` and the target's hidden state; its embedding norm has weights ``w_e``, its
  projection is ``diag(D)`` on the embedding half and zero on the hidden half, its block
  passes through, its output norm has weights ``w_s = w_f / (w_e * D)``. It computes
  ``w_s * norm(D * w_e * e / rms(e)) = w_f * e / rms(e) / c`` for a ``c > 0``: the target's
  own logits for that token, scaled, so the same argmax. ``w_f``, ``w_e`` and ``w_s`` differ
  between a plane's two dimensions by a ratio of 2.25 to 3 (never ones), so ``D`` does by 11
  to 27, and half of the dimensions have ``D`` and ``w_s`` negative: a missing or wrong norm,
  projection or sign, a nonzero output projection, or the halves of the projection swapped,
  loses the agreement. The hidden half being zero, the hidden-state norm (``hnorm``,
  ``pre_fc_norm_hidden``) and the rest of the block (its attention, its MLP's gate and up
  projections, its router) cannot matter, and so whether vLLM hands the MTP layer the target's
  hidden state before or after its final norm does not either. Where vLLM's norm class
  computes ``x * (1 + w)`` (Qwen3.5's ``GemmaRMSNorm``) the stored weights are the effective
  ones less 1; every effective weight is within 0.58 to 1.73 in magnitude, so that none is a
  small difference of bfloat16 values.

The MTP layer masks the embedding at position 0 (DeepSeek's, GLM's): its proposal there is
token 0, which a greedy target never takes; every proposal vLLM uses comes from a later
position whenever a prompt has two tokens or more.

The claim is written into the checkpoint's index (``model.safetensors.index.json``), under
``metadata``: ``"hybrid_draft": {"draft": "agrees", "next_token_map": DIGEST}`` (``random``
for a random draft; ``none`` for a checkpoint without an MTP layer, a standalone draft whose
next-token map is the digest's). :func:`claim` reads it.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any

#: Where the claim lives in the index's ``metadata``.
CLAIM_KEY = "hybrid_draft"
AGREES, RANDOM, NONE = "agrees", "random", "none"

#: Angles per plane: the successor's margin is ``1 - cos(2 pi / ANGLES)`` of its logit.
ANGLES = 16
#: The log-ratio of each norm's weights between a plane's two dimensions.
RATIO = (math.log(2.25), math.log(3.0))
#: The tensors every block's output goes through: zero, the block passes its input through.
PASS_THROUGH = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "down_proj.weight")


@dataclass(frozen=True)
class Scheme:
    """Where an architecture keeps the tensors of the construction."""

    #: 1.0 where vLLM's norm class computes ``x * (1 + w)``, else 0.
    norm_offset: float
    #: The MTP layer's embedding norm, projection (embedding half first), hidden norm, output
    #: norm, and its own copies of the embedding and head (``{n}``: its layer index).
    embedding_norm: str | None = None
    projection: str | None = None
    hidden_norm: str | None = None
    output_norm: str | None = None
    copies: tuple[str, ...] = ()
    embedding: str = "model.embed_tokens.weight"
    head: str = "lm_head.weight"
    final_norm: str = "model.norm.weight"


_NEXTN = Scheme(
    0.0,
    "model.layers.{n}.enorm.weight",
    "model.layers.{n}.eh_proj.weight",
    "model.layers.{n}.hnorm.weight",
    "model.layers.{n}.shared_head.norm.weight",
)
#: By ``config.json``'s architecture: DeepSeek-V3 and GLM-4.5 (``DeepSeekMTP``,
#: ``Glm4MoeMTP``: RMSNorm ``x * w``, ``eh_proj`` over ``[enorm(e), hnorm(h)]``), Qwen3.5
#: (``Qwen3_5MTP``: ``GemmaRMSNorm`` ``x * (1 + w)`` everywhere, ``fc`` over
#: ``[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]``, then ``mtp.norm``), Qwen3 (no MTP
#: layer; RMSNorm ``x * w``).
SCHEMES: dict[str, Scheme] = {
    "DeepseekV3ForCausalLM": Scheme(
        0.0,
        _NEXTN.embedding_norm,
        _NEXTN.projection,
        _NEXTN.hidden_norm,
        _NEXTN.output_norm,
        ("model.layers.{n}.embed_tokens.weight", "model.layers.{n}.shared_head.head.weight"),
    ),
    "Glm4MoeForCausalLM": _NEXTN,
    "Qwen3_5ForCausalLM": Scheme(
        1.0,
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.fc.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
    ),
    "Qwen3ForCausalLM": Scheme(0.0),
}


def scheme(config: dict[str, Any]) -> Scheme | None:
    """The construction's tensor names for a ``config.json`` (None: not one it knows)."""
    archs = config.get("architectures") or [None]
    return SCHEMES.get(archs[0])


class Construction:
    """The values of the tensors the construction sets, for one vocabulary, hidden size and
    seed (the same for every architecture: a target and a standalone draft generated with the
    same seed and sizes predict alike); every other tensor keeps its random values."""

    def __init__(self, config: dict[str, Any], seed: int) -> None:
        import numpy as np

        found = scheme(config)
        if found is None:
            raise ValueError(f"no agreeing construction for {config.get('architectures')}")
        self.scheme = found
        v, h = int(config["vocab_size"]), int(config["hidden_size"])
        self.vocab, self.hidden = v, h
        n = int(config.get("num_hidden_layers", 0))
        self.names = {
            role: name.format(n=n)
            for role, name in (
                ("embedding_norm", found.embedding_norm),
                ("projection", found.projection),
                ("hidden_norm", found.hidden_norm),
                ("output_norm", found.output_norm),
            )
            if name is not None
        }
        self.copies = {c.format(n=n) for c in found.copies}
        rng = np.random.default_rng([seed, v, h, 0x61677265])
        tokens = v - 2
        planes = h // 2
        # A token spans `span` planes (one angle in each, its unit vector spread over them)
        # where one plane per token leaves fewer than ANGLES slots each.
        span = 1
        while planes // span and (planes // span) * ANGLES**span < tokens:
            span += 1
        if tokens < 1 or not planes // span:
            raise ValueError(f"vocab_size {v} and hidden_size {h} leave no slot")
        per_group = ANGLES**span
        used = -(-tokens // per_group)  # groups of `span` planes
        pairs = rng.permutation(h)[: 2 * planes].reshape(planes, 2)
        groups = pairs[rng.permutation(planes)[: used * span]].reshape(used, span, 2)
        pairs = groups.reshape(used * span, 2)  # every plane in use
        slots = rng.permutation(used * per_group)[:tokens]
        #: each token's dimensions, two per plane, and unit vector (tokens 0, 1 share others')
        self.span = span
        self.dims = np.zeros((v, 2 * span), dtype=np.int64)
        self.unit = np.zeros((v, 2 * span), dtype=np.float64)
        digits = slots % per_group
        for j in range(span):
            theta = (digits // ANGLES**j % ANGLES + 0.5) * (2 * np.pi / ANGLES)
            self.dims[2:, 2 * j : 2 * j + 2] = groups[slots // per_group, j]
            self.unit[2:, 2 * j] = np.cos(theta) / np.sqrt(span)
            self.unit[2:, 2 * j + 1] = np.sin(theta) / np.sqrt(span)
        shared = 2 + rng.choice(tokens, size=2, replace=tokens < 2)
        self.dims[:2], self.unit[:2] = self.dims[shared], self.unit[shared]
        #: head row j >= 2 points at the slot of token points[j]; successor = its inverse
        self.points = np.zeros(v, dtype=np.int64)
        self.points[2:] = 2 + rng.permutation(tokens)
        succ = np.zeros(v, dtype=np.int64)
        succ[self.points[2:]] = np.arange(2, v)
        succ[:2] = succ[shared]
        self.next_token = succ

        # Per-dimension weights: in each used plane a ratio of 2.25 to 3 between the two
        # dimensions, w_f one way, w_e and w_s the other (so D = w_f / (w_e w_s) by 11 to 27).
        def ratios(sign: np.ndarray) -> np.ndarray:
            w = np.exp(rng.uniform(-0.2, 0.2, h))
            x = rng.uniform(*RATIO, len(pairs)) / 2 * sign
            w[pairs[:, 0]] = np.exp(x)
            w[pairs[:, 1]] = np.exp(-x)
            return w

        orient = rng.choice([-1.0, 1.0], len(pairs))
        self.w_f = ratios(orient)
        self.w_e = ratios(-orient)
        w_s = ratios(-orient)
        sign = rng.choice([-1.0, 1.0], h)
        self.w_s = w_s * sign
        self.d = self.w_f / (self.w_e * self.w_s)  # carries the same sign as w_s
        self.w_h = np.exp(rng.uniform(-0.5, 0.5, h))  # hnorm: anything, never ones

    def digest(self) -> str:
        """The next-token map's digest: equal for checkpoints that predict alike."""
        data = self.next_token.astype("<i8").tobytes()
        return hashlib.sha256(data).hexdigest()[:16]

    def embedding(self) -> Any:
        import numpy as np

        e = np.zeros((self.vocab, self.hidden), dtype=np.float32)  # what is written, at most
        rows = np.arange(self.vocab)
        for k in range(2 * self.span):
            e[rows, self.dims[:, k]] = self.unit[:, k]
        return e

    def head(self) -> Any:
        import numpy as np

        out = np.zeros((self.vocab, self.hidden), dtype=np.float32)
        rows = np.arange(2, self.vocab)
        target = self.points[2:]
        for k in range(2 * self.span):
            cols = self.dims[target, k]
            out[rows, cols] = self.unit[target, k] / self.w_f[cols]
        return out

    def value(self, name: str, shape: tuple[int, ...]) -> Any | None:
        """The tensor ``name``'s values (float32 or float64), or None when it keeps its random
        ones."""
        import numpy as np

        s, off = self.scheme, self.scheme.norm_offset
        if name.endswith(PASS_THROUGH):
            return np.zeros(shape)
        if name == s.embedding or (name in self.copies and "embed_tokens" in name):
            return self.embedding()
        if name == s.head or name in self.copies:
            return self.head()
        if name == s.final_norm:
            return self.w_f - off
        roles = {v: k for k, v in self.names.items()}
        role = roles.get(name)
        if role == "embedding_norm":
            return self.w_e - off
        if role == "hidden_norm":
            return self.w_h - off
        if role == "output_norm":
            return self.w_s - off
        if role == "projection":
            out = np.zeros(shape)
            idx = np.arange(self.hidden)
            out[idx, idx] = self.d
            return out
        return None

    def claim(self) -> dict[str, str]:
        has_draft = "projection" in self.names
        return {"draft": AGREES if has_draft else NONE, "next_token_map": self.digest()}


def to_bytes(values: Any, dtype: str) -> bytes:
    """``values`` in the safetensors ``dtype``, rounded to nearest (bfloat16: ties to even)."""
    import numpy as np

    v = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "F32":
        return v.tobytes()
    if dtype == "BF16":
        u = v.view(np.uint32).astype(np.uint64)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return rounded.astype(np.uint16).tobytes()
    if dtype == "F16":
        return v.astype(np.float16).tobytes()
    if dtype == "F8_E4M3" and not v.any():
        return bytes(v.size)
    raise ValueError(f"the construction writes no {dtype} tensor with these values")


# --- the claim, as tools read it ------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """What a checkpoint directory says about its draft: ``agrees``, ``random``, ``none``, or
    ``unknown`` (no claim); ``where`` is the file that said it (or why there is none)."""

    draft: str
    where: str

    @property
    def agrees(self) -> bool:
        return self.draft == AGREES


def claim(model_dir: str | os.PathLike[str]) -> Claim:
    """The claim of the checkpoint in ``model_dir`` (its index's ``metadata.hybrid_draft``);
    ``unknown`` when it makes none. Raises :class:`OSError` or
    :class:`hybrid_draft.core.checkpoint.CheckpointError` (one line) for an index that is
    there but cannot be read."""
    from hybrid_draft import files
    from hybrid_draft.core import checkpoint

    shown = files.show_path(os.path.join(os.fspath(model_dir), checkpoint.INDEX_NAME))
    try:
        index = checkpoint.read_json(model_dir, checkpoint.INDEX_NAME, checkpoint.INDEX_LIMIT)
    except FileNotFoundError:
        return Claim("unknown", f"no {shown}")
    meta = index.get("metadata") if isinstance(index, dict) else None
    said = meta.get(CLAIM_KEY) if isinstance(meta, dict) else None
    draft = said.get("draft") if isinstance(said, dict) else None
    if draft not in (AGREES, RANDOM, NONE):
        return Claim("unknown", f"no metadata.{CLAIM_KEY}.draft in {shown}")
    return Claim(draft, shown)
