"""``hybrid-draft plan`` against generated layouts, checked against the shards themselves
(read with safetensors' own ``safe_open``, not with the plan's header reader)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybrid_draft import synth

pytestmark = pytest.mark.vllm

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E4M3FN": 1}


def plan_json(model: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "hybrid_draft.cli", "plan", str(model), "--json"],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    return json.loads(out.stdout)


def shard_contents(model: Path) -> dict[str, dict[str, int]]:
    """Per shard file: tensor name -> bytes, from safetensors' safe_open."""
    from safetensors import safe_open

    out: dict[str, dict[str, int]] = {}
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(path, framework="numpy") as f:
            sizes = {}
            for name in f.keys():  # noqa: SIM118
                piece = f.get_slice(name)
                n = DTYPE_BYTES[piece.get_dtype()]
                for d in piece.get_shape():
                    n *= d
                sizes[name] = n
        out[path.name] = sizes
    return out


def expected(contents: dict[str, dict[str, int]], unused: Any, stock: Any) -> dict[str, Any]:
    def prune(rule: Any) -> list[str]:
        if rule is None:
            return list(contents)
        kept = [s for s, t in contents.items() if not all(rule(n) for n in t)]
        return kept or list(contents)

    def reads(shards: list[str], keep: Any, opens_all: bool = True) -> dict[str, Any]:
        sizes = [b for s in shards for n, b in contents[s].items() if keep(n)]
        opened = sum(len(contents[s]) for s in shards)
        return {"shards": shards, "tensors": len(sizes), "bytes": sum(sizes),
                "touched_tensors": opened if opens_all else len(sizes)}

    keep = lambda n: not unused(n)  # noqa: E731
    return {
        "instanttensor": reads(prune(stock), lambda n: True),
        "instanttensor_pruned": reads(prune(unused), lambda n: True),
        "lazy": reads(prune(stock), keep),
        "lazy_pruned": reads(prune(unused), keep),
        "selective": reads([s for s, t in contents.items() if any(keep(n) for n in t)], keep,
                           opens_all=False),
    }


def qwen35_rule(name: str) -> bool:  # vLLM's own Qwen3_5MTP.is_unused_checkpoint_weight
    return not name.startswith("mtp.") and not any(k in name for k in ("embed_tokens", "lm_head"))


def spec_rule(model: Path, top: tuple[str, ...]) -> Any:
    cfg = json.loads((model / "config.json").read_text())
    base, n = cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]

    def unused(name: str) -> bool:
        layers = [base + i for i in range(n) if name.startswith(f"model.layers.{base + i}.")]
        return not layers and name not in top
    return unused


def test_plan_qwen35_uses_vllms_own_rule(qwen35: Path) -> None:
    result = plan_json(qwen35)
    contents = shard_contents(qwen35)
    assert (result["draft_class"], result["rule_source"]) == ("Qwen3_5MTP", "vllm")
    assert result["modes"] == expected(contents, qwen35_rule, qwen35_rule)
    assert result["checkpoint"] == {"shards": 3, "tensors": sum(map(len, contents.values())),
                                    "bytes": sum(sum(t.values()) for t in contents.values())}
    assert result["auto"] == {"action": "switched", "reason": "same_checkpoint",
                              "chosen_format": "safetensors"}


@pytest.mark.parametrize(("name", "layout", "top", "cls"), [
    ("plan-deepseek-moe", lambda: synth.deepseek_v3("tiny"), ("model.embed_tokens.weight",),
     "DeepSeekMTP"),
    ("plan-glm", lambda: synth.glm4_moe("tiny"),
     ("model.embed_tokens.weight", "lm_head.weight"), "Glm4MoeMTP"),
])
def test_plan_with_the_projects_rules(name: str, layout: Any, top: tuple[str, ...], cls: str,
                                      ckpt_root: Path) -> None:
    model = ckpt_root / name
    if not model.exists():
        lay = layout()
        synth.write_checkpoint(model, lay, synth.shard(lay, num_shards=5))
    result = plan_json(model)
    assert (result["draft_class"], result["rule_source"]) == (cls, "hybrid-draft")
    contents = shard_contents(model)
    assert result["modes"] == expected(contents, spec_rule(model, top), None)
    # Stock vLLM reads every shard; pruning and selective read fewer.
    assert len(result["modes"]["lazy"]["shards"]) == 5
    assert len(result["modes"]["selective"]["shards"]) < 5


def test_plan_full_size_deepseek_v3_layout(ckpt_root: Path) -> None:
    """163 shards, 91,991 tensors, 688 GB of FP8 weights; headers only (sparse files)."""
    model = ckpt_root / "deepseek-v3-full"
    layout = synth.deepseek_v3("full", fp8=True)
    if not model.exists():
        synth.write_checkpoint(model, layout, synth.shard(layout, num_shards=163), fill="sparse")
    result = plan_json(model)
    contents = shard_contents(model)
    assert result["checkpoint"] == {"shards": 163, "tensors": 91991, "bytes": layout.nbytes}
    assert len(contents) == 163 and sum(map(len, contents.values())) == 91991

    # From the layout alone: the draft reads the MTP layer and the top-level embedding.
    draft_names = set(layout.is_mtp) | {"model.embed_tokens.weight"}
    draft_shards = sorted(s for s, t in contents.items() if draft_names & t.keys())
    draft_bytes = sum(t.nbytes for t in layout.tensors if t.name in draft_names)
    modes = result["modes"]
    assert modes["selective"] == {"shards": draft_shards, "tensors": len(draft_names),
                                  "bytes": draft_bytes, "touched_tensors": len(draft_names)}
    pruned = {k: v for k, v in modes["lazy_pruned"].items() if k != "touched_tensors"}
    assert pruned == {k: v for k, v in modes["selective"].items() if k != "touched_tensors"}
    assert modes["lazy"]["tensors"] == len(draft_names) and len(modes["lazy"]["shards"]) == 163
    assert modes["lazy"]["touched_tensors"] == 91991
    assert modes["instanttensor"] == {"shards": sorted(contents), "tensors": 91991,
                                      "bytes": layout.nbytes, "touched_tensors": 91991}
    assert modes["instanttensor_pruned"]["shards"] == draft_shards
    assert len(draft_shards) <= 6 and draft_bytes < 0.03 * layout.nbytes


def test_plan_human_table(qwen35: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "hybrid_draft.cli", "plan", str(qwen35)],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}).stdout
    assert "Qwen3_5MTP" in out and "weight rule: vllm" in out
    for mode in ("instanttensor", "instanttensor_pruned", "lazy", "lazy_pruned", "selective"):
        assert any(line.startswith(mode + " ") for line in out.splitlines()), mode


def test_plan_for_a_checkpoint_without_mtp(qwen3_pair: tuple[Path, Path]) -> None:
    result = plan_json(qwen3_pair[0])
    assert (result["draft_class"], result["rule_source"]) == (None, "none")
    assert result["modes"]["selective"]["tensors"] == 0


def test_plan_rejects_a_directory_without_shards(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "hybrid_draft.cli", "plan", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "no model.safetensors.index.json" in out.stderr


def test_header_reader_matches_safe_open(deepseek: Path) -> None:
    from hybrid_draft import checkpoint

    contents = shard_contents(deepseek)
    for shard in checkpoint.read_checkpoint(deepseek):
        assert {t.name: t.nbytes for t in shard.tensors} == contents[shard.name]
