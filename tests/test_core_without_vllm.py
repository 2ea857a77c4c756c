"""The core runs where vLLM cannot be imported (a GPU machine without it, the bench's
``--without-vllm``): every ``hybrid_draft.core`` module imports, and a draft is planned from
its checkpoint's headers, read filtered, held from a target's stream and taken from the hold,
with its figures, in a process where any import of vLLM fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

#: Run in a child process: vLLM blocked before anything else is imported, then the core
#: driven as the bench and scripts/gpu-check.sh drive it.
CHILD = r"""
import importlib, json, pkgutil, sys

class Blocker:
    '''Refuses vLLM, and records that something asked for it.'''
    asked = []

    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            Blocker.asked.append(name)
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Blocker())
sys.modules["vllm"] = None

import hybrid_draft.core as core
modules = sorted(m.name for m in pkgutil.iter_modules(core.__path__, "hybrid_draft.core."))
for name in modules:
    importlib.import_module(name)

import torch
from safetensors.torch import load_file
from hybrid_draft import settings
from hybrid_draft.core import checkpoint, draftload, figures, hold, planning, readers
from hybrid_draft.core.draftread import DraftRead

directory = sys.argv[1]
plan = planning.DraftPlan(
    tuple(checkpoint.read_checkpoint(directory)),
    draft_class="TinyMTP",
    rule_source="test",
    rule=lambda name: not (name.startswith("mtp.") or name == "model.embed_tokens.weight"),
    shared=frozenset(planning.SHARED_KINDS),
)
values = {}
for shard in plan.shards:
    values.update(load_file(shard.path))

def load(held=None):
    read = DraftRead(plan=plan, sink=settings.process_sink(), hold=held)
    read.skipped = dict(plan.replaced)
    read.sources = draftload.empty_sources()
    planned = draftload.reads(read)
    with figures.measuring() as cost:  # what the layer's loader reports of its shards
        files = [s.location for s in plan.shards]
        figures.resolved(files, {s.location: s.size for s in plan.shards})
        figures.dropped(set(files) - set(planned.selection.files))
        got = {
            name: tensor.clone()
            for name, tensor in draftload.weights(read, planned, readers.lazy_filtered_iterator)
        }
    assert all(torch.equal(got[n], values[n]) for n in got), "a tensor read differs"
    return got, read.sources, cost.cost()

filtered, from_storage, cost = load()

made = hold.Hold.of(plan, None, 1 << 30, lambda _name: False, settings.load())
for shard in plan.shards:  # the target's stream: every tensor of every shard, offered
    for name, tensor in load_file(shard.path).items():
        made.offer(name, tensor)
held = sorted(made.tensors)
one_pass, from_hold, _ = load(made)
made.release("the test's draft load ended")

print(json.dumps({
    "modules": modules,
    "vllm_asked": Blocker.asked,
    "vllm_loaded": sorted(m for m in sys.modules if m.split(".")[0] == "vllm" and sys.modules[m]),
    "kept": [t.name for t in plan.kept],
    "replaced": sorted(plan.replaced),
    "files": [str(p) for p in plan.selection().files],
    "filtered": sorted(filtered),
    "from_storage": from_storage,
    "cost": {k: getattr(cost, k) for k in ("seconds", "bytes_read", "shards", "checkpoint_shards")},
    "held": held,
    "one_pass": sorted(one_pass),
    "from_hold": from_hold,
    "hold_left": len(made.tensors),
}))
"""


def tiny_checkpoint(directory: Path) -> dict[str, int]:
    """Two shards: the body, and the MTP layer with its embedding (which vLLM replaces);
    each tensor's bytes by name."""
    torch.manual_seed(0)
    body = {
        "model.embed_tokens.weight": torch.randn(64, 16),
        "model.layers.0.mlp.weight": torch.randn(16, 16),
        "lm_head.weight": torch.randn(64, 16),
    }
    mtp = {
        "mtp.embed_tokens.weight": torch.randn(64, 16),
        "mtp.layers.0.eh_proj.weight": torch.randn(16, 32).to(torch.bfloat16),
        "mtp.layers.0.norm.weight": torch.ones(16),
    }
    directory.mkdir()
    save_file(body, str(directory / "model-00001-of-00002.safetensors"))
    save_file(mtp, str(directory / "model-00002-of-00002.safetensors"))
    return {n: t.numel() * t.element_size() for n, t in {**body, **mtp}.items()}


def test_the_core_reads_and_holds_a_draft_with_vllm_unimportable(tmp_path: Path) -> None:
    sizes = tiny_checkpoint(tmp_path / "ckpt")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])

    layer = Path(__file__).resolve().parents[1] / "layer" / "hybrid_draft" / "core"
    every = {f"hybrid_draft.core.{p.stem}" for p in layer.glob("*.py") if p.stem != "__init__"}
    assert set(got["modules"]) == every
    assert got["vllm_asked"] == [] and got["vllm_loaded"] == []  # nothing even asked

    # The plan, from the headers and the name rule: the MTP layer and the embedding kept,
    # the embeddings replaced by name; only the MTP layer's shard read.
    own = ["mtp.layers.0.eh_proj.weight", "mtp.layers.0.norm.weight"]
    replaced = ["model.embed_tokens.weight", "mtp.embed_tokens.weight"]
    assert sorted(got["kept"]) == sorted([*replaced, *own]) and got["replaced"] == replaced
    assert [Path(f).name for f in got["files"]] == ["model-00002-of-00002.safetensors"]
    own_bytes = sum(sizes[n] for n in own)
    # Read filtered: exactly the draft's own tensors, equal to safetensors', from storage.
    assert got["filtered"] == own
    assert got["from_storage"]["storage"] == {"tensors": 2, "bytes": own_bytes}
    assert got["from_storage"]["stream"] == {"tensors": 0, "bytes": 0}
    cost = got["cost"]
    assert (cost["shards"], cost["checkpoint_shards"]) == (1, 2) and cost["seconds"] > 0
    assert cost["bytes_read"] is None or cost["bytes_read"] >= 0  # the kernel's count, if any
    # One pass: the hold keeps the draft's own tensors from the stream; the draft takes
    # every one of them from it and reads nothing from storage.
    assert got["held"] == own and got["one_pass"] == own
    assert got["from_hold"]["stream"] == {"tensors": 2, "bytes": own_bytes}
    assert got["from_hold"]["storage"] == {"tensors": 0, "bytes": 0}
    assert got["hold_left"] == 0
