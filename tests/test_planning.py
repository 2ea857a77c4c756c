"""The draft plan's pure core: which tensors a draft reads, from where, within a hold budget.
No vLLM: shard headers written here, rules as plain functions."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybrid_draft.core import checkpoint, planning
from hybrid_draft.tools import modes, synth

pytestmark = pytest.mark.once  # the same on every vLLM release (docs/testing.md)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("model.embed_tokens.weight", "embed"),
        ("model.layers.61.embed_tokens.weight", "embed"),
        ("model.mtp.embed_tokens.weight", "embed"),
        ("model.word_embeddings.weight", "embed"),
        ("decoder.embed_tokens.weight", "embed"),
        ("lm_head.weight", "head"),
        ("language_model.lm_head.weight", "head"),
        ("model.layers.61.shared_head.head.weight", "head"),
        ("model.layers.61.shared_head.norm.weight", None),
        ("mtp.pre_fc_norm_embedding.weight", None),
        ("mtp.fc_embedding.weight", None),
        ("model.mtp.layers.0.embed_norm.weight", None),
        ("model.layers.2.shared_head.output.weight", None),
        ("decoder.extra_heads.0.weight", None),
        ("embed_tokens", None),
        ("", None),
    ],
)
def test_shared_kind_by_name(name: str, kind: str | None) -> None:
    assert planning.shared_kind(name) == kind


@pytest.fixture(scope="module")
def deepseek_plan(tmp_path_factory: pytest.TempPathFactory) -> planning.DraftPlan:
    layout = synth.deepseek_v3("tiny", moe=False)
    out = tmp_path_factory.mktemp("plan") / "ds"
    synth.write_checkpoint(out, layout, synth.shard(layout, num_shards=3, mtp_own_shard=True))
    kept = set(layout.is_mtp) | {"model.embed_tokens.weight"}
    return planning.DraftPlan(
        tuple(checkpoint.read_checkpoint(out)),
        draft_class="DeepSeekMTP",
        rule_source="hybrid-draft",
        rule=lambda name: name not in kept,
        shared=frozenset({"embed", "head"}),
    )


def test_the_plan_splits_what_the_draft_keeps_into_read_and_replaced(
    deepseek_plan: planning.DraftPlan,
) -> None:
    plan = deepseek_plan
    kept = {t.name for t in plan.kept}
    assert set(plan.replaced) == {
        "model.embed_tokens.weight",
        "model.layers.2.embed_tokens.weight",
        "model.layers.2.shared_head.head.weight",
    }
    selection = plan.selection()
    assert set(selection.names) == kept - set(plan.replaced)
    assert [Path(f).name for f in selection.files] == ["model-00003-of-00003.safetensors"]
    # Without the skip, every kept tensor, the embedding's shard too.
    assert set(plan.selection(replaced=()).names) == kept
    sources = plan.sources()
    sizes = {t.name: t.nbytes for t in plan.kept}
    assert sources["replaced_by_target"] == {
        "tensors": 3,
        "bytes": sum(sizes[n] for n in plan.replaced),
    }
    assert sources["storage"]["tensors"] == len(kept) - 3
    assert sources["stream"] == {"tensors": 0, "bytes": 0}


def test_the_hold_budget_decides_stream_against_storage(
    deepseek_plan: planning.DraftPlan,
) -> None:
    plan = deepseek_plan
    own = [t for t in plan.kept if t.name not in plan.replaced]
    everything = sum(t.nbytes for t in own)
    assert [t.name for t in plan.holdable(everything)] == [t.name for t in own]
    assert plan.holdable(0) == []
    half = plan.holdable(everything // 2)
    assert 0 < sum(t.nbytes for t in half) <= everything // 2
    rows = modes.rows(plan, hold_budget=everything // 2)
    one = rows["one_pass"]
    assert one.extra["stream"] == planning.counts(half)
    assert one.nbytes == everything - one.extra["stream"]["bytes"]
    assert modes.rows(plan, hold_budget=everything)["one_pass"].nbytes == 0
    assert plan.sources(t.name for t in half)["stream"] == planning.counts(half)


def test_a_class_that_keeps_its_own_head_reads_it(deepseek_plan: planning.DraftPlan) -> None:
    from dataclasses import replace

    plan = replace(deepseek_plan, shared=frozenset({"embed"}))
    assert set(plan.replaced) == {
        "model.embed_tokens.weight",
        "model.layers.2.embed_tokens.weight",
    }
    assert "model.layers.2.shared_head.head.weight" in plan.selection().names


def test_without_a_rule_nothing_is_planned(deepseek_plan: planning.DraftPlan) -> None:
    from dataclasses import replace

    plan = replace(deepseek_plan, rule=None, rule_source="none")
    assert plan.kept == () and plan.replaced == {}
    assert plan.selective_blocker == (
        "no_rule",
        "DeepSeekMTP has no checkpoint-weight rule to plan its tensors with",
    )
    assert "one_pass" not in modes.rows(plan, hold_budget=1 << 30)
    assert modes.rows(plan)["auto"].tensors is None
    assert [w["code"] for w in plan.warnings()] == ["no_rule"]


def test_planning_imports_no_vllm() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, hybrid_draft.core.planning; "
            "print('vllm' in sys.modules, 'torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["False", "False"]
