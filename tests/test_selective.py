"""The ``selective`` mode: its fallback on this CPU host, and the exact InstantTensor call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import Events, Recorder, engine_config, load_target_and_draft, rule_keeps
from hybrid_draft.adapter.rules import deepseek_mtp_unused
from hybrid_draft.core import checkpoint, readers

pytestmark = pytest.mark.vllm

#: DeepSeek-V3's draft tensors behind the modules vLLM replaces with the target's: the
#: top-level and the MTP layer's embedding, and the MTP layer's shared head.
REPLACED_BY_TARGET = ("embed_tokens.weight", "shared_head.head.weight")


def test_selective_falls_back_to_lazy_without_cuda(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    lazy_spy: Recorder,
    filtered_reads: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", "selective")
    loaded = load_target_and_draft(engine_config(deepseek))
    (draft,) = events.decisions("draft")
    assert (draft["action"], draft["reason"], draft["chosen_format"]) == (
        "switched",
        "selective_fallback",
        "safetensors",
    )
    assert (draft["fallback"], draft["detail"]) == (
        "no_cuda",
        "CUDA is not available (vLLM platform: cpu)",
    )
    # The fallback is the filtered lazy path: only the MTP layer's shard, and in it only
    # the tensors the DeepSeekMTP rule keeps but the embeddings and the shared head, which
    # vLLM replaces with the target's (the top-level embedding's shard is never opened).
    assert not lazy_spy.calls and draft["tensor_filter"] is True
    keeps = rule_keeps(deepseek, loaded.draft)
    replaced = {n for n in keeps if n.endswith(REPLACED_BY_TARGET)}
    assert "model.embed_tokens.weight" in replaced and len(replaced) == 3
    assert [c["file"] for c in filtered_reads.calls] == ["model-00003-of-00003.safetensors"]
    assert sorted(n for c in filtered_reads.calls for n in c["tensors"]) == sorted(keeps - replaced)


def test_selective_falls_back_for_a_draft_class_without_a_rule(
    qwen3_pair: tuple[Path, Path],
    events: Events,
    instanttensor_standin: Recorder,
    lazy_spy: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", "selective")
    target, _ = qwen3_pair
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 1}
    load_target_and_draft(engine_config(target, speculative_config=spec), route="draft_model")
    (draft,) = events.decisions("draft")
    assert (draft["reason"], draft["fallback"]) == ("selective_fallback", "no_rule")
    assert draft["detail"] == (
        "Qwen3ForCausalLM has no checkpoint-weight rule to plan its tensors with"
    )
    assert draft["tensor_filter"] is False


def test_tensor_filter_support_is_detected(
    vllm_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import instanttensor

    from hybrid_draft.adapter import draftplan

    assert draftplan.tensor_filter_supported() is None  # the pinned 0.2.2

    def older_safe_open(
        filename: Any, framework: str, device: Any, process_group: Any = None, *, copy: bool = True
    ) -> None:  # 0.2.1's signature
        raise AssertionError("never called")

    monkeypatch.setattr(instanttensor, "safe_open", older_safe_open)
    assert "has no tensor_filter (0.2.2 or later has)" in draftplan.tensor_filter_supported()


def test_an_empty_plan_is_a_fallback_reason(deepseek: Path, ckpt_root: Path) -> None:
    """A draft checkpoint holding nothing the draft class loads (no MTP layer, no embedding)."""
    from vllm.config import set_current_vllm_config

    from hybrid_draft.adapter import calls, draftplan
    from hybrid_draft.tools import synth

    layout = synth.deepseek_v3("tiny", moe=False)
    body = [
        t
        for t in layout.tensors
        if t.name not in layout.is_mtp and t.name != "model.embed_tokens.weight"
    ]
    empty = ckpt_root / "deepseek-no-draft-tensors"
    if not empty.exists():
        synth.write_checkpoint(empty, layout, [body])
    spec = {"method": "mtp", "num_speculative_tokens": 1, "model": str(empty)}
    config = engine_config(deepseek, speculative_config=spec)
    draft = config.speculative_config.draft_model_config
    with set_current_vllm_config(config):
        plan = draftplan.for_call(calls.Call.resolve(config, draft))
    assert plan is not None and not plan.kept
    assert plan.selective_blocker == (
        "empty_plan",
        "the DeepSeekMTP rule keeps none of the checkpoint's tensors",
    )


class SafeOpenRecorder:
    """Stands in for ``instanttensor.safe_open`` (CUDA only): records its arguments and
    yields the filtered tensors, read with safetensors, in file order."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self,
        filename: list[str],
        framework: str,
        device: Any,
        process_group: Any = None,
        **kwargs: Any,
    ) -> Any:
        self.calls.append(
            {
                "files": [Path(f).name for f in filename],
                "framework": framework,
                "device": device,
                "process_group": process_group,
                **kwargs,
            }
        )
        recorder = self

        class Handle:
            total_tensor_size = 0

            def __enter__(self) -> Any:
                return self

            def __exit__(self, *exc: Any) -> None:
                return None

            def tensors(self) -> Any:
                from safetensors import safe_open

                wanted = set(recorder.calls[-1]["tensor_filter"])
                for path in sorted(filename):
                    with safe_open(path, framework="pt", device="cpu") as f:
                        for name in f.keys():  # noqa: SIM118
                            if name in wanted:
                                yield name, f.get_tensor(name).to(device)

        return Handle()


def test_selective_loader_streams_exactly_the_planned_tensors(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The registered loader, reached the way vLLM reaches any loader (here: an explicit
    draft load config), with InstantTensor's reader recorded instead of run."""
    import instanttensor
    from safetensors.torch import load_file

    from hybrid_draft.adapter import loaders

    recorder = SafeOpenRecorder()
    monkeypatch.setattr(instanttensor, "safe_open", recorder)
    loaders.register_all()
    spec = {
        "method": "mtp",
        "num_speculative_tokens": 1,
        "draft_load_config": {"load_format": "instanttensor_selective"},
    }
    loaded = load_target_and_draft(engine_config(deepseek, speculative_config=spec))

    shards = checkpoint.read_checkpoint(deepseek)
    config = loaded.config.speculative_config.draft_model_config.hf_config
    planned = [
        t.name
        for s in shards
        for t in s.tensors
        if not deepseek_mtp_unused(config, t.name) and not t.name.endswith(REPLACED_BY_TARGET)
    ]
    (call,) = recorder.calls
    assert sorted(call["tensor_filter"]) == sorted(planned)
    assert len(set(call["tensor_filter"])) == len(call["tensor_filter"])
    assert call["tensor_name_match_mode"] == "exact"
    assert call["process_group"] is None and call["copy"] is True
    assert call["files"] == sorted(
        {s.path.name for s in shards if any(t.name in planned for t in s.tensors)}
    )
    # Its buffer and I/O depth are the draft's, never InstantTensor's whole-model defaults.
    ordered = [t for s in sorted(shards, key=lambda s: str(s.path)) for t in s.tensors]
    sizes = [t.nbytes for t in ordered if t.name in planned]
    assert {k: call[k] for k in ("buffer_size", "io_depth", "chunk_size")} == (
        readers.selective_sizing(sizes, recorder)
    )
    assert len(call["files"]) < len(shards)

    values = {}
    for f in sorted(deepseek.glob("*.safetensors")):
        values.update(load_file(f))
    params = dict(loaded.draft.named_parameters())
    n = config.num_hidden_layers
    # (the shared head and the embedding are replaced by the target's after loading)
    for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        assert torch.equal(
            params[f"model.layers.{n}.{name}"].detach(), values[f"model.layers.{n}.{name}"].float()
        ), name
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
        assert torch.equal(
            params[f"model.layers.{n}.mtp_block.{name}"].detach(),
            values[f"model.layers.{n}.{name}"].float(),
        ), name
    (draft,) = events.decisions("draft")
    assert (draft["reason"], draft["chosen_format"]) == (
        "explicit_draft_loader",
        "instanttensor_selective",
    )
    assert draft["tensor_filter"] is True
    assert draft["sources"]["replaced_by_target"]["tensors"] == 3


MIB = 1 << 20


def test_the_selective_read_is_sized_to_the_draft(
    deepseek: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The core's selective reader, driven alone with InstantTensor's ``safe_open`` recorded
    (it needs CUDA): the draft's tensors, and a buffer, I/O depth and chunk size of the
    draft's, within what InstantTensor accepts without resizing them."""
    import instanttensor

    recorder = SafeOpenRecorder()
    monkeypatch.setattr(instanttensor, "safe_open", recorder)
    selection = checkpoint.selection(
        checkpoint.read_checkpoint(deepseek), lambda t: ".layers." in t.name
    )
    read = dict(readers.instanttensor_selective_iterator(selection, torch.device("cpu")))
    assert sorted(read) == sorted(selection.names)
    (call,) = recorder.calls
    assert call["files"] == sorted(Path(f).name for f in selection.tensors)
    assert (call["tensor_filter"], call["process_group"]) == (selection.names, None)
    sizes = [t.nbytes for path in sorted(selection.tensors) for t in selection.tensors[path]]
    buffer, depth, chunk = call["buffer_size"], call["io_depth"], call["chunk_size"]
    assert {"buffer_size": buffer, "io_depth": depth, "chunk_size": chunk} == (
        readers.selective_sizing(sizes, recorder)
    )
    assert chunk == readers.SELECTIVE_CHUNK == 8 * MIB
    assert buffer >= max(sizes) and buffer >= depth * chunk  # InstantTensor's two minimums
    assert buffer <= max(sum(sizes), depth * chunk)  # and its maximum: nothing resized
    assert 1 <= depth <= readers.SELECTIVE_MAX_BUFFER // chunk


def test_the_sizing_of_drafts_large_and_small() -> None:
    """The arithmetic alone: a DeepSeek-V3-shaped draft (42 tensors of 1 to 16 MiB, 148 MiB)
    gets tens of MiB and a handful of reads in flight, not InstantTensor's 4 GiB and 512; a
    tiny draft one read; large tensors the cap; a tensor larger than the cap the buffer it
    needs, the depth capped."""

    def safe_open(
        filename: Any,
        framework: str,
        device: Any,
        process_group: Any = None,
        *,
        buffer_size: Any = None,
        io_depth: Any = None,
        chunk_size: Any = None,
        copy: bool = True,
        tensor_filter: Any = None,
        tensor_name_match_mode: str = "glob",
    ) -> None:  # 0.2.2's keywords
        raise AssertionError("never called")

    draft = [16 * MIB] * 8 + [MIB] * 34
    sized = readers.selective_sizing(draft, safe_open)
    assert 3 * 16 * MIB <= sized["buffer_size"] <= 64 * MIB
    assert 4 <= sized["io_depth"] <= 8 and sized["chunk_size"] == 8 * MIB
    assert readers.selective_sizing([4096], safe_open) == {
        "buffer_size": 8 * MIB,
        "io_depth": 1,
        "chunk_size": 8 * MIB,
    }
    huge = readers.selective_sizing([1800 * MIB, 16 * MIB], safe_open)
    assert huge["buffer_size"] == 1800 * MIB and huge["io_depth"] == 32
    large = readers.selective_sizing([200 * MIB] * 4, safe_open)
    assert large["buffer_size"] == 256 * MIB and large["io_depth"] == 32
    assert readers.selective_sizing([], safe_open) == {}


def test_the_sizing_falls_back_where_instanttensor_lacks_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An InstantTensor whose ``safe_open`` lacks an argument is not passed it; one without
    the buffer recommendation gets three times the largest tensor, within the draft's bytes."""
    import instanttensor._impl

    def older_safe_open(
        filename: Any,
        framework: str,
        device: Any,
        process_group: Any = None,
        *,
        buffer_size: Any = None,
        copy: bool = True,
        tensor_filter: Any = None,
        tensor_name_match_mode: str = "glob",
    ) -> None:  # a buffer size, but no io_depth or chunk_size
        raise AssertionError("never called")

    draft = [16 * MIB] * 8 + [MIB] * 34
    assert set(readers.selective_sizing(draft, older_safe_open)) == {"buffer_size"}
    monkeypatch.delattr(instanttensor._impl, "recommended_buffer_size_for_tensors")
    assert readers.selective_sizing(draft, older_safe_open) == {"buffer_size": 48 * MIB}
    # A draft smaller than one read still gets a buffer one read fits in.
    assert readers.selective_sizing([MIB, 2 * MIB], older_safe_open) == {"buffer_size": 8 * MIB}


def test_the_fallback_names_no_platform_when_vllm_detects_none(tmp_path: Path) -> None:
    """Without ``VLLM_TARGET_DEVICE`` on a host without CUDA, vLLM detects no platform (its
    ``device_type`` is empty): the detail says so instead of ending in ``platform: )``."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    env["VLLM_CACHE_ROOT"] = str(tmp_path)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from hybrid_draft.adapter.draftplan import cuda_unavailable;print(cuda_unavailable())",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert out.stdout.strip().splitlines()[-1] == (
        "CUDA is not available (vLLM platform: none detected)"
    )
