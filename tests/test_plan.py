"""``hybrid-draft plan``: its rows checked against the shards themselves (read with
safetensors' own ``safe_open``, not the plan's header reader) and against what real vLLM then
loads; real public layouts (MiMo-7B, an expert-pruned Qwen3.5-MoE); its warnings, at plan
time and in the draft's load-time decision event; one-line errors for every bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import Events, Recorder, engine_config, load_target_and_draft
from hybrid_draft.tools import synth

pytestmark = pytest.mark.vllm

DATA = Path(__file__).parent / "data"
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E4M3FN": 1}
#: The tests run vLLM's CPU platform (conftest): selective falls back for want of CUDA.
HOST_FALLBACK = "no_cuda"
#: The draft tensors behind the modules vLLM's MTP proposer replaces with the target's (the
#: embedding, the LM head, an MTP layer's shared head): the layer's draft paths skip them.
REPLACED = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight")
#: The default hold budget (8 GiB): every tiny draft fits, so one pass reads nothing.
HOLD_BUDGET = 8 << 30


def run_plan(
    model: Path, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hybrid_draft", "plan", str(model), *flags],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", **(env or {})},
    )


def plan_here(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``hybrid-draft plan`` in this process (vLLM is imported once for all such tests)."""
    from hybrid_draft.tools import cli

    capsys.readouterr()
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys: pytest.CaptureFixture[str], model: Path) -> dict[str, Any]:
    code, out, err = plan_here(capsys, str(model), "--json")
    assert code == 0, err[-2000:]
    return json.loads(out)


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


def expected(
    contents: dict[str, dict[str, int]],
    unused: Any,
    stock: Any,
    host_fallback: str | None = HOST_FALLBACK,
) -> dict[str, Any]:
    """Each row from the shard contents and the rules (see plan.py's module doc).

    ``fallback`` is compared, its human ``detail`` is not (see the tests that check it)."""

    def prune(rule: Any) -> list[str]:
        if rule is None:
            return list(contents)
        kept = [s for s, t in contents.items() if not all(rule(n) for n in t)]
        return kept or list(contents)

    def whole(shards: list[str]) -> dict[str, Any]:
        n = sum(len(contents[s]) for s in shards)
        return {
            "shards": shards,
            "tensors": n,
            "touched_tensors": n,
            "bytes": sum(sum(contents[s].values()) for s in shards),
        }

    def lazy(shards: list[str]) -> dict[str, Any]:
        touched = sum(len(contents[s]) for s in shards)
        if unused is None:
            return {"shards": shards, "tensors": None, "bytes": None, "touched_tensors": touched}
        sizes = [b for s in shards for n, b in contents[s].items() if not unused(n)]
        return {
            "shards": shards,
            "tensors": len(sizes),
            "bytes": sum(sizes),
            "touched_tensors": touched,
        }

    if unused is None:
        auto, fallback = lazy(list(contents)), "no_rule"
    else:

        def read(n: str) -> bool:
            return not unused(n) and not n.endswith(REPLACED)

        holding = [s for s, t in contents.items() if any(read(n) for n in t)]
        sizes = [b for s in holding for n, b in contents[s].items() if read(n)]
        auto = (
            {
                "shards": holding,
                "tensors": len(sizes),
                "bytes": sum(sizes),
                "touched_tensors": len(sizes),
            }
            if any(not unused(n) for t in contents.values() for n in t)
            else lazy(prune(unused))
        )
        fallback = host_fallback if auto["shards"] is holding else "empty_plan"
    out = {
        "instanttensor": whole(prune(stock)),
        "instanttensor_pruned": whole(prune(unused)),
        "lazy": lazy(prune(stock)),
        "lazy_pruned": lazy(prune(unused)),
        "auto": auto,
        "selective": {**auto, "fallback": fallback} if fallback else auto,
    }
    if unused is not None and auto["shards"] is holding:
        out["one_pass"] = {
            "shards": [],
            "tensors": 0,
            "bytes": 0,
            "touched_tensors": 0,
            "stream": {"tensors": auto["tensors"], "bytes": auto["bytes"]},
            "hold_budget": HOLD_BUDGET,
        }
    return out


def rows(result: dict[str, Any]) -> dict[str, Any]:
    """The plan's rows without the fallback's human detail."""
    return {m: {k: v for k, v in r.items() if k != "detail"} for m, r in result["modes"].items()}


def qwen35_rule(name: str) -> bool:  # vLLM's own Qwen3_5MTP.is_unused_checkpoint_weight
    return not name.startswith("mtp.") and not any(k in name for k in ("embed_tokens", "lm_head"))


def spec_rule(model: Path, top: tuple[str, ...]) -> Any:
    cfg = json.loads((model / "config.json").read_text())
    base, n = cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]

    def unused(name: str) -> bool:
        layers = [base + i for i in range(n) if name.startswith(f"model.layers.{base + i}.")]
        return not layers and name not in top

    return unused


# --- rows ----------------------------------------------------------------------------------


def test_plan_qwen35_uses_vllms_own_rule(qwen35: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, qwen35)
    contents = shard_contents(qwen35)
    assert (result["draft_class"], result["rule_source"]) == ("Qwen3_5MTP", "vllm")
    assert rows(result) == expected(contents, qwen35_rule, qwen35_rule)
    assert result["checkpoint"] == {
        "shards": 3,
        "tensors": sum(map(len, contents.values())),
        "bytes": sum(sum(t.values()) for t in contents.values()),
    }
    assert result["auto"] == {
        "action": "switched",
        "reason": "same_checkpoint",
        "chosen_format": "safetensors",
        "tensor_filter": True,
    }
    assert result["warnings"] == []
    assert result["modes"]["selective"]["detail"] == "CUDA is not available (vLLM platform: cpu)"


@pytest.mark.parametrize(
    ("name", "layout", "top", "cls"),
    [
        (
            "plan-deepseek-moe",
            lambda: synth.deepseek_v3("tiny"),
            ("model.embed_tokens.weight",),
            "DeepSeekMTP",
        ),
        (
            "plan-glm",
            lambda: synth.glm4_moe("tiny"),
            ("model.embed_tokens.weight", "lm_head.weight"),
            "Glm4MoeMTP",
        ),
    ],
)
def test_plan_with_the_projects_rules(
    name: str,
    layout: Any,
    top: tuple[str, ...],
    cls: str,
    ckpt_root: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = ckpt_root / name
    if not model.exists():
        lay = layout()
        synth.write_checkpoint(model, lay, synth.shard(lay, num_shards=5))
    result = plan_json(capsys, model)
    assert (result["draft_class"], result["rule_source"]) == (cls, "hybrid-draft")
    contents = shard_contents(model)
    assert rows(result) == expected(contents, spec_rule(model, top), None)
    # Stock vLLM reads every shard; pruning, the filtered default path and selective fewer.
    assert len(result["modes"]["lazy"]["shards"]) == 5
    assert len(result["modes"]["auto"]["shards"]) < 5


def test_plan_full_size_deepseek_v3_layout(
    ckpt_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """163 shards, 91,991 tensors, 688 GB of FP8 weights; headers only (sparse files)."""
    model = ckpt_root / "deepseek-v3-full"
    layout = synth.deepseek_v3("full", fp8=True)
    if not model.exists():
        synth.write_checkpoint(model, layout, synth.shard(layout, num_shards=163), fill="sparse")
    result = plan_json(capsys, model)
    contents = shard_contents(model)
    assert result["checkpoint"] == {"shards": 163, "tensors": 91991, "bytes": layout.nbytes}
    assert len(contents) == 163 and sum(map(len, contents.values())) == 91991

    # From the layout alone: the draft keeps the MTP layer and the top-level embedding, and
    # reads them but the embeddings and the shared head, which vLLM replaces.
    draft_names = set(layout.is_mtp) | {"model.embed_tokens.weight"}
    replaced = {n for n in draft_names if n.endswith(REPLACED)}
    read = draft_names - replaced
    sizes = {t.name: t.nbytes for t in layout.tensors}
    draft_shards = sorted(s for s, t in contents.items() if draft_names & t.keys())
    read_shards = sorted(s for s, t in contents.items() if read & t.keys())
    draft_bytes = sum(sizes[n] for n in draft_names)
    modes = result["modes"]
    assert modes["auto"] == {
        "shards": read_shards,
        "tensors": len(read),
        "bytes": sum(sizes[n] for n in read),
        "touched_tensors": len(read),
    }
    assert len(replaced) == 3 and result["replaced_by_target"] == {
        "tensors": 3,
        "bytes": sum(sizes[n] for n in replaced),
        "modules": ["embed", "head"],
        "names": sorted(replaced),
    }
    # A third of what the draft keeps is what vLLM throws away right after loading it.
    assert 0.3 < result["replaced_by_target"]["bytes"] / draft_bytes < 0.35
    assert rows(result)["selective"] == {**modes["auto"], "fallback": HOST_FALLBACK}
    assert modes["lazy_pruned"]["shards"] == draft_shards
    assert modes["lazy_pruned"]["tensors"] == len(draft_names)
    assert modes["lazy_pruned"]["bytes"] == draft_bytes
    assert modes["lazy"]["tensors"] == len(draft_names) and len(modes["lazy"]["shards"]) == 163
    assert modes["lazy"]["touched_tensors"] == 91991
    assert modes["instanttensor"] == {
        "shards": sorted(contents),
        "tensors": 91991,
        "bytes": layout.nbytes,
        "touched_tensors": 91991,
    }
    assert modes["instanttensor_pruned"]["shards"] == draft_shards
    assert len(draft_shards) <= 6 and draft_bytes < 0.03 * layout.nbytes


def test_plan_human_table(qwen35: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan_here(capsys, str(qwen35))
    assert code == 0
    lines = out.splitlines()
    assert "Qwen3_5MTP" in out and "weight rule: vllm" in out and "tensor filter on" in out
    table = {
        line.split()[0]: line
        for line in lines
        if len(line.split()) > 1 and line.split()[1].isdigit()
    }
    assert list(table) == [
        "instanttensor",
        "instanttensor_pruned",
        "lazy",
        "lazy_pruned",
        "auto",
        "selective",
        "one_pass",
    ]
    row = table["selective"]
    assert row.endswith(f"fallback: {HOST_FALLBACK}")
    assert (
        "selective falls back to the auto row here: CUDA is not available (vLLM platform: cpu)"
    ) in lines


# --- every row is what the mode does: real vLLM loads, compared with the plan ------------

#: mode (or a user's explicit lazy draft loader) -> the row that describes it.
LOADS = {
    "auto": "auto",
    "safetensors": "auto",
    "selective": "selective",
    "instanttensor": "instanttensor_pruned",
    "explicit_lazy": "lazy_pruned",
}


@pytest.mark.parametrize(
    ("fixture", "mode"),
    [
        *[("qwen35", m) for m in LOADS],
        ("deepseek", "auto"),
        ("deepseek", "selective"),
    ],
)
def test_each_row_is_what_real_vllm_loads(
    fixture: str,
    mode: str,
    request: pytest.FixtureRequest,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The draft's ``hybrid_draft.loaded`` event (shards opened, tensors yielded to the
    model) and its decision (fallback, tensor filter) against the plan's row for that mode."""
    model: Path = request.getfixturevalue(fixture)
    result = plan_json(capsys, model)
    row = result["modes"][LOADS[mode]]

    spec: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": 1}
    if mode == "explicit_lazy":
        spec["draft_load_config"] = {
            "load_format": "safetensors",
            "safetensors_load_strategy": "lazy",
        }
    else:
        monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", mode)
    load_target_and_draft(engine_config(model, speculative_config=spec))

    (decision,) = events.decisions("draft")
    (loaded,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"]
    assert loaded["shards"] == len(row["shards"])
    assert loaded["tensors"] == row["touched_tensors"]
    assert decision.get("fallback") == row.get("fallback")
    assert decision.get("detail") == row.get("detail")
    if LOADS[mode] == "auto":
        assert decision["tensor_filter"] is result["auto"]["tensor_filter"]
    assert decision["warnings"] == result["warnings"] == []


# --- real public layouts ------------------------------------------------------------------


def _mimo_shape(name: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    """A MiMo-7B tensor's shape from its config (Qwen2-style attention with biases)."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {
        "q_proj.weight": (q, h),
        "k_proj.weight": (kv, h),
        "v_proj.weight": (kv, h),
        "o_proj.weight": (h, q),
        "q_proj.bias": (q,),
        "k_proj.bias": (kv,),
        "v_proj.bias": (kv,),
        "gate_proj.weight": (inter, h),
        "up_proj.weight": (inter, h),
        "down_proj.weight": (h, inter),
        "input_proj.weight": (h, 2 * h),
        "embed_tokens.weight": (vocab, h),
        "lm_head.weight": (vocab, h),
    }
    for suffix, shape in shapes.items():
        if name.endswith(suffix):
            return shape
    assert name.endswith("norm.weight"), name
    return (h,)


@pytest.fixture(scope="session")
def mimo(ckpt_root: Path) -> Path:
    """MiMo-7B as published: its own ``config.json`` (github.com/jj8127/mimo_kor, config.json,
    a copy of XiaomiMiMo/MiMo-7B's with ``num_nextn_predict_layers: 1``) and index
    (jj8127/mimo_kor, model.safetensors.index.json: 4 shards, 451 tensors, the MTP layer as
    ``model.mtp_layers.0.*``), both byte for byte in tests/data/mimo-7b; the shards rebuilt
    headers-only where the index puts each tensor, shapes from the config."""
    out = ckpt_root / "mimo-7b"
    src = DATA / "mimo-7b"
    if not (out / "config.json").exists():
        cfg = json.loads((src / "config.json").read_text())
        weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        shards = [
            [synth.Tensor(n, _mimo_shape(n, cfg)) for n in sorted(weight_map) if weight_map[n] == f]
            for f in files
        ]
        synth.write_checkpoint(
            out, synth.Layout(cfg, [t for s in shards for t in s]), shards, fill="sparse"
        )
        for name in ("config.json", "model.safetensors.index.json"):
            shutil.copy(src / name, out / name)
    return out


def test_mimo_layout_matches_the_published_index(mimo: Path) -> None:
    """The rebuilt shards are where the index says, and their sizes add up to its total."""
    index = json.loads((mimo / "model.safetensors.index.json").read_text())
    contents = shard_contents(mimo)
    assert {n: s for s, t in contents.items() for n in t} == index["weight_map"]
    assert sum(sum(t.values()) for t in contents.values()) == index["metadata"]["total_size"]


def test_plan_mimo_without_remote_code(mimo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``model_type: mimo`` is not one transformers knows and the config names
    ``configuration_mimo.MiMoConfig``: plan reads it as a plain config instead."""
    from hybrid_draft.tools import draftinfo

    result = plan_json(capsys, mimo)
    assert result["draft_class"] == "MiMoMTP"
    # The class's rule, whoever ships it (vLLM 0.33 has none; hybrid-draft may add one).
    draft = draftinfo.mtp_draft(str(mimo))
    contents = shard_contents(mimo)
    assert rows(result) == expected(contents, draft.is_unused, draft.vllm_rule)
    codes = [w["code"] for w in result["warnings"]]
    assert codes[0] == "needs_trust_remote_code"
    assert "configuration_mimo.MiMoConfig" in result["warnings"][0]["detail"]
    assert ("no_rule" in codes) == (draft.is_unused is None) == (result["rule_source"] == "none")
    assert "no_draft_tensors" not in codes
    if draft.is_unused is not None:
        # The draft keeps the MTP layer and the shared embedding and head, nothing else:
        # the names MiMoMTP.load_weights lets through ("mtp_layers", "embed_tokens",
        # "lm_head"), 18 of the 451.
        kept = {n for t in contents.values() for n in t if not draft.is_unused(n)}
        assert kept == {
            n
            for t in contents.values()
            for n in t
            if any(k in n for k in ("mtp_layers", "embed_tokens", "lm_head"))
        }
        # The embedding and the LM head are the target's once the draft is loaded.
        replaced = {"model.embed_tokens.weight", "lm_head.weight"}
        assert replaced <= kept and result["replaced_by_target"]["names"] == sorted(replaced)
        assert result["modes"]["auto"]["tensors"] == len(kept - replaced) < 451


def test_plan_runs_checkpoint_code_only_when_trusted(mimo: Path, tmp_path: Path) -> None:
    """A ``configuration_mimo.py`` beside the config, which leaves a mark when it runs."""
    model = tmp_path / "mimo"
    model.mkdir()
    for f in mimo.iterdir():  # hard links: a symbolic link out of the checkpoint is refused
        os.link(f, model / f.name)
    mark = tmp_path / "configuration-code-ran"
    (model / "configuration_mimo.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(mark)!r}).write_text('ran')\n"
        "from transformers import Qwen2Config\n\n\n"
        "class MiMoConfig(Qwen2Config):\n"
        "    model_type = 'mimo'\n"
    )
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}

    untrusted = run_plan(model, "--json", env=env)
    assert untrusted.returncode == 0, untrusted.stderr[-2000:]
    assert not mark.exists()
    assert json.loads(untrusted.stdout)["warnings"][0]["code"] == "needs_trust_remote_code"

    trusted = run_plan(model, "--json", "--trust-remote-code", env=env)
    assert trusted.returncode == 0, trusted.stderr[-2000:]
    assert mark.read_text() == "ran"
    result = json.loads(trusted.stdout)
    assert result["draft_class"] == "MiMoMTP"
    assert "needs_trust_remote_code" not in [w["code"] for w in result["warnings"]]


def _qwen35_moe_text_tensors(cfg: dict[str, Any]) -> list[synth.Tensor]:
    """The tensors of a Qwen3.5-MoE text export, named as its index names them, shaped by
    its config (under ``model.language_model.``; no ``mtp.*``: see the fixture)."""
    h, vocab, experts = cfg["hidden_size"], cfg["vocab_size"], cfg["num_experts"]
    mi, si = cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    kd = cfg["linear_key_head_dim"] * cfg["linear_num_key_heads"]
    vd = cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"]
    nv, hd = cfg["linear_num_value_heads"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    t, p = synth.Tensor, "model.language_model."
    out = [t(f"{p}embed_tokens.weight", (vocab, h))]
    for i, kind in enumerate(cfg["layer_types"]):
        layer = f"{p}layers.{i}."
        out.append(t(f"{layer}input_layernorm.weight", (h,)))
        if kind == "linear_attention":
            a, conv = f"{layer}linear_attn.", 2 * kd + vd
            out += [
                t(f"{a}A_log", (nv,)),
                t(f"{a}conv1d.weight", (conv, 1, 4)),
                t(f"{a}dt_bias", (nv,)),
                t(f"{a}in_proj_a.weight", (nv, h)),
                t(f"{a}in_proj_b.weight", (nv, h)),
                t(f"{a}in_proj_qkv.weight", (conv, h)),
                t(f"{a}in_proj_z.weight", (vd, h)),
                t(f"{a}norm.weight", (cfg["linear_value_head_dim"],)),
                t(f"{a}out_proj.weight", (h, vd)),
            ]
        for j in range(experts):
            e = f"{layer}mlp.experts.{j}."
            out += [
                t(f"{e}down_proj.weight", (h, mi)),
                t(f"{e}gate_proj.weight", (mi, h)),
                t(f"{e}up_proj.weight", (mi, h)),
            ]
        s = f"{layer}mlp.shared_expert."
        out += [
            t(f"{layer}mlp.gate.weight", (experts, h)),
            t(f"{s}down_proj.weight", (h, si)),
            t(f"{s}gate_proj.weight", (si, h)),
            t(f"{s}up_proj.weight", (si, h)),
            t(f"{layer}mlp.shared_expert_gate.weight", (1, h)),
            t(f"{layer}post_attention_layernorm.weight", (h,)),
        ]
        if kind == "full_attention":
            a = f"{layer}self_attn."
            out += [
                t(f"{a}k_norm.weight", (hd,)),
                t(f"{a}k_proj.weight", (nkv * hd, h)),
                t(f"{a}o_proj.weight", (h, nh * hd)),
                t(f"{a}q_norm.weight", (hd,)),
                t(f"{a}q_proj.weight", (2 * nh * hd, h)),
                t(f"{a}v_proj.weight", (nkv * hd, h)),
            ]
    return [*out, t(f"{p}norm.weight", (h,)), t("lm_head.weight", (vocab, h))]


#: The real index's total (github.com/bryce-hoehn/Qwen3.5-18B-REAP-A3B-Coding,
#: model.safetensors.index.json, "metadata": {"total_size": ...}).
REAP_TOTAL_SIZE = 37087995136


@pytest.fixture(scope="session")
def reap(ckpt_root: Path) -> Path:
    """An expert-pruned Qwen3.5-MoE re-export (REAP, 256 -> 128 experts): its own
    ``config.json`` (github.com/bryce-hoehn/Qwen3.5-18B-REAP-A3B-Coding, config.json, byte for
    byte in tests/data) declares ``mtp_num_hidden_layers: 1``, but its index (same repository,
    model.safetensors.index.json, 1.7 MB) names no ``mtp.*`` tensor: its keys are sorted and
    the last is ``model.language_model.norm.weight``. The tensors here are that index's
    names, shaped by the config; their sizes add up to the index's total to the byte. Packed
    into 7 shards as the original (headers only)."""
    out = ckpt_root / "qwen3.5-18b-reap"
    src = DATA / "qwen3.5-18b-reap" / "config.json"
    if not (out / "config.json").exists():
        layout = synth.Layout(
            json.loads(src.read_text()), _qwen35_moe_text_tensors(json.loads(src.read_text()))
        )
        assert layout.nbytes == REAP_TOTAL_SIZE
        synth.write_checkpoint(out, layout, synth.shard(layout, num_shards=7), fill="sparse")
        shutil.copy(src, out / "config.json")
    return out


def test_plan_flags_a_checkpoint_without_mtp_tensors(
    reap: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = plan_json(capsys, reap)
    assert (result["draft_class"], result["rule_source"]) == ("Qwen3_5MoeMTP", "vllm")
    # vLLM's rule keeps the shared embedding and LM head: still a plan to read them...
    contents = shard_contents(reap)
    assert rows(result) == expected(contents, qwen35_rule, qwen35_rule)
    kept = sorted(n for t in contents.values() for n in t if not qwen35_rule(n))
    assert kept == ["lm_head.weight", "model.language_model.embed_tokens.weight"]
    # ...but no draft: the warning says so, and why.
    (warning,) = result["warnings"]
    assert warning["code"] == "no_draft_tensors"
    assert "declares 1 MTP layer" in warning["detail"]
    assert all(name in warning["detail"] for name in kept)

    code, out, _ = plan_here(capsys, str(reap))
    assert code == 0
    assert f"warning      no_draft_tensors: {warning['detail']}" in out.splitlines()


def test_plan_flags_a_deepseek_export_without_its_mtp_layer(
    ckpt_root: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A DeepSeek-V3 re-export that dropped layer N (the MTP layer), as many quantized ones
    do: this layer's DeepSeekMTP rule still keeps the shared embedding, and nothing else."""
    model = ckpt_root / "deepseek-without-layer-n"
    layout = synth.deepseek_v3("tiny")
    if not model.exists():
        body = synth.Layout(
            layout.config, [t for t in layout.tensors if t.name not in layout.is_mtp]
        )
        synth.write_checkpoint(model, body, synth.shard(body, num_shards=3))
    result = plan_json(capsys, model)
    assert (result["draft_class"], result["rule_source"]) == ("DeepSeekMTP", "hybrid-draft")
    contents = shard_contents(model)
    top = ("model.embed_tokens.weight",)
    assert rows(result) == expected(contents, spec_rule(model, top), None)
    # (the one tensor it keeps is the embedding, which the target's replaces: nothing read)
    assert result["modes"]["auto"]["tensors"] == 0
    assert result["replaced_by_target"]["names"] == list(top)
    (warning,) = result["warnings"]
    assert warning["code"] == "no_draft_tensors"
    assert "declares 1 MTP layer" in warning["detail"] and top[0] in warning["detail"]


@pytest.fixture(scope="session")
def qwen35_without_mtp(ckpt_root: Path) -> Path:
    """A tiny Qwen3.5 whose config declares one MTP layer but whose shards hold none."""
    out = ckpt_root / "qwen35-no-mtp"
    if not (out / "config.json").exists():
        layout = synth.qwen3_5("tiny")
        body = synth.Layout(
            layout.config, [t for t in layout.tensors if t.name not in layout.is_mtp]
        )
        synth.write_checkpoint(out, body, synth.shard(body, num_shards=2))
    return out


def test_load_time_decision_warns_before_vllm_fails(
    qwen35_without_mtp: Path,
    events: Events,
    instanttensor_standin: Recorder,
    capsys: pytest.CaptureFixture[str],
) -> None:
    planned = plan_json(capsys, qwen35_without_mtp)["warnings"]
    assert [w["code"] for w in planned] == ["no_draft_tensors"]

    with pytest.raises(ValueError, match="not initialized from checkpoint") as info:
        load_target_and_draft(engine_config(qwen35_without_mtp))
    # vLLM names the MTP layer's weights it did not get (``mtp.`` is ``model.`` in there).
    missing = {n.replace("mtp.", "model.", 1) for n in synth.qwen3_5("tiny").is_mtp}
    assert any(f"'{n}'" in str(info.value) for n in missing)
    records = events.all()
    (decision,) = [
        e for e in records if e["event"] == "hybrid_draft.decision" and e["role"] == "draft"
    ]
    assert decision["warnings"] == planned
    failed = [i for i, e in enumerate(records) if e["event"] == "hybrid_draft.load_failed"]
    assert failed and records.index(decision) < failed[0]


def test_a_fault_in_the_load_time_check_never_fails_the_load(
    qwen35: Path,
    events: Events,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fault while planning the draft is reported on its decision (``plan_error``, and
    ``warnings`` null: unknown, not "none"), and the draft loads on vLLM's own lazy path."""
    from hybrid_draft.adapter import draftplan

    def broken(call: Any) -> list[str]:
        raise OSError("a shard header that cannot be read")

    monkeypatch.setattr(draftplan, "weight_files", broken)
    loaded = load_target_and_draft(engine_config(qwen35))
    assert loaded.draft is not None
    (decision,) = events.decisions("draft")
    assert decision["reason"] == "same_checkpoint" and decision["warnings"] is None
    assert decision["plan_error"] == "OSError: a shard header that cannot be read"
    assert decision["tensor_filter"] is False


# --- one-line errors ----------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("tokenizer*", "generation*"))
    return dst


def _edit_config(model: Path, **changes: Any) -> None:
    cfg = json.loads((model / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (model / "config.json").write_text(json.dumps(cfg))


def _first_shard(model: Path) -> Path:
    return sorted(model.glob("*.safetensors"))[0]


def _bad_header(model: Path, header: bytes) -> None:
    path = _first_shard(model)
    path.write_bytes(len(header).to_bytes(8, "little") + header)


def _truncate(model: Path) -> None:
    """Cut the first shard one byte after its header: its tensors' data is gone."""
    path = _first_shard(model)
    size = int.from_bytes(path.read_bytes()[:8], "little")
    os.truncate(path, 8 + size + 1)


#: name: (the tiny checkpoint a copy of which it breaks, how, what the error says).
BAD_INPUTS: dict[str, tuple[str, Any, str]] = {
    "not_a_directory": ("qwen35", lambda m: shutil.rmtree(m), "not a directory"),
    "no_shards": (
        "qwen35",
        lambda m: [p.unlink() for p in m.glob("*.safetensors*")],
        "no model.safetensors.index.json and no *.safetensors files",
    ),
    "index_names_a_missing_shard": (
        "qwen35",
        lambda m: _first_shard(m).unlink(),
        "names shards that do not exist",
    ),
    "index_not_json": (
        "qwen35",
        lambda m: (m / "model.safetensors.index.json").write_text("{"),
        "not a safetensors index",
    ),
    "header_not_json": ("qwen35", lambda m: _bad_header(m, b"{not json"), "header is not JSON"),
    "header_not_an_object": (
        "qwen35",
        lambda m: _bad_header(m, b"[1, 2]"),
        "header is a JSON list, not an object",
    ),
    "header_without_offsets": (
        "qwen35",
        lambda m: _bad_header(m, b'{"w": {"dtype": "BF16", "shape": [1]}}'),
        "tensor 'w' has no valid dtype, shape and data_offsets",
    ),
    "truncated_shard": ("qwen35", _truncate, "(truncated?)"),
    "no_config": ("qwen35", lambda m: (m / "config.json").unlink(), "config.json: no such file"),
    "config_not_json": (
        "qwen35",
        lambda m: (m / "config.json").write_text("{'a': 1"),
        "config.json: not valid JSON",
    ),
    "config_not_an_object": (
        "qwen35",
        lambda m: (m / "config.json").write_text("[]"),
        "config.json: holds a JSON list, not an object",
    ),
    "config_invalid_for_its_model_type": (
        "qwen35",
        lambda m: _edit_config(m, layer_types=["no_such_layer"]),
        "config.json: vLLM cannot read it:",
    ),
    "no_architectures": (
        "qwen3",
        lambda m: _edit_config(m, model_type="no_such_type", architectures=None),
        "config.json: names no architectures",
    ),
    "unknown_architecture": (
        "qwen3",
        lambda m: _edit_config(m, architectures=["NoSuchModelForCausalLM"]),
        "architecture 'NoSuchModelForCausalLM' is not one vLLM",
    ),
    "no_mtp_for_the_architecture": (
        "qwen3",
        lambda m: None,
        "has no MTP draft for Qwen3ForCausalLM",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_get_one_line_errors(
    case: str,
    qwen35: Path,
    qwen3_pair: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    base, breaks, message = BAD_INPUTS[case]
    model = _copy(qwen35 if base == "qwen35" else qwen3_pair[0], tmp_path / "model")
    breaks(model)
    code, out, err = plan_here(capsys, str(model))
    assert (code, out) == (2, "")
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"hybrid-draft plan: {model}") and message in last, err
    assert "Traceback" not in err


def test_bad_input_from_the_command_line(tmp_path: Path) -> None:
    """The same as a user sees it: exit 2, one line, no traceback."""
    out = run_plan(tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (
        f"hybrid-draft plan: {tmp_path}: no model.safetensors.index.json and no *.safetensors files"
    )


def test_header_reader_matches_safe_open(deepseek: Path) -> None:
    from hybrid_draft.core import checkpoint

    contents = shard_contents(deepseek)
    for shard in checkpoint.read_checkpoint(deepseek):
        assert {t.name: t.nbytes for t in shard.tensors} == contents[shard.name]
