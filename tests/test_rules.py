"""Pruning rules for MTP drafts vLLM ships without one: exactly what ``load_weights`` keeps.

A spy on vLLM's lazy iterator tags every tensor it yields; a torch function mode records
which of them the real ``load_weights`` actually uses (copies, views, slices). On a
single-shard checkpoint (so pruning cannot hide anything) that set must equal the rule's.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from conftest import Events, Recorder, engine_config, load_target_and_draft
from hybrid_draft import checkpoint, synth

pytestmark = pytest.mark.vllm


class Consumed(TorchFunctionMode):
    """Names of yielded checkpoint tensors that any torch function touched."""

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[int, str] = {}
        self.alive: list[torch.Tensor] = []  # keeps ids unique while tracking
        self.used: set[str] = set()

    def track(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self.names[id(tensor)] = name
        self.alive.append(tensor)
        return tensor

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        hit = {self.names[id(a)] for a in tree_flatten((args, kwargs))[0]
               if isinstance(a, torch.Tensor) and id(a) in self.names}
        out = func(*args, **kwargs)
        if hit:
            self.used |= hit
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self.track(next(iter(hit)), o)
        return out


@pytest.fixture
def consumed(vllm_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> Consumed:
    import vllm.model_executor.model_loader.default_loader as default_loader

    mode = Consumed()
    real = default_loader.safetensors_weights_iterator

    def tagged(*args: Any, **kwargs: Any) -> Any:
        for name, tensor in real(*args, **kwargs):
            yield name, mode.track(name, tensor)

    monkeypatch.setattr(default_loader, "safetensors_weights_iterator", tagged)
    with mode:
        yield mode


#: The proofs need every checkpoint tensor offered to ``load_weights``: the draft is loaded by
#: vLLM's own (unfiltered) lazy iterator, which the user's explicit draft loader keeps, from a
#: one-shard checkpoint, which shard pruning cannot thin.
UNFILTERED = {"method": "mtp", "num_speculative_tokens": 1,
              "draft_load_config": {"load_format": "safetensors"}}


def one_shard(root: Path, name: str, layout: synth.Layout) -> Path:
    out = root / name
    if not out.exists():
        synth.write_checkpoint(out, layout, [layout.tensors])
    return out


def rule_keeps(model_dir: Path, draft: Any) -> set[str]:
    names = {t.name for s in checkpoint.read_checkpoint(model_dir) for t in s.tensors}
    return {n for n in names if not draft.is_unused_checkpoint_weight(n)}


def test_deepseek_mtp_rule_is_exactly_what_load_weights_consumes(
    ckpt_root: Path, consumed: Consumed, instanttensor_standin: Recorder, events: Events,
) -> None:
    model = one_shard(ckpt_root, "deepseek-1shard", synth.deepseek_v3("tiny", moe=False))
    loaded = load_target_and_draft(engine_config(model, speculative_config=UNFILTERED))
    assert type(loaded.draft).__name__ == "DeepSeekMTP"
    assert consumed.used == rule_keeps(model, loaded.draft)
    assert "model.embed_tokens.weight" in consumed.used and "lm_head.weight" not in consumed.used
    (draft,) = events.decisions("draft")
    assert draft["pruning_rule"] == "hybrid-draft"


def test_glm4_moe_mtp_rule_is_exactly_what_load_weights_consumes(
    ckpt_root: Path, consumed: Consumed, events: Events, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GLM MTP layer is MoE, and vLLM's CPU MoE kernels need vllm._C, which the CUDA
    wheel lacks: the real get_model (called by the V1 EagleProposer, as in serving) stops in
    process_weights_after_loading, after load_weights and vLLM's "weights not initialized"
    check have both run to completion on the real model."""
    import vllm.model_executor.model_loader.default_loader as default_loader
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.v1.spec_decode.eagle import EagleProposer

    model = one_shard(ckpt_root, "glm-1shard", synth.glm4_moe("tiny"))
    checked: list[Any] = []
    real = default_loader.DefaultModelLoader.track_weights_loading

    def track(self: Any, m: Any, loaded: Any, quantized: bool = False) -> None:
        real(self, m, loaded, quantized)
        checked.append(m)  # reached only when no weight was left uninitialised

    monkeypatch.setattr(default_loader.DefaultModelLoader, "track_weights_loading", track)
    config = engine_config(model, speculative_config=UNFILTERED)
    with set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        proposer = EagleProposer(config, torch.device("cpu"), runner=None)
        with pytest.raises(AttributeError, match="prepack_moe_weight"):
            proposer._get_model()
    (draft,) = checked
    assert type(draft).__name__ == "Glm4MoeMTP"
    assert consumed.used == rule_keeps(model, draft)
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= consumed.used
    assert events.decisions("draft")[0]["pruning_rule"] == "hybrid-draft"


def test_pruning_never_hands_the_draft_target_only_shards(
    deepseek: Path, instanttensor_standin: Recorder, filtered_reads: Recorder, events: Events,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shards = [p.name for p in sorted(deepseek.glob("*.safetensors"))]
    target_only = [s.path.name for s in checkpoint.read_checkpoint(deepseek)
                   if all(not t.name.startswith("model.layers.2.")
                          and t.name != "model.embed_tokens.weight" for t in s.tensors)]
    assert target_only, "the layout needs a shard holding target tensors only"
    for mode in ("auto", "instanttensor"):
        monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", mode)
        instanttensor_standin.calls.clear()
        filtered_reads.calls.clear()
        load_target_and_draft(engine_config(deepseek))
        target_call, *draft_calls = instanttensor_standin.files()
        assert target_call == shards
        if mode == "instanttensor":  # one InstantTensor pass over the pruned shards
            assert len(draft_calls) == 1
            opened = set(draft_calls[0])
        else:  # the filtered lazy reader opens each shard it reads from once
            assert not draft_calls
            opened = {c["file"] for c in filtered_reads.calls}
            assert len(opened) == len(filtered_reads.calls)
        assert opened == set(shards) - set(target_only), mode


def test_a_rule_that_keeps_too_little_fails_the_load(
    ckpt_root: Path, instanttensor_standin: Recorder, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Drop the shard holding the MTP shared head through a wrong rule: vLLM's own check."""
    layout = synth.deepseek_v3("tiny", moe=False)
    head = [t for t in layout.tensors if ".shared_head." in t.name]
    rest_mtp = [t for t in layout.tensors if t.name in layout.is_mtp and t not in head]
    body = [t for t in layout.tensors if t.name not in layout.is_mtp]
    model = ckpt_root / "deepseek-split-head"
    if not model.exists():
        synth.write_checkpoint(model, layout, [body, rest_mtp, head])
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

    from hybrid_draft.adapter import rules

    rules.install(DeepSeekMTP)
    good = DeepSeekMTP.is_unused_checkpoint_weight

    def too_strict(self: Any, name: str) -> bool:
        return ".shared_head." in name or good(self, name)

    monkeypatch.setattr(DeepSeekMTP, "is_unused_checkpoint_weight", too_strict)
    with pytest.raises(ValueError, match="weights were not initialized from checkpoint"):
        load_target_and_draft(engine_config(model))


def test_rules_are_installed_only_where_vllm_has_none(vllm_runtime: Any) -> None:
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP
    from vllm.model_executor.models.glm4_moe_mtp import Glm4MoeMTP
    from vllm.model_executor.models.qwen3_5_mtp import Qwen3_5MTP

    from hybrid_draft.adapter import rules

    own = Qwen3_5MTP.is_unused_checkpoint_weight
    assert rules.install(Qwen3_5MTP) == "vllm"
    assert Qwen3_5MTP.is_unused_checkpoint_weight is own
    for cls in (DeepSeekMTP, Glm4MoeMTP):
        assert rules.install(cls) == "hybrid-draft"
        assert rules.install(cls) == "hybrid-draft"  # idempotent
    from vllm.model_executor.models.mimo_mtp import MiMoMTP

    assert rules.install(MiMoMTP) == "none"
    assert rules.probe(MiMoMTP, object()) is None


def test_rule_shapes_for_several_mtp_layers(vllm_runtime: Any) -> None:
    from hybrid_draft.adapter.rules import deepseek_mtp_unused, glm4_moe_mtp_unused

    cfg = types.SimpleNamespace(num_hidden_layers=3, num_nextn_predict_layers=2)
    for rule in (deepseek_mtp_unused, glm4_moe_mtp_unused):
        assert not rule(cfg, "model.layers.3.eh_proj.weight")
        assert not rule(cfg, "model.layers.4.mlp.experts.7.up_proj.weight")
        assert not rule(cfg, "model.layers.3.embed_tokens.weight")
        assert rule(cfg, "model.layers.4.embed_tokens.weight")  # only the first MTP layer's
        assert rule(cfg, "model.layers.2.self_attn.o_proj.weight")
        assert rule(cfg, "model.layers.3.self_attn.rotary_emb.inv_freq")
        assert rule(cfg, "model.norm.weight")
        assert not rule(cfg, "model.embed_tokens.weight")
    assert deepseek_mtp_unused(cfg, "lm_head.weight")
    assert not glm4_moe_mtp_unused(cfg, "lm_head.weight")


def test_a_subclass_with_its_own_load_weights_keeps_every_shard(vllm_runtime: Any) -> None:
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

    from hybrid_draft.adapter import rules

    rules.install(DeepSeekMTP)

    class Custom(DeepSeekMTP):
        def load_weights(self, weights: Any) -> set[str]:
            return set()

    cfg = types.SimpleNamespace(num_hidden_layers=3, num_nextn_predict_layers=1)
    assert rules.probe(DeepSeekMTP, cfg)("model.layers.0.mlp.up_proj.weight")
    assert not rules.probe(Custom, cfg)("model.layers.0.mlp.up_proj.weight")
