"""Pruning rules for MTP drafts vLLM ships without one: exactly what ``load_weights`` keeps.

A spy on vLLM's safetensors iterator tags every tensor it yields; a torch function mode
records which of them the real ``load_weights`` actually uses (copies, views, slices). On
a single-shard checkpoint (so pruning cannot hide anything) that set must equal the rule's.
The checkpoints are tiny ones in the tensor names of each family (``mtp_layouts``).
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
from hybrid_draft.core import checkpoint
from hybrid_draft.tools import synth
from mtp_layouts import FAMILIES, STANDINS, Family, layout

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def inspection_in_process(vllm_runtime: Any) -> Any:
    """vLLM inspects each new architecture in a subprocess that imports vLLM afresh (tens
    of seconds each, two per family); the CPU has no CUDA to keep out of this process."""
    import vllm.model_executor.models.registry as registry

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "_run_in_subprocess", lambda fn: fn())
        yield


class Consumed(TorchFunctionMode):
    """Names of yielded checkpoint tensors that any torch function touched."""

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[int, str] = {}
        self.alive: list[torch.Tensor] = []  # keeps ids unique while tracking
        self.used: set[str] = set()
        self.yielded: set[str] = set()  # every checkpoint tensor handed to load_weights

    def track(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self.names[id(tensor)] = name
        self.alive.append(tensor)
        return tensor

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        hit = {
            self.names[id(a)]
            for a in tree_flatten((args, kwargs))[0]
            if isinstance(a, torch.Tensor) and id(a) in self.names
        }
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

    monkeypatch.setattr(
        default_loader,
        "safetensors_weights_iterator",
        lambda *args, **kwargs: tagged(mode, real(*args, **kwargs)),
    )
    with mode:
        yield mode


#: The proofs need every checkpoint tensor offered to ``load_weights``: the draft is loaded by
#: vLLM's own (unfiltered) lazy iterator, which the user's explicit draft loader keeps, from a
#: one-shard checkpoint, which shard pruning cannot thin.
UNFILTERED = {
    "method": "mtp",
    "num_speculative_tokens": 1,
    "draft_load_config": {"load_format": "safetensors"},
}


def one_shard(root: Path, name: str, layout: synth.Layout) -> Path:
    out = root / name
    if not out.exists():
        synth.write_checkpoint(out, layout, [layout.tensors])
    return out


def rule_keeps(model_dir: Path, draft: Any) -> set[str]:
    names = {t.name for s in checkpoint.read_checkpoint(model_dir) for t in s.tensors}
    return {n for n in names if not draft.is_unused_checkpoint_weight(n)}


def test_deepseek_mtp_rule_is_exactly_what_load_weights_consumes(
    ckpt_root: Path,
    consumed: Consumed,
    instanttensor_standin: Recorder,
    events: Events,
) -> None:
    model = one_shard(ckpt_root, "deepseek-1shard", synth.deepseek_v3("tiny", moe=False))
    loaded = load_target_and_draft(engine_config(model, speculative_config=UNFILTERED))
    assert type(loaded.draft).__name__ == "DeepSeekMTP"
    assert consumed.used == rule_keeps(model, loaded.draft)
    assert "model.embed_tokens.weight" in consumed.used and "lm_head.weight" not in consumed.used
    (draft,) = events.decisions("draft")
    assert draft["pruning_rule"] == "hybrid-draft"


def test_glm4_moe_mtp_rule_is_exactly_what_load_weights_consumes(
    ckpt_root: Path,
    consumed: Consumed,
    events: Events,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GLM MTP layer is MoE, and vLLM's CPU MoE kernels need vllm._C, which the CUDA
    wheel lacks: the real get_model (called by model runner v2's load_eagle_model, as in
    serving) stops in process_weights_after_loading, after load_weights and vLLM's "weights
    not initialized" check have both run to completion on the real model."""
    import vllm.model_executor.model_loader.default_loader as default_loader
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

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
        # The target is first used after the draft's get_model, which stops before.
        with pytest.raises(AttributeError, match="prepack_moe_weight"):
            load_eagle_model(None, config)
    (draft,) = checked
    assert type(draft).__name__ == "Glm4MoeMTP"
    assert consumed.used == rule_keeps(model, draft)
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= consumed.used
    assert events.decisions("draft")[0]["pruning_rule"] == "hybrid-draft"


def test_pruning_never_hands_the_draft_target_only_shards(
    deepseek: Path,
    instanttensor_standin: Recorder,
    filtered_reads: Recorder,
    events: Events,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shards = [p.name for p in sorted(deepseek.glob("*.safetensors"))]
    target_only = [
        s.path.name
        for s in checkpoint.read_checkpoint(deepseek)
        if all(
            not t.name.startswith("model.layers.2.") and t.name != "model.embed_tokens.weight"
            for t in s.tensors
        )
    ]
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
        if mode == "auto":  # the filtered path also skips what vLLM replaces
            replaced = ("embed_tokens.weight", "shared_head.head.weight")
            read = {
                s.path.name
                for s in checkpoint.read_checkpoint(deepseek)
                if any(
                    t.name.startswith("model.layers.2.") and not t.name.endswith(replaced)
                    for t in s.tensors
                )
            }
            assert read < set(shards) - set(target_only)
            assert opened == read, mode
        else:
            assert opened == set(shards) - set(target_only), mode


def test_a_rule_that_keeps_too_little_fails_the_load(
    ckpt_root: Path,
    instanttensor_standin: Recorder,
    monkeypatch: pytest.MonkeyPatch,
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
    from vllm.model_executor.models.gemma4_mtp import Gemma4MTP

    assert rules.install(Gemma4MTP) == "none"  # its own checkpoint, loaded whole
    assert rules.probe(Gemma4MTP, object()) is None


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
    assert rules.rule_source(Custom) == "none" and rules.install(Custom) == "none"


# --- every family: the rule equals what the class's own load_weights consumes -------------


def family_checkpoint(root: Path, name: str, f: Family) -> Path:
    out = root / f"family-{name}"
    if not (out / "config.json").exists():
        lay = layout(f)
        synth.write_checkpoint(out, lay, [lay.tensors])
        for file, text in f.files.items():
            (out / file).write_text(text)
    return out


def stand_in_cuda(f: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    for key in f.cuda_standins:
        path, attr, factory = STANDINS[key]
        module, _, cls = path.partition(":")
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        monkeypatch.setattr(owner, attr, factory(getattr(owner, attr)))


def tagged(mode: Consumed, weights: Any) -> Any:
    for name, tensor in weights:
        mode.yielded.add(name)
        yield name, mode.track(name, tensor)


def triton_available() -> bool:
    """Whether vLLM runs Triton here (on the CPU it hands out a placeholder module)."""
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


class _Loaded(Exception):
    """Raised right after the draft's load_weights (and vLLM's own checks) returned."""


def skip_unloaded_padding(draft: str, exc: ValueError) -> None:
    """Skip when vLLM's own "not initialized" check names only shards of a module into which
    ``draft`` packs a padding shard no checkpoint holds (vLLM 0.34 checks each packed shard;
    its Qwen4ExpMTP packs ``_input_mix_padding``, which it never loads): the same error with
    the layer off, so there is no load to compare."""
    import re

    import vllm
    from vllm.model_executor.models.registry import ModelRegistry

    cls = ModelRegistry._try_load_model_cls(draft)
    packed = getattr(cls, "packed_modules_mapping", None) or {}
    padded = sorted(m for m, shards in packed.items() if any(s.startswith("_") for s in shards))
    names = re.findall(r"'([^']+)'", str(exc))
    if (
        padded
        and names
        and all(re.search(rf"\.({'|'.join(padded)})\.weight\.\d+$", n) for n in names)
    ):
        pytest.skip(
            f"vLLM {vllm.__version__}'s {draft} packs a padding shard into "
            f"{', '.join(padded)}, which its own loader reports not initialized "
            f"({', '.join(sorted(names))}); the same with the layer off: no load to compare"
        )


def load_through_vllm(model: Path, f: Family, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """The real get_model, as model runner v2's load_eagle_model calls it in serving,
    stopped right after DefaultModelLoader.load_weights: CPU post-processing (MoE
    prepacking) needs vllm._C."""
    import vllm.model_executor.model_loader.default_loader as default_loader
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

    built: list[Any] = []
    real = default_loader.DefaultModelLoader.load_weights

    def load_weights(self: Any, draft: Any, model_config: Any) -> None:
        real(self, draft, model_config)
        built.append(draft)
        raise _Loaded

    monkeypatch.setattr(default_loader.DefaultModelLoader, "load_weights", load_weights)
    config = engine_config(
        model,
        load_format="safetensors",
        speculative_config={"method": "mtp", "num_speculative_tokens": 1, **f.speculative},
        **f.engine,
    )
    with set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        try:
            load_eagle_model(None, config)
        except _Loaded:  # before the target is first used
            pass
        except ValueError as exc:
            skip_unloaded_padding(f.draft, exc)
            raise
        else:
            pytest.fail("the draft's load_weights was not reached")
    return (
        built[0],
        config.model_config.hf_config,
        (config.speculative_config.draft_model_config.hf_config),
    )


def load_directly(model: Path, f: Family, host: Path, consumed: Consumed) -> tuple:
    """The class built from the family's config inside a host engine config (the target's
    config cannot be built here), its real load_weights fed the checkpoint's tensors."""
    import copy
    import json

    from transformers import PretrainedConfig
    from vllm.config import set_current_vllm_config
    from vllm.config.speculative import SpeculativeConfig
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.config import _CONFIG_REGISTRY, get_hf_text_config

    raw = json.loads((model / "config.json").read_text())

    def hf_config() -> Any:
        if f.direct_config == "registered":
            return _CONFIG_REGISTRY[raw["model_type"]](**raw)
        subs = {
            k: PretrainedConfig(**v)
            for k, v in raw.items()
            if isinstance(v, dict) and (k.endswith("config") or k == "decoder")
        }
        return PretrainedConfig(**{**raw, **subs})

    def text(config: Any) -> Any:
        try:
            return get_hf_text_config(config)
        except ValueError:  # no attention heads at the top (Parse 3.5's decoder config)
            return config

    target, draft = hf_config(), SpeculativeConfig.hf_config_override(hf_config())
    base = engine_config(host)
    vllm_config, model_config = copy.copy(base), copy.copy(base.model_config)
    spec = copy.copy(base.speculative_config)
    draft_config = copy.copy(spec.draft_model_config)
    for holder, config in ((model_config, target), (draft_config, draft)):
        object.__setattr__(holder, "hf_config", config)
        object.__setattr__(holder, "hf_text_config", text(config))
    object.__setattr__(spec, "draft_model_config", draft_config)
    object.__setattr__(vllm_config, "model_config", model_config)
    object.__setattr__(vllm_config, "speculative_config", spec)
    cls = ModelRegistry._try_load_model_cls(draft.architectures[0])
    files = sorted(str(p) for p in model.glob("*.safetensors"))
    with set_current_vllm_config(vllm_config):
        ensure_model_parallel_initialized(1, 1)
        built = cls(vllm_config=vllm_config)
        built.load_weights(tagged(consumed, safetensors_weights_iterator(files, False, "lazy")))
    return built, target, draft


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_rule_is_exactly_what_its_load_weights_consumes(
    name: str,
    ckpt_root: Path,
    deepseek: Path,
    consumed: Consumed,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybrid_draft.adapter import rules

    f = FAMILIES[name]
    if f.needs_triton and not triton_available():
        pytest.skip(f"{f.draft} imports Triton kernels while it is built; no Triton here")
    model = family_checkpoint(ckpt_root, name, f)
    stand_in_cuda(f, monkeypatch)
    if f.route == "direct":
        draft, target_config, draft_config = load_directly(model, f, deepseek, consumed)
    else:
        draft, target_config, draft_config = load_through_vllm(model, f, monkeypatch)
    cls = type(draft)
    assert cls.__name__ == f.draft
    assert rules.install(cls) == "hybrid-draft"
    names = {t.name for s in checkpoint.read_checkpoint(model) for t in s.tensors}
    kept = {n for n in names if not draft.is_unused_checkpoint_weight(n)}
    assert consumed.yielded == names  # load_weights saw every tensor, pruned or not
    assert consumed.used == kept
    assert kept and kept != names, "the layout must hold tensors the draft leaves alone"
    # Without building the model, the rule answers the same from the configs vLLM has.
    probe = rules.probe_for(cls, target_config, draft_config)
    assert probe is not None and {n for n in names if not probe(n)} == kept


def test_a_subclass_sharing_load_weights_shares_the_rule(vllm_runtime: Any) -> None:
    from vllm.model_executor.models.mimo_v2_mtp import MiMoV2MTP, MiMoV2OmniMTP

    from hybrid_draft.adapter import rules

    assert MiMoV2OmniMTP.load_weights is MiMoV2MTP.load_weights
    assert rules.rule_for(MiMoV2OmniMTP) is rules.rule_for(MiMoV2MTP) is not None
    assert rules.install(MiMoV2OmniMTP) == "hybrid-draft"
    cfg = types.SimpleNamespace(num_hidden_layers=48, num_nextn_predict_layers=3)
    probe = rules.probe(MiMoV2OmniMTP, cfg)
    assert probe is not None and not probe("model.mtp.layers.0.eh_proj.weight")
    assert probe("model.mtp.layers.1.eh_proj.weight")  # vLLM builds the first one only


def test_rules_never_raise_and_answer_a_bool(vllm_runtime: Any) -> None:
    from hybrid_draft.adapter import rules

    configs = [
        None,
        object(),
        types.SimpleNamespace(num_hidden_layers="x"),
        types.SimpleNamespace(num_hidden_layers=61, num_nextn_predict_layers=None),
    ]
    names = [
        "",
        ".",
        "model.layers..x",
        "model.layers.99999999999999999999999.a",
        "model.layers.-1.eh_proj.weight",
        "lm_head.weight",
        "x" * 10_000,
    ]
    for rule in rules.RULES.values():
        for config in configs:
            bound = rule.bind(config)  # what a plan asks, the config read once
            for name in names:
                assert isinstance(rule.is_unused(config, name), bool)
                assert bound(name) is rule.is_unused(config, name)


def test_a_bound_rule_answers_as_the_rule(vllm_runtime: Any) -> None:
    """A plan asks the bound rule of every tensor; it answers as the per-name rule does."""
    from hybrid_draft.adapter import rules

    configs = [
        types.SimpleNamespace(num_hidden_layers=2, num_nextn_predict_layers=1),
        types.SimpleNamespace(
            num_hidden_layers=3, num_nextn_predict_layers=2, tie_word_embeddings=True
        ),
        types.SimpleNamespace(text_config=types.SimpleNamespace(num_hidden_layers=1)),
    ]
    names = [
        f"{prefix}{i}.{rest}"
        for prefix in (*rules.SPEC_PREFIXES, "model.mtp.layers.", "mtp.layers.")
        for i in range(6)
        for rest in ("eh_proj.weight", "embed_tokens.weight", "shared_head.head.weight")
    ] + ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "mtp.fc.weight"]
    for rule in rules.RULES.values():
        for config in configs:
            bound = rule.bind(config)
            assert [bound(n) for n in names] == [rule.is_unused(config, n) for n in names]


def test_every_shipped_rule_has_a_proof_on_real_vllm(vllm_runtime: Any) -> None:
    """Each rule is proven by a family above (or, DeepSeek/GLM-4.5, by its own test)."""
    from hybrid_draft.adapter import rules

    proven = {f.draft for f in FAMILIES.values()} | {"DeepSeekMTP", "Glm4MoeMTP"}
    assert {cls for _, cls in rules.RULES} == proven


def test_rules_lists_every_draft_class_vllm_registers(
    vllm_runtime: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS

    from hybrid_draft.adapter import rules
    from hybrid_draft.tools import cli

    assert cli.main(["rules", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    from hybrid_draft.adapter import internals

    assert out["vllm_version"] == internals.vllm_version()
    rows = out["classes"]
    assert [r["architecture"] for r in rows] == list(_SPECULATIVE_DECODING_MODELS)
    for r in rows:
        assert set(r) == {"architecture", "class", "kind", "rule", "detail"}
        assert r["kind"] in ("mtp", "standalone") and r["rule"] in ("vllm", "hybrid-draft", "none")
    mtp = [r for r in rows if r["kind"] == "mtp"]
    assert any(r["rule"] == "vllm" for r in mtp) and any(r["rule"] == "hybrid-draft" for r in mtp)
    # An MTP draft without a rule is one this platform cannot load at all.
    for r in mtp:
        if r["rule"] == "none":
            assert (
                "does not import here" in r["detail"]
                or "no load_weights on this platform" in r["detail"]
            ), r
    # Every rule we ship applies to a class vLLM registers (none is stale).
    listed = {r["class"] for r in rows if r["rule"] == "hybrid-draft"}
    assert {cls for _, cls in rules.RULES} <= listed


def test_doctor_says_how_many_mtp_classes_prune_their_checkpoint(vllm_runtime: Any) -> None:
    import re

    from hybrid_draft.tools import doctor

    ok, line = doctor.check_rules()
    assert ok, line
    m = re.match(
        r"rules: (\d+) of (\d+) MTP draft classes prune their checkpoint "
        r"\((\d+) vLLM, (\d+) hybrid-draft\)",
        line,
    )
    assert m, line
    pruned, total, by_vllm, ours = map(int, m.groups())
    assert pruned == by_vllm + ours <= total and ours >= len(FAMILIES)
