"""``hybrid-draft bench --weight-update``: what one training step's weight sync sends, and what
it costs, with the draft updated the ways a trainer can have it.

- ``vllm_draft_session`` (vLLM's own way, the layer's ``reload`` off): a target session with
  the base model, then vLLM's draft session (``start_draft_weight_update``) with what a
  trainer's draft export holds: the MTP block, and the embedding and output head again;
- ``one_session`` (the layer): one target session with the whole model, MTP block included;
  the draft takes its tensors as they pass;
- ``direct_per_tensor`` and ``direct_buckets`` (the layer): a trainer's direct
  ``load_weights`` calls on the target, one tensor per call (OpenRLHF, TRL, AReaL over NCCL),
  ended by the runner's next step, or buckets (verl, skyrl), ended by the post-load
  processing verl calls; each beside the same calls made on vLLM's own ``load_weights``
  (``..._vllm``: the layer bypassed, the draft left stale), so that what the layer adds to
  the trainer's calls, and the draft's part of the update, are measured apart.

vLLM's offline ``LLM`` runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on a
generated DeepSeek-V3 checkpoint with dense layers (two steps of it, alternating, so that every
sync changes every weight), through vLLM's real worker sessions over a backend registered here
(``hybrid_draft_bench``: vLLM's own IPC engine, its chunks handed over in memory rather than by
CUDA IPC handles: the trainer's tensors are this process's, on the model's device). Each chunk
is a bucket of up to 256 MiB of tensors in checkpoint order. On the CPU every linear layer
keeps its weight after loading, as on a GPU (vLLM's plain-linear path of its CPU build, the
one MLA's ``kv_b_proj`` takes): the CPU build otherwise empties them, and a direct
``load_weights`` raises there with the layer or without it. A benchmark, not a test: it prints
a table, writes ``OUT/weight-update.json`` and asserts nothing. It also works out, from
DeepSeek-V3's own shapes, what each way sends per step in bfloat16.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
BACKEND = "hybrid_draft_bench"
CHUNK_BYTES = 256 << 20
#: The embedding and output head vLLM shares between an MTP draft and its target.
SHARED = ("model.embed_tokens.weight", "lm_head.weight")
SESSION_WAYS = ("vllm_draft_session", "one_session")
#: The direct ways, each measured with the layer and on vLLM's own ``load_weights``.
DIRECT_WAYS = ("direct_per_tensor", "direct_buckets")
WAYS = (*SESSION_WAYS, *(f"{w}{v}" for w in DIRECT_WAYS for v in ("_vllm", "")))


def engine_class() -> type:
    """vLLM's IPC engine, taking each chunk's tensors in memory (``{"weights": [...]}``)."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    @dataclasses.dataclass
    class InMemoryUpdateInfo(WeightTransferUpdateInfo):
        weights: Any = None

    class InMemoryWeightTransferEngine(IPCWeightTransferEngine):
        update_info_cls = InMemoryUpdateInfo  # type: ignore[assignment]

        def update_weights(self, update_info: dict[str, Any]) -> None:
            import torch

            self.receive_weights(self.parse_update_info(update_info))
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        def receive_weights(self, update_info: Any) -> None:
            from hybrid_draft.adapter import internals

            model: Any = self.model
            # A chunk holds part of the MTP layer: vLLM's completeness check off for it, as
            # its own engines do (0.32, 0.33), or as 0.34's reload says for the session.
            with internals.mtp_partial_load():
                model.load_weights(update_info.weights)

    return InMemoryWeightTransferEngine


def register() -> None:
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, engine_class())


def model_layout(size_gib: float) -> Any:
    """A dense DeepSeek-V3 (MLA, one MTP layer) of about ``size_gib`` in bfloat16: the
    ``cpu`` preset's attention, widened."""
    from hybrid_draft.tools import synth

    hidden, layers = 1024, 4
    vocab = 8192
    for _ in range(64):  # widen the MLP until the size is reached
        inter = 4 * hidden
        layout = synth.deepseek_v3(
            "cpu",
            moe=False,
            hidden_size=hidden,
            intermediate_size=inter,
            vocab_size=vocab,
            num_hidden_layers=layers,
            num_attention_heads=8,
            q_lora_rank=256,
        )
        if layout.nbytes >= size_gib * GIB:
            return layout
        layers += 2
        vocab = min(vocab * 2, 65536)
    return layout


def worked_out() -> dict[str, Any]:
    """What each way sends per training step for DeepSeek-V3's own shapes, in bfloat16 (as
    a trainer exports its weights)."""
    from hybrid_draft.tools import synth

    layout = synth.deepseek_v3("full")
    n = layout.config["num_hidden_layers"]

    def bf16(t: Any) -> int:
        size = 2
        for d in t.shape:
            size *= d
        return size

    mtp = f"model.layers.{n}."
    base = sum(bf16(t) for t in layout.tensors if not t.name.startswith(mtp))
    # The MTP block the draft loads: its own copies of the embedding and head are what vLLM
    # replaces with the target's (a trainer's export need not send them).
    block = sum(
        bf16(t)
        for t in layout.tensors
        if t.name.startswith(mtp) and not t.name.endswith(("embed_tokens.weight", "head.weight"))
    )
    shared = sum(bf16(t) for t in layout.tensors if t.name in SHARED)
    return {
        "model": "DeepSeek-V3 (synth.deepseek_v3('full'): its config's shapes)",
        "dtype": "bfloat16",
        "base_bytes": base,
        "mtp_block_bytes": block,
        "embedding_and_head_bytes": shared,
        "vllm_draft_session": {"sessions": 2, "sent_bytes": base + block + shared},
        "one_session": {"sessions": 1, "sent_bytes": base + block},
        "saved_bytes_per_step": shared,
    }


def _chunks(weights: list[tuple[str, Any]]) -> list[list[tuple[str, Any]]]:
    out: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > CHUNK_BYTES:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


def _session(llm: Any, weights: list[tuple[str, Any]], draft: bool = False) -> dict[str, Any]:
    """One session of ``weights``; its calls' seconds and what it sent."""
    began = time.perf_counter()
    (llm.start_draft_weight_update if draft else llm.start_weight_update)()
    started = time.perf_counter()
    chunks = _chunks(weights)
    for chunk in chunks:
        llm.update_weights({"update_info": {"weights": chunk}})
    updated = time.perf_counter()
    llm.finish_weight_update()
    done = time.perf_counter()
    return {
        "start_seconds": started - began,
        "update_seconds": updated - started,
        "finish_seconds": done - updated,
        "seconds": done - began,
        "chunks": len(chunks),
        "sent_bytes": sum(t.numel() * t.element_size() for _, t in weights),
    }


def _direct(runner: Any, weights: list[tuple[str, Any]], way: str) -> dict[str, Any]:
    """One direct sync of ``weights`` by ``way`` (``direct_per_tensor`` or
    ``direct_buckets``, with ``_vllm``: on vLLM's own ``load_weights``), then its end: the
    runner's next step (nothing scheduled) or verl's post-load processing."""
    import functools

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.v1.core.sched.output import SchedulerOutput

    from hybrid_draft.adapter import direct

    model = runner.model
    vllms = way.endswith("_vllm")
    load = functools.partial(type(model).load_weights, model) if vllms else model.load_weights
    per_tensor = way.startswith("direct_per_tensor")
    calls = [[item] for item in weights] if per_tensor else _chunks(weights)
    with set_current_vllm_config(runner.vllm_config):
        began = time.perf_counter()
        for call in calls:
            load(weights=call)
        updated = time.perf_counter()
        served = vars(runner).get(direct.ATTR)
        update = served.update if isinstance(served, direct.Served) else None
        step = update.step if update is not None else None
        if per_tensor:
            runner.execute_model(SchedulerOutput.make_empty())
        else:
            process_weights_after_loading(model, runner.vllm_config.model_config, runner.device)
        done = time.perf_counter()
    return {
        "calls": len(calls),
        "update_seconds": updated - began,
        "finish_seconds": done - updated,
        "seconds": done - began,
        "draft_call_seconds": step.seconds if step is not None else 0.0,
        # The calls' seconds less the draft's loads inside them: the target's part.
        "target_seconds": updated - began - (step.seconds if step is not None else 0.0),
        "sent_bytes": sum(t.numel() * t.element_size() for _, t in weights),
    }


def measure(directory: Path, size_gib: float, runs: int) -> dict[str, Any]:
    """Write the two steps' checkpoints, serve the first, then ``runs`` syncs each way."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from safetensors.torch import load_file

    from hybrid_draft.tools import synth

    layout = model_layout(size_gib)
    steps = []
    for seed in (1, 2):
        path = directory / f"step{seed}"
        if not synth.is_complete(path):
            synth.write_checkpoint(path, layout, synth.shard(layout), seed=seed, draft="agrees")
        steps.append(path)
    register()
    from vllm import LLM

    cuda = torch.cuda.is_available()
    if not cuda:  # every linear layer keeps its weight, as on a GPU (the module's doc)
        from vllm.model_executor.layers.linear import LinearBase

        LinearBase._cpu_skip_gemm_dispatch = True  # type: ignore[attr-defined]
    # On the CPU: CPU_MLA, in float32 (AMX_MLA's kernel tensors cannot be reloaded in place).
    cpu: dict[str, Any] = {} if cuda else {"dtype": "float32", "attention_backend": "CPU_MLA"}
    spec: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": 1}
    if "attention_backend" in cpu:
        spec["attention_backend"] = cpu["attention_backend"]
    try:
        llm = _serve(LLM, steps[0], spec, cpu)
    except Exception as exc:  # a vLLM that cannot serve on this host: one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise Unservable(
            f"--weight-update: vLLM {_vllm_version()} cannot serve a model on this host "
            f"({type(exc).__name__}: {first})"
        ) from None
    llm.init_weight_transfer_engine({"init_info": {}})
    (runner,) = llm.collective_rpc(lambda worker: worker.model_runner)  # the engine's own
    device = "cuda" if cuda else "cpu"
    mtp = f"model.layers.{layout.config['num_hidden_layers']}."
    exports = []
    for path in steps:
        tensors: dict[str, Any] = {}
        for shard in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(str(shard), device=device))
        exports.append([(n, tensors[n]) for n in (t.name for t in layout.tensors)])
    rows: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    step = 1  # the server holds step 1: the first sync sends step 2
    previous = os.environ.get("HYBRID_DRAFT_RELOAD")
    try:
        for run in range(runs):
            for way in _order(run):
                export = exports[step]
                step = 1 - step
                if way == "vllm_draft_session":
                    os.environ["HYBRID_DRAFT_RELOAD"] = "off"  # vLLM's own, as it is
                    target = _session(llm, [(n, t) for n, t in export if not n.startswith(mtp)])
                    draft = _session(
                        llm,
                        [(n, t) for n, t in export if n.startswith(mtp) or n in SHARED],
                        draft=True,
                    )
                    rows[way].append(_step([target, draft]))
                elif way == "one_session":
                    os.environ["HYBRID_DRAFT_RELOAD"] = "auto"
                    rows[way].append(_step([_session(llm, export)]))
                else:
                    os.environ["HYBRID_DRAFT_RELOAD"] = "auto"
                    rows[way].append({**_direct(runner, export, way), "sessions": 0})
    finally:
        if previous is None:
            os.environ.pop("HYBRID_DRAFT_RELOAD", None)
        else:
            os.environ["HYBRID_DRAFT_RELOAD"] = previous
    ways = {way: _median(r) for way, r in rows.items()}
    return {
        "model": {"layers": layout.config["num_hidden_layers"], "bytes": layout.nbytes},
        "device": device,
        "runs": runs,
        "chunk_bytes": CHUNK_BYTES,
        "ways": ways,
        # What the layer adds to the trainer's calls on the target, the draft's part (its
        # loads inside the calls, reported apart as draft_call_seconds) left out: the median
        # calls' seconds with the layer over those on vLLM's own load_weights, and per call.
        "direct_added_us_per_call": {
            way: round(
                (
                    _median_of(rows[way], "target_seconds")
                    - _median_of(rows[f"{way}_vllm"], "update_seconds")
                )
                / ways[way]["calls"]
                * 1e6,
                1,
            )
            for way in DIRECT_WAYS
        },
        "direct_overhead": {
            way: round(
                _median_of(rows[way], "target_seconds")
                / _median_of(rows[f"{way}_vllm"], "update_seconds"),
                4,
            )
            for way in DIRECT_WAYS
        },
        "deepseek_v3": worked_out(),
    }


def _order(run: int) -> list[str]:
    """The ways in the order of ``run``: each direct way beside vLLM's own, first on every
    other run, so that neither is always the one that follows the other."""
    ways = list(SESSION_WAYS)
    for way in DIRECT_WAYS:
        pair = [f"{way}_vllm", way]
        ways += pair if run % 2 == 0 else pair[::-1]
    return ways


def _median_of(rows: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


class Unservable(RuntimeError):
    """vLLM here cannot serve the benchmark's model."""


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


def _serve(llm_class: Any, model: Path, spec: dict[str, Any], extra: dict[str, Any]) -> Any:
    return llm_class(
        model=str(model),
        load_format="safetensors",
        speculative_config=spec,
        max_model_len=256,
        enforce_eager=True,
        skip_tokenizer_init=True,  # nothing is generated
        weight_transfer_config={"backend": BACKEND},
        **extra,
    )


def _step(sessions: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "sessions": len(sessions),
        "sent_bytes": sum(s["sent_bytes"] for s in sessions),
        "chunks": sum(s["chunks"] for s in sessions),
        "seconds": sum(s["seconds"] for s in sessions),
        "finish_seconds": sum(s["finish_seconds"] for s in sessions),
        "draft_session_seconds": sessions[1]["seconds"] if len(sessions) > 1 else 0.0,
        "each": sessions,
    }


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median seconds, with every run's seconds."""
    ordered = sorted(rows, key=lambda r: r["seconds"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["runs_seconds"] = [round(r["seconds"], 6) for r in rows]
    out["median_seconds"] = statistics.median(r["seconds"] for r in rows)
    return out


def table(result: dict[str, Any]) -> str:
    from hybrid_draft.tools import tables

    def size(n: float) -> str:
        return f"{n / GIB:.2f} GiB" if n >= GIB / 4 else f"{n / (1 << 20):.1f} MiB"

    columns = [
        ("one training step's sync", "left"),
        ("sessions", "right"),
        ("sent", "right"),
        ("seconds", "right"),
        ("finish s", "right"),
    ]
    rows = [
        [
            way,
            str(r["sessions"]) if r["sessions"] else f"{r['calls']} calls",
            size(r["sent_bytes"]),
            f"{r['median_seconds']:.3f}",
            f"{r['finish_seconds']:.3f}",
        ]
        for way, r in result["ways"].items()
    ]
    ds = result["deepseek_v3"]
    rows += [
        [
            f"{way} (DeepSeek-V3, worked out)",
            str(ds[way]["sessions"]),
            size(ds[way]["sent_bytes"]),
            "-",
            "-",
        ]
        for way in SESSION_WAYS
    ]
    return tables.render(columns, rows)


def main(out: Path, size_gib: float, runs: int) -> int:
    result = measure(out, size_gib, runs)
    (out / "weight-update.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\na training step's weight sync, {result['device']}, median of {runs} runs "
        f"(a {result['model']['bytes'] / GIB:.2f} GiB dense DeepSeek-V3 of "
        f"{result['model']['layers']} layers; chunks of up to {CHUNK_BYTES >> 20} MiB):"
    )
    print(table(result))
    saved = result["deepseek_v3"]["saved_bytes_per_step"]
    print(
        f"\nDeepSeek-V3 in bfloat16: one session sends {saved / 1e9:.2f} GB less per step "
        "(the embedding and head a draft session sends again)"
    )
    for way, ratio in result["direct_overhead"].items():
        r = result["ways"][way]
        added = result["direct_added_us_per_call"][way]
        print(
            f"{way}: the trainer's calls on the target take {ratio:.3f}x their time on "
            f"vLLM's own load_weights ({added:+.1f} us a call); the draft's loads inside them "
            f"{r['draft_call_seconds']:.3f} s, the update's end {r['finish_seconds']:.3f} s"
        )
    print(f"\nwrote {out / 'weight-update.json'}")
    return 0
