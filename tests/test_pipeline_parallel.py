"""Pipeline parallelism in real vLLM on the CPU: a draft exists on the last stage only, so
a draft that keeps InstantTensor must not read with vLLM's world group (InstantTensor would
all-reduce over ranks that never load it). The stand-ins are the usual ones: vLLM's
InstantTensor iterator, and ``instanttensor.safe_open`` for the layer's own reader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import (
    Events,
    Recorder,
    checkpoint_tensors,
    engine_config,
    load_target_and_draft,
    rule_keeps,
)
from hybrid_draft.core import checkpoint

pytestmark = pytest.mark.vllm


def _draft_loader(draft: dict[str, Any]) -> tuple[Any, ...]:
    return (
        draft["chosen_format"],
        draft["action"],
        draft["reason"],
        draft.get("pipeline_parallel_size"),
        draft.get("process_group"),
    )


def test_with_pp_2_an_instanttensor_draft_reads_without_the_world_group(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.model_executor.model_loader import default_loader

    from hybrid_draft.core import policy

    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", "instanttensor")
    used: list[str] = []
    real = default_loader.DefaultModelLoader._get_weights_iterator

    def spy(self: Any, source: Any) -> Any:
        used.append(type(self).__name__)
        return real(self, source)

    monkeypatch.setattr(default_loader.DefaultModelLoader, "_get_weights_iterator", spy)
    loaded = load_target_and_draft(engine_config(deepseek, pipeline_parallel_size=2))
    target, draft = events.decisions()
    assert target["reason"] == "target_model" and "process_group" not in target
    assert _draft_loader(draft) == ("instanttensor", "kept", "mode_instanttensor", 2, "none")
    assert [e["load_format"] for e in events.named("hybrid_draft.loaded")] == [
        "instanttensor",
        "instanttensor",
    ]
    # The target by vLLM's own loader; the draft by the layer's, which (off CUDA) hands the
    # read to vLLM's InstantTensor iterator: the same pruned shards as without PP.
    assert used == ["DefaultModelLoader", "UngroupedInstantTensorLoader"]
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    assert type(get_model_loader(LoadConfig(load_format=policy.UNGROUPED))).__name__ == (
        "UngroupedInstantTensorLoader"
    )
    keeps = rule_keeps(deepseek, loaded.draft)
    shards = checkpoint.read_checkpoint(deepseek)
    pruned = sorted(s.path.name for s in shards if any(t.name in keeps for t in s.tensors))
    assert instanttensor_standin.files() == [sorted(s.path.name for s in shards), pruned]
    values = checkpoint_tensors(deepseek)
    params = dict(loaded.draft.named_parameters())
    n = loaded.config.speculative_config.draft_model_config.hf_config.num_hidden_layers
    name = f"model.layers.{n}.eh_proj.weight"
    assert torch.equal(params[name].detach(), values[name].float())


def test_without_pp_the_same_draft_keeps_vllms_own_loader(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", "instanttensor")
    load_target_and_draft(engine_config(deepseek))
    _, draft = events.decisions()
    assert _draft_loader(draft) == ("instanttensor", "kept", "mode_instanttensor", None, None)


@pytest.mark.parametrize("mode", ["auto", "safetensors", "selective"])
def test_with_pp_2_the_other_modes_need_no_guard(
    mode: str,
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Their drafts read lazily (the selective one falls back here, for want of CUDA;
    on CUDA it streams with ``process_group=None``): nothing to join, nothing changed."""
    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", mode)
    load_target_and_draft(engine_config(deepseek, pipeline_parallel_size=2))
    _, draft = events.decisions()
    assert draft["chosen_format"] == "safetensors" and "process_group" not in draft
    assert len(instanttensor_standin.calls) == 1  # the target's pass only


def test_with_pp_2_a_standalone_draft_kept_by_auto_reads_without_the_world_group(
    qwen3_pair: tuple[Path, Path],
    events: Events,
    instanttensor_standin: Recorder,
) -> None:
    """``auto`` keeps InstantTensor for a draft with its own checkpoint. vLLM builds that
    draft's config with a pipeline size of 1; the target's says 2."""
    target_dir, draft_dir = qwen3_pair
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 1}
    config = engine_config(target_dir, speculative_config=spec, pipeline_parallel_size=2)
    load_target_and_draft(config, route="draft_model")
    _, draft = events.decisions()
    assert _draft_loader(draft) == ("instanttensor", "kept", "different_checkpoint", 2, "none")
    assert instanttensor_standin.files()[1] == sorted(
        p.name for p in draft_dir.glob("*.safetensors")
    )


class SafeOpen:
    """Stands in for ``instanttensor.safe_open`` (CUDA only): records its arguments, then
    yields the (filtered) tensors read with safetensors."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, filename: list[str], **kwargs: Any) -> Any:
        self.calls.append({"files": [Path(f).name for f in filename], **kwargs})
        wanted = kwargs.get("tensor_filter")

        class Handle:
            total_tensor_size = 0

            def __enter__(self) -> Any:
                return self

            def __exit__(self, *exc: Any) -> None:
                return None

            def tensors(self) -> Any:
                from safetensors import safe_open

                for path in filename:
                    with safe_open(path, framework="pt") as f:
                        for name in f.keys():  # noqa: SIM118
                            if wanted is None or name in wanted:
                                yield name, f.get_tensor(name)

        return Handle()


@pytest.mark.parametrize("experts", [None, {0}])
def test_the_ungrouped_reader_is_vllms_read_with_no_process_group(
    experts: set[int] | None,
    glm: Path,
    vllm_runtime: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the layer's InstantTensor reader asks of InstantTensor on CUDA: vLLM's own
    arguments (``copy=True``, exact names, other ranks' experts filtered), but never a
    process group."""
    import instanttensor
    from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight

    from hybrid_draft.adapter import internals
    from hybrid_draft.core import readers

    recorder = SafeOpen()
    monkeypatch.setattr(instanttensor, "safe_open", recorder)
    files = sorted(str(p) for p in glm.glob("*.safetensors"))
    out = dict(
        readers.instanttensor_ungrouped_iterator(
            files,
            torch.device("cpu"),
            local_expert_ids=experts,
            should_skip_weight=internals.should_skip_weight,
        )
    )
    (call,) = recorder.calls
    assert call["process_group"] is None and call["copy"] is True
    assert call["tensor_name_match_mode"] == "exact" and call["device"] == torch.device("cpu")
    every = {t.name for s in checkpoint.read_checkpoint(glm) for t in s.tensors}
    if experts is None:
        assert call["tensor_filter"] is None and set(out) == every
    else:
        kept = {n for n in every if not should_skip_weight(n, experts)}
        assert set(call["tensor_filter"]) == set(out) == kept and kept < every
