"""make-checkpoint's checkpoints whose MTP draft agrees with its target by construction
(hybrid_draft.tools.agree): what they claim, what they hold, and that vLLM's own modules of
the loaded target and draft predict alike, for every architecture and in both float dtypes.

That the served draft of such a checkpoint has every proposal accepted, and a garbled one
almost none, is proven by the servers of tests/e2e (vLLM's CPU build, its own counters).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import engine_config, load_target_and_draft
from hybrid_draft.tools import agree, cli, synth

INDEX = "model.safetensors.index.json"


def claim_in(model: Path) -> Any:
    return json.loads((model / INDEX).read_text())["metadata"].get(agree.CLAIM_KEY)


@pytest.mark.parametrize(
    ("args", "draft", "said"),
    [
        ([], "agrees", "its MTP draft agrees with its target"),
        (["--random-draft"], "random", "a random MTP draft"),
        (["--arch", "qwen3"], "none", "no MTP layer"),
        (["--fill", "sparse"], None, "no claim about its draft (--fill sparse)"),
    ],
)
def test_make_checkpoint_says_in_the_index_whether_its_draft_agrees(
    args: list[str],
    draft: str | None,
    said: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "m"
    base = ["make-checkpoint", str(out), "--preset", "tiny", "--no-tokenizer"]
    assert cli.main([*base, *args]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f" MB, {said}")
    written = claim_in(out)
    assert (written or {}).get("draft") == draft
    assert agree.claim(out) == agree.Claim(
        draft or "unknown",
        str(out / INDEX) if draft else f"no metadata.hybrid_draft.draft in {out / INDEX}",
    )
    if draft in ("agrees", "none"):  # the next-token map, by a digest
        assert len(written["next_token_map"]) == 16
    assert agree.claim(tmp_path) == agree.Claim("unknown", f"no {tmp_path / INDEX}")


def test_a_target_and_a_standalone_draft_of_the_same_seed_and_sizes_predict_alike() -> None:
    config = synth.qwen3_5("tiny").config
    same = agree.Construction(synth.qwen3("tiny").config, 3).digest()
    assert agree.Construction(config, 3).digest() == same
    assert agree.Construction(config, 4).digest() != same


@pytest.mark.parametrize(
    ("overrides", "span"),
    [({}, 1), ({"hidden_size": 128, "vocab_size": 4096}, 2)],
)
def test_every_token_has_a_successor_that_wins_by_its_margin(
    overrides: dict[str, int], span: int
) -> None:
    """The construction's own arithmetic (its float32 values): the target's successor of
    every token (its embedding, normed and weighted by the final norm, through the head) is
    the map's, never token 0 or 1, and wins by 7.6 % of its logit over one plane per token,
    half that over two (a vocabulary over 8 tokens per hidden dimension); the draft's norms
    and projection give the same successors."""
    import numpy as np

    c = agree.Construction(synth.deepseek_v3("tiny", **overrides).config, 7)
    assert c.span == span
    embedded = c.embedding()
    normed = embedded / np.sqrt((embedded**2).mean(1, keepdims=True))
    logits = (normed * c.w_f) @ c.head().T
    assert logits.argmax(1).tolist() == c.next_token.tolist() and c.next_token.min() >= 2
    top = np.sort(logits, 1)[:, -2:]
    margin = (1 - np.cos(2 * np.pi / agree.ANGLES)) / span
    assert ((top[:, 1] - top[:, 0]) / top[:, 1]).min() == pytest.approx(margin, rel=1e-5)
    drafted = (c.w_s * c.d * c.w_e * normed) @ c.head().T  # its output norm: a scale alone
    assert drafted.argmax(1).tolist() == c.next_token.tolist()


def _tensors(model: Path) -> dict[str, Any]:
    """Every tensor of ``model``, as float32 numpy arrays (F8 ones as their codes)."""
    import torch
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for shard in sorted(model.glob("*.safetensors")):
        for name, t in load_file(shard).items():
            out[name] = (t.view(torch.uint8) if t.element_size() == 1 else t.float()).numpy()
    return out


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "qwen3_5"])
def test_the_checkpoint_passes_every_block_through_and_no_draft_norm_is_ones(
    arch: str, tmp_path: Path
) -> None:
    import numpy as np

    out = tmp_path / arch
    assert cli.main(["make-checkpoint", str(out), "--arch", arch, "--preset", "tiny"]) == 0
    layout = synth.ARCHITECTURES[arch]("tiny")
    tensors = _tensors(out)
    zero = [n for n in tensors if n.endswith(agree.PASS_THROUGH)]
    assert len(zero) >= 2 * (layout.config["num_hidden_layers"] + 1)  # attention and MLP
    assert all(not tensors[n].any() for n in zero), [n for n in zero if tensors[n].any()]
    c = agree.Construction(layout.config, 0)
    offset, h = c.scheme.norm_offset, layout.config["hidden_size"]
    for role in ("embedding_norm", "hidden_norm", "output_norm"):
        effective = tensors[c.names[role]] + offset
        assert not np.isclose(effective, 1.0, atol=0.01).any(), role
    proj = tensors[c.names["projection"]]
    assert proj.shape == (h, 2 * h) and not proj[:, h:].any()  # the hidden half: zero
    diagonal = np.diag(proj[:, :h])
    assert np.count_nonzero(proj[:, :h]) == h and (diagonal < 0).any()
    assert not np.isclose(np.abs(diagonal), 1.0, atol=0.05).any()
    # The rest of the checkpoint keeps the values a random draft's checkpoint has.
    random = tmp_path / "random"
    base = ["make-checkpoint", str(random), "--arch", arch, "--preset", "tiny"]
    assert cli.main([*base, "--random-draft"]) == 0
    others = _tensors(random)
    kept = [n for n in others if c.value(n, others[n].shape) is None]
    assert kept and all(np.array_equal(others[n], _tensors(out)[n]) for n in kept)


# --- vLLM's own modules -------------------------------------------------------------------------

#: DeepSeek-V3 dense (the CUDA build has no CPU MoE kernel to run, and the construction does
#: not depend on it) and Qwen3.5 as generated. GLM-4.5's MTP layer is DeepSeek's (the same
#: norm class, projection and shared head), but its model wants MoE layers, which this build
#: cannot run on the CPU: vLLM's CPU build serves it in tests/e2e.
LAYOUTS = {
    "deepseek_v3": lambda: synth.deepseek_v3("tiny", moe=False),
    "qwen3_5": lambda: synth.qwen3_5("tiny"),
}


def _predictions(loaded: Any, arch: str) -> tuple[Any, Any]:
    """Each token's next token, by the target's modules (embedding, final norm, head; its
    blocks pass through) and by the draft's (embedding, its input norms and projection, its
    output norm and head; its block passes through), given that token as the draft's input
    and another token's target hidden state as its hidden input."""
    import torch
    from vllm.config import set_current_vllm_config

    target, draft = loaded.target, loaded.draft
    vocab = loaded.config.model_config.hf_text_config.vocab_size
    ids = torch.arange(vocab)
    with set_current_vllm_config(loaded.config), torch.no_grad():
        hidden = target.model.norm(target.model.embed_tokens(ids))
        expected = target.compute_logits(hidden).argmax(-1)
        other = hidden[torch.randperm(vocab, generator=torch.Generator().manual_seed(0))]
        embedded = draft.embed_input_ids(ids)
        if arch == "qwen3_5":
            m = draft.model
            x = torch.cat([m.pre_fc_norm_embedding(embedded), m.pre_fc_norm_hidden(other)], -1)
            logits = draft.compute_logits(m.norm(m.fc(x)))
        else:
            (layer,) = draft.model.layers.values()
            x = torch.cat([layer.enorm(embedded), layer.hnorm(other)], -1)
            logits = draft.compute_logits(layer.eh_proj(x))
    return expected, logits.argmax(-1)


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", sorted(LAYOUTS))
def test_vllms_modules_of_the_loaded_draft_predict_what_the_target_does(
    arch: str, dtype: str, ckpt_root: Path, instanttensor_standin: Any
) -> None:
    import torch

    layout = LAYOUTS[arch]()
    model = ckpt_root / f"agrees-{arch}"
    if not (model / INDEX).exists():
        synth.write_checkpoint(
            model, layout, synth.shard(layout, num_shards=2), seed=5, draft="agrees"
        )
    # vLLM's CUDA build cannot pack Qwen3.5's gated delta-net weights in bfloat16 on the CPU
    # (no causal_conv1d_weight_pack kernel): loaded in float32, then cast, modules and all.
    loads_in = "float32" if arch == "qwen3_5" else dtype
    loaded = load_target_and_draft(engine_config(model, dtype=loads_in))
    if loads_in != dtype:
        loaded.target.to(getattr(torch, dtype))
        loaded.draft.to(getattr(torch, dtype))
    # Every block's output projections are zero as loaded: each block passes through.
    for role, module in (("target", loaded.target), ("draft", loaded.draft)):
        outputs = {
            n: p
            for n, p in module.named_parameters()
            if n.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "w2_weight"))
        }
        assert outputs and all(not p.any() for p in outputs.values()), role
    expected, predicted = _predictions(loaded, arch)
    assert torch.equal(predicted, expected)
    construction = agree.Construction(layout.config, 5)
    assert expected.tolist() == construction.next_token.tolist()
    assert (expected >= 2).all()  # never <s> nor </s>: greedy generation never stops early
    # A wrong or missing tensor loses the agreement: the embedding norm left as vLLM
    # initialises it (effective weights 1: a tensor the load skipped), or the output norm's
    # signs lost.
    norms = (
        (loaded.draft.model.pre_fc_norm_embedding, loaded.draft.model.norm)
        if arch == "qwen3_5"
        else next(
            (layer.enorm, layer.shared_head.norm) for layer in loaded.draft.model.layers.values()
        )
    )
    offset = construction.scheme.norm_offset
    kept = [n.weight.detach().clone() for n in norms]
    with torch.no_grad():
        norms[0].weight.fill_(1.0 - offset)
    assert (_predictions(loaded, arch)[1] == expected).float().mean() < 0.5
    with torch.no_grad():
        norms[0].weight.copy_(kept[0])
        norms[1].weight.copy_((kept[1].float() + offset).abs() - offset)
    assert (_predictions(loaded, arch)[1] == expected).float().mean() < 0.5
