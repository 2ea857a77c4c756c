"""The draft tensors vLLM replaces with the target's: skipped exactly, never left unset.

For every MTP family the rules cover, a torch function mode records where the real
``load_weights`` puts each checkpoint tensor (the parameter it writes); the tensors whose
every destination is a module vLLM's proposer replaces must be exactly the ones the layer
skips (``planning.shared_kind`` under ``sharing.expected``). On real loads: the draft with
the skip has the very parameters it has without it; a proposer that does not replace a
skipped module gets it from the checkpoint, with an event saying so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten

from conftest import Events, Recorder, engine_config, load_target_and_draft, rule_keeps
from mtp_layouts import FAMILIES
from test_rules import (
    Consumed,
    family_checkpoint,
    inspection_in_process,  # noqa: F401 - the fixture, for this module too
    load_directly,
    load_through_vllm,
    stand_in_cuda,
    tagged,
    triton_available,
)

pytestmark = pytest.mark.vllm


class Destinations(Consumed):
    """:class:`Consumed`, plus where each checkpoint tensor was written: the storage of
    the first tensor argument of an in-place op (``copy_``, ``__setitem__``...) fed by it."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[str, set[int]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
        fed = {self.names[id(a)] for a in flat if id(a) in self.names}
        name = getattr(func, "__name__", "")
        if (
            fed
            and flat
            and id(flat[0]) not in self.names
            and (name.endswith("_") or name == "__setitem__")
        ):
            for source in fed:
                self.storages.setdefault(source, set()).add(flat[0].untyped_storage().data_ptr())
        return super().__torch_function__(func, types, args, kwargs)

    def params_of(self, model: Any) -> dict[str, set[str]]:
        """Checkpoint tensor -> the model's parameters it was written into."""
        by_storage: dict[int, set[str]] = {}
        for pname, param in model.named_parameters():
            by_storage.setdefault(param.untyped_storage().data_ptr(), set()).add(pname)
        return {
            n: {p for ptr in ptrs for p in by_storage.get(ptr, ())}
            for n, ptrs in self.storages.items()
        }


@pytest.fixture
def destinations(vllm_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> Destinations:
    import vllm.model_executor.model_loader.default_loader as default_loader

    mode = Destinations()
    real = default_loader.safetensors_weights_iterator
    monkeypatch.setattr(
        default_loader,
        "safetensors_weights_iterator",
        lambda *args, **kwargs: tagged(mode, real(*args, **kwargs)),
    )
    with mode:
        yield mode


def skipped_vs_truth(draft: Any, kept: set[str], written: dict[str, set[str]]) -> tuple:
    from hybrid_draft.adapter import sharing
    from hybrid_draft.core.planning import shared_kind

    kinds = sharing.expected(draft, 1, "mtp", True)
    replaced = set(sharing.replaceable(draft, kinds))
    truth = {n for n in kept if written.get(n) and written[n] <= replaced}
    skipped = {n for n in kept if shared_kind(n) in kinds}
    return skipped, truth


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_skipped_tensors_are_exactly_those_feeding_replaced_modules(
    name: str,
    ckpt_root: Path,
    deepseek: Path,
    destinations: Destinations,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    f = FAMILIES[name]
    if f.needs_triton and not triton_available():
        pytest.skip(f"{f.draft} imports Triton kernels while it is built; no Triton here")
    model = family_checkpoint(ckpt_root, name, f)
    stand_in_cuda(f, monkeypatch)
    if f.route == "direct":
        draft, *_ = load_directly(model, f, deepseek, destinations)
    else:
        draft, *_ = load_through_vllm(model, f, monkeypatch)
    from hybrid_draft.adapter import rules

    rules.install(type(draft))  # (the direct route builds the class without the layer)
    kept = rule_keeps(model, draft)
    skipped, truth = skipped_vs_truth(draft, kept, destinations.params_of(draft))
    assert skipped == truth


@pytest.mark.parametrize("fixture", ["qwen35", "deepseek"])
def test_the_skip_matches_on_the_synthetic_checkpoints(
    fixture: str,
    request: pytest.FixtureRequest,
    destinations: Destinations,
    instanttensor_standin: Recorder,
) -> None:
    """vLLM's own rule (Qwen3.5) and this layer's (DeepSeek), through model runner v2's
    load_eagle_model, read unfiltered (a user's explicit lazy draft loader: vLLM's path, no
    skip)."""
    model: Path = request.getfixturevalue(fixture)
    spec = {
        "method": "mtp",
        "num_speculative_tokens": 1,
        "draft_load_config": {"load_format": "safetensors"},
    }
    written: dict[str, set[str]] = {}
    from vllm.v1.worker.gpu.spec_decode.eagle import utils

    real = utils.maybe_share_target_embed

    def record_first(draft: Any, draft_inner: Any, target_inner: Any) -> None:
        # Called first after the draft's load, before vLLM swaps the modules.
        written.update(destinations.params_of(draft))
        kept.update(rule_keeps(model, draft))
        real(draft, draft_inner, target_inner)

    kept: set[str] = set()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(utils, "maybe_share_target_embed", record_first)
        loaded = load_target_and_draft(engine_config(model, speculative_config=spec))
    skipped, truth = skipped_vs_truth(loaded.draft, kept, written)
    assert skipped == truth and truth


def _state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fixture", ["qwen35", "deepseek"])
def test_the_draft_is_the_same_model_with_and_without_the_skip(
    fixture: str,
    request: pytest.FixtureRequest,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every parameter and buffer of the loaded draft, after vLLM's replacement, equal
    with the skip and without it (``HYBRID_DRAFT_SKIP_REPLACED=0``): the same model, so the
    same proposals."""
    model: Path = request.getfixturevalue(fixture)
    with_skip = load_target_and_draft(engine_config(model))
    skip_on = _state(with_skip.draft)
    (on,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"]
    monkeypatch.setenv("HYBRID_DRAFT_SKIP_REPLACED", "0")
    without = load_target_and_draft(engine_config(model))
    skip_off = _state(without.draft)
    off = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"][-1]
    assert skip_on.keys() == skip_off.keys() and skip_on
    for key in skip_on:
        assert torch.equal(skip_on[key], skip_off[key]), key
    assert on["sources"]["replaced_by_target"]["tensors"] > 0
    assert off["sources"]["replaced_by_target"]["tensors"] == 0
    assert off["tensors"] == on["tensors"] + on["sources"]["replaced_by_target"]["tensors"]
    assert not events.named("hybrid_draft.replaced_fallback")


@pytest.mark.parametrize("in_scope", [True, False], ids=["scope", "first_forward"])
def test_a_head_vllm_did_not_replace_is_loaded_from_the_checkpoint(
    in_scope: bool,
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A vLLM whose proposer keeps the draft's own LM head: the skipped head is loaded from
    the checkpoint before the draft serves (when the load scope closes, or at its first
    forward outside one), with a ``replaced_fallback`` event."""
    from safetensors.torch import load_file
    from vllm.v1.worker.gpu.spec_decode.eagle import utils

    from hybrid_draft.adapter import loadscope

    # vLLM's own test of whether to share, answering "keep the draft's own" for the head.
    real = utils._should_share
    monkeypatch.setattr(
        utils,
        "_should_share",
        lambda draft, flag, *a: flag != "has_own_lm_head" and real(draft, flag, *a),
    )
    head = next(
        load_file(p)["lm_head.weight"]
        for p in sorted(qwen35.glob("*.safetensors"))
        if "lm_head.weight" in load_file(p)
    )
    if in_scope:
        with loadscope.scope():
            loaded = load_target_and_draft(engine_config(qwen35))
            assert not events.named("hybrid_draft.replaced_fallback")  # not yet: in scope
    else:
        loaded = load_target_and_draft(engine_config(qwen35))
        assert not events.named("hybrid_draft.replaced_fallback")
        (load,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"]
        replaced = load["sources"]["replaced_by_target"]  # the head was not read
        assert replaced["bytes"] >= head.numel() * head.element_size() and replaced["tensors"]
        # What the skipped head holds until then is whatever memory it was given (possibly
        # a freed copy of the same values): make it plainly not the checkpoint's.
        loaded.draft.lm_head.weight.data.fill_(float("nan"))
        hooks = list(loaded.draft._forward_pre_hooks.values())
        assert len(hooks) == 1
        hooks[0](loaded.draft, ())  # what the draft's first forward runs first
        assert not loaded.draft._forward_pre_hooks
    assert loaded.draft.lm_head is not loaded.target.lm_head
    assert torch.equal(loaded.draft.lm_head.weight.detach(), head.float())
    (fallback,) = events.named("hybrid_draft.replaced_fallback")
    assert fallback["names"] == ["lm_head.weight"] and fallback["parameters"] == ["lm_head.weight"]
    assert fallback["bytes"] == head.numel() * head.element_size()
    # The embedding was replaced as usual: it stays the target's.
    assert loaded.draft.model.embed_tokens is loaded.target.model.embed_tokens


def test_a_draft_class_that_keeps_its_own_head_reads_it(vllm_runtime: Any) -> None:
    """Step-3.5's MTP declares ``has_own_lm_head``: vLLM compares its head with the target's
    before sharing, so the head must be read; only the embedding is skipped."""
    from vllm.model_executor.models.step3p5_mtp import Step3p5MTP

    from hybrid_draft.adapter import sharing

    assert Step3p5MTP.has_own_lm_head is True
    assert sharing.expected(Step3p5MTP, 1, "mtp", True) == {"embed"}
    # Pipeline parallelism keeps the embedding too; a standalone draft shares nothing.
    assert sharing.expected(Step3p5MTP, 2, "mtp", True) == frozenset()
    assert sharing.expected(Step3p5MTP, 1, "draft_model", False) == frozenset()
