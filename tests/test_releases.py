"""Every part on, on whichever supported vLLM release is installed (0.33.0 or 0.34.0).

Real vLLM on the CPU: an InstantTensor target through ``get_model``, then a same-checkpoint
MTP draft through each draft route this release has (the V1 ``EagleProposer`` where it
still exists, model runner v2's ``load_eagle_model`` on both), inside the load scope a model
runner opens. The draft takes its tensors from the target's stream, skips the ones vLLM
replaces, reads nothing from storage, and no part is reported off. vLLM's InstantTensor
iterator is the only stand-in (conftest).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import (
    Events,
    Recorder,
    checkpoint_tensors,
    draft_tensors,
    engine_config,
    load_target_and_draft,
)

# vLLM 0.34's CPU platform builds a config on x86 only where Triton reports an active
# driver; with no GPU visible the CUDA build's Triton passes that check (0.33 never asks).
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

pytestmark = pytest.mark.vllm

#: vLLM's draft routes: the V1 proposer (gone in 0.34) and model runner v2's.
ROUTES = {"eagle": "vllm.v1.spec_decode.eagle", "mrv2_eagle": "vllm.v1.worker.gpu.spec_decode"}


def route_or_skip(route: str) -> str:
    if importlib.util.find_spec(ROUTES[route]) is None:
        pytest.skip(f"this vLLM has no {ROUTES[route]}")
    return route


def test_every_part_is_on(vllm_runtime: Any) -> None:
    """Each part of the layer is on here, and doctor says so, one line per part."""
    from hybrid_draft.adapter import internals, parts
    from hybrid_draft.tools import doctor

    states = parts.states()
    assert [s.part for s in states] == list(internals.PARTS)
    assert [s.part for s in states if not s.on] == [], states
    assert internals.vllm_version() in internals.SUPPORTED_RELEASES
    for check in doctor.CHECKS:
        if isinstance(check, doctor.PartCheck):
            ok, line = doctor.isolated(check)
            assert ok and line.startswith(f"part {check.part}: on ("), line


@pytest.mark.parametrize("route", list(ROUTES))
def test_the_draft_reads_nothing_from_storage(
    route: str,
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
    lazy_spy: Recorder,
) -> None:
    from hybrid_draft.adapter import loadscope

    with loadscope.scope():
        loaded = load_target_and_draft(engine_config(deepseek), route_or_skip(route))
    own = draft_tensors(deepseek, loaded.draft)
    replaced = draft_tensors(deepseek, loaded.draft, replaced=True)
    assert own and replaced
    # One read of the checkpoint: the target's pass. The draft opened no shard.
    assert len(instanttensor_standin.calls) == 1
    assert filtered_reads.calls == [] and lazy_spy.calls == []
    assert events.named("hybrid_draft.part_skipped") == []
    (target,) = events.decisions("target")
    assert target["one_pass"]["enabled"] is True
    (draft,) = events.decisions("draft")
    assert draft["action"] == "switched" and "sources_detail" not in draft
    (load,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"]
    assert load["sources"] == {
        "storage": {"tensors": 0, "bytes": 0},
        "stream": {"tensors": len(own), "bytes": sum(own.values())},
        "replaced_by_target": {"tensors": len(replaced), "bytes": sum(replaced.values())},
    }
    assert not events.named("hybrid_draft.replaced_fallback")
    # The draft holds the checkpoint's values, and the target's embedding and head.
    ckpt = checkpoint_tensors(deepseek)
    params = dict(loaded.draft.named_parameters())
    for name in own:
        if name in params:
            assert torch.equal(params[name].detach(), ckpt[name].float()), name
    n = loaded.config.model_config.hf_config.num_hidden_layers
    assert loaded.draft.model.embed_tokens is loaded.target.model.embed_tokens
    assert loaded.draft.model.layers[str(n)].shared_head.head is loaded.target.lm_head


def test_a_draft_that_skips_nothing_says_why(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Outside a load scope and with the skip turned off, the draft's decision says why
    it takes nothing from the stream and skips nothing."""
    monkeypatch.setenv("HYBRID_DRAFT_SKIP_REPLACED", "0")
    route = "eagle" if importlib.util.find_spec(ROUTES["eagle"]) else "mrv2_eagle"
    load_target_and_draft(engine_config(deepseek), route)
    (draft,) = events.decisions("draft")
    assert draft["sources"]["stream"]["tensors"] == 0
    assert draft["sources"]["replaced_by_target"]["tensors"] == 0
    assert draft["sources_detail"] == {
        "stream": "no_load_scope: the draft was not loaded inside a model runner's load_model",
        "replaced_by_target": "skip_replaced_off: the skip_replaced setting is off",
    }


def test_a_quantized_copy_of_the_targets_head_replaces_the_drafts_own(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
) -> None:
    """``draft_lm_head_quantization``: model runner v2 installs a quantized copy of the
    target's head in the draft (its ``lm_head`` and each MTP layer's ``shared_head.head``),
    so the draft's own head is replaced all the same: it is skipped, never read, and the
    draft serves with the copy."""
    # (vLLM quantizes a copy of an unquantized bfloat16 or float16 head only. In bfloat16,
    # vLLM's AMX paths would take kernels the CUDA build lacks: the in-process load takes
    # CPU_MLA and no AMX path on every host, as every in-process load does: tests/hostcpu.py.)
    spec = {"method": "mtp", "num_speculative_tokens": 1, "draft_lm_head_quantization": "fp8"}
    from hybrid_draft.adapter import loadscope

    config = engine_config(deepseek, speculative_config=spec, dtype="bfloat16")
    with loadscope.scope():
        loaded = load_target_and_draft(config, route_or_skip("mrv2_eagle"))
    replaced = draft_tensors(deepseek, loaded.draft, replaced=True)
    (load,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"]
    assert load["sources"]["replaced_by_target"] == {
        "tensors": len(replaced),
        "bytes": sum(replaced.values()),
    }
    assert load["sources"]["storage"] == {"tensors": 0, "bytes": 0}
    assert not events.named("hybrid_draft.replaced_fallback")
    read = {t for c in filtered_reads.calls for t in c["tensors"]}
    assert not read & set(replaced)
    n = loaded.config.model_config.hf_config.num_hidden_layers
    head = loaded.draft.model.layers[str(n)].shared_head.head
    assert head is loaded.draft.lm_head and head is not loaded.target.lm_head
