"""Run by the CPU environment's Python (``tests/e2e/test_reload.py``): vLLM's offline ``LLM``
with the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), a target and its MTP
draft (agreeing checkpoints: ``hybrid-draft make-checkpoint``), then its weights updated in
place, and after each update the draft compared with a fresh boot's of the checkpoint it
should now hold, and its acceptance measured.

    python updatedriver.py boot MODEL_DIR OUT.pt [--keep-linear]
        boot MODEL_DIR and save its draft's own weights and buffers to OUT.pt (with
        ``--keep-linear``, every linear layer keeping its weight, as ``direct`` boots);
    python updatedriver.py reloads STEP1 STEP2 WORK_DIR
        boot STEP1 (its draft saved as WORK_DIR/step1.pt; WORK_DIR/step2.pt is STEP2's boot),
        then ``collective_rpc("reload_weights")`` three ways, the draft's own parameters
        overwritten before each, as a level-2 sleep leaves them: no argument (STEP1 again),
        ``weights_path=STEP2``, and a weights iterator of STEP1 (the probe's
        ``reload_from_stream``);
    python updatedriver.py sessions STEP1 STEP2 WORK_DIR
        the same boot, then a trainer's weight-transfer sessions through ``LLM``'s own methods
        (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
        ``finish_weight_update``, ``start_draft_weight_update``) over the tests' backend
        (``hybrid_draft_e2e_transfer``: vLLM's IPC engine, each chunk a file this process
        writes): the whole of STEP2 in one chunk, STEP1 one shard per chunk, STEP2 with its
        MTP layer split across two chunks, STEP1 without its MTP layer, then vLLM's own draft
        session with STEP1's MTP block, embedding and head;
    python updatedriver.py direct STEP1 STEP2 WORK_DIR
        the same boot with every linear layer keeping its weight (WORK_DIR/step2-kept.pt is
        STEP2's boot so made), then each RL framework's sync of a whole step by direct
        ``load_weights`` calls on the target, as its own source makes them
        (``hybrid_draft_e2e_trainers``), reaching the worker's model runner through
        ``collective_rpc`` with a callable, alternating STEP2 and STEP1: verl (the target and
        the V1 runner's ``drafter``, buckets that split the MTP layer, then its post-load
        processing), OpenRLHF, AReaL from disk, skyrl, TRL, NeMo RL, then OpenRLHF's sync of
        STEP2 without the MTP layer. Each is judged after the next generation, which ends
        the update for the callers that signal no end.

vLLM's CPU build packs each linear weight after loading and empties the parameter, so that a
direct ``load_weights`` raises there, with the layer or without it; a GPU keeps the weights,
which every framework relies on. ``direct`` and ``boot --keep-linear`` give every linear
layer vLLM's own plain-linear path, the one its CPU build takes for MLA's ``kv_b_proj``
(``_cpu_skip_gemm_dispatch``), before the engine is built.

Every load names CPU_MLA in float32 (tests/hostcpu.py: what a weight update needs on any
host). Prints one JSON object (its last line): per step, the draft's own tensors that differ
from the fresh boot's of the checkpoint it should hold, and vLLM's own counters of drafted and
accepted tokens over that step's greedy generation.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

PROMPTS = ["The quick brown fox", "Speculative decoding is", "In a hybrid loader,", "Hello"]


def make_llm(model: str) -> Any:
    import hybrid_draft_e2e_transfer as transfer
    from vllm import LLM

    transfer.register()
    return LLM(
        model=model,
        load_format="instanttensor",
        speculative_config={
            "method": "mtp",
            "num_speculative_tokens": 1,
            "attention_backend": "CPU_MLA",
        },
        attention_backend="CPU_MLA",  # tests/hostcpu.py: what a weight update needs, any host
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        disable_log_stats=False,
        worker_extension_cls="hybrid_draft_e2e_probe.DraftProbe",
        weight_transfer_config={"backend": transfer.NAME},
    )


def rpc(llm: Any, method: str, **kwargs: str) -> Any:
    (result,) = llm.collective_rpc(method, kwargs=kwargs)
    return result


def keep_linear_weights() -> None:
    """Every linear layer keeps its weight after loading, as on a GPU: vLLM's own plain-linear
    path of its CPU build (``_cpu_skip_gemm_dispatch``, MLA's ``kv_b_proj``'s), for all."""
    from vllm.model_executor.layers.linear import LinearBase

    LinearBase._cpu_skip_gemm_dispatch = True


def acceptance(llm: Any) -> dict[str, float]:
    """Greedy decoding of a few prompts; vLLM's counters over it alone, read from this
    process's Prometheus registry as smoke reads a server's ``/metrics``."""
    import prometheus_client
    from vllm import SamplingParams

    from hybrid_draft.tools import smoke

    before = prometheus_client.generate_latest().decode()
    llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    got = smoke.acceptance(before, prometheus_client.generate_latest().decode())
    return {"accepted": got.accepted, "drafted": got.drafted}


def tensors(model_dir: str, keep: Any = None) -> dict[str, Any]:
    """Every tensor of ``model_dir`` in file order (those ``keep`` says yes to)."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        for name, tensor in load_file(str(shard)).items():
            if keep is None or keep(name):
                out[name] = tensor
    return out


class Trainer:
    def __init__(self, llm: Any, work: Path) -> None:
        self.llm, self.work, self.sent = llm, work, 0
        llm.init_weight_transfer_engine({"init_info": {}})

    def session(self, chunks: list[dict[str, Any]], draft: bool = False) -> None:
        import hybrid_draft_e2e_transfer as transfer

        (self.llm.start_draft_weight_update if draft else self.llm.start_weight_update)()
        for chunk in chunks:
            self.sent += 1
            path = self.work / f"chunk-{self.sent}.safetensors"
            self.llm.update_weights({"update_info": transfer.write_chunk(str(path), chunk)})
            path.unlink()
        self.llm.finish_weight_update()


def mtp_prefix(model_dir: str) -> str:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return f"model.layers.{config['num_hidden_layers']}."


class Steps:
    """One ``LLM`` booted from STEP1, and what each step found."""

    def __init__(self, step1: str, step2: str, work: Path) -> None:
        self.llm = make_llm(step1)
        rpc(self.llm, "save_draft", path=str(work / "step1.pt"))
        self.reference = {step1: str(work / "step1.pt"), step2: str(work / "step2.pt")}
        self.found: dict[str, Any] = {
            "own_parameters": rpc(self.llm, "remember_draft"),
            "boot": {"acceptance": acceptance(self.llm)},
        }

    def check(self, step: str, holds: str) -> None:
        """The draft against the fresh boot of ``holds``, and its acceptance now."""
        self.found[step] = {
            "differs": rpc(self.llm, "draft_differs_from", path=self.reference[holds]),
            "acceptance": acceptance(self.llm),
        }


def reloads(step1: str, step2: str, work: Path) -> dict[str, Any]:
    steps = Steps(step1, step2, work)
    llm = steps.llm
    steps.found["garbled"] = rpc(llm, "garble_draft")
    rpc(llm, "reload_weights")
    steps.check("after_reload", step1)
    rpc(llm, "garble_draft")
    rpc(llm, "reload_weights", weights_path=step2)
    steps.check("after_weights_path", step2)
    rpc(llm, "garble_draft")
    rpc(llm, "reload_from_stream", model_dir=step1)
    steps.check("after_stream", step1)
    return steps.found


def sessions(step1: str, step2: str, work: Path) -> dict[str, Any]:
    steps = Steps(step1, step2, work)
    llm, check, out = steps.llm, steps.check, steps.found
    mtp = mtp_prefix(step1)
    trainer = Trainer(llm, work)

    # One chunk: the whole next step (a trainer's export of the model, MTP layer included).
    trainer.session([tensors(step2)])
    check("one_chunk", step2)
    # One shard per chunk, back to the first step.
    trainer.session([tensors(step1, names.__contains__) for names in shard_names(step1)])
    check("one_shard_per_chunk", step1)
    # The MTP layer split across two chunks (inside its fused q_a/kv_a projection).
    every = tensors(step2)
    order = list(every)
    cut = order.index(f"{mtp}self_attn.q_a_proj.weight") + 1
    trainer.session([{n: every[n] for n in order[:cut]}, {n: every[n] for n in order[cut:]}])
    check("mtp_split", step2)
    # A session without the MTP layer (the base model's export): the draft keeps step 2's
    # weights while the target is step 1's.
    trainer.session([tensors(step1, lambda n: not n.startswith(mtp))])
    check("without_mtp", step2)
    # Then vLLM's own draft session with a trainer's draft export of step 1: the MTP block,
    # the embedding and the head.
    export = ("model.embed_tokens.weight", "lm_head.weight")
    trainer.session([tensors(step1, lambda n: n.startswith(mtp) or n in export)], draft=True)
    check("draft_session", step1)
    return out


def direct(step1: str, step2: str, work: Path) -> dict[str, Any]:
    """Each framework's direct sync, alternating the two steps, each judged after a step."""
    import hybrid_draft_e2e_trainers as trainers

    keep_linear_weights()
    steps = Steps(step1, step2, work)
    steps.reference[step2] = str(work / "step2-kept.pt")
    llm, out = steps.llm, steps.found
    mtp = mtp_prefix(step1)

    def synced(step: str, holds: str, sync: Any) -> None:
        """``sync(model_runner)`` in the worker (what it raised, if anything), then the next
        generation (which ends an update its caller signals no end of), then the draft
        against ``holds``'s boot."""
        found: dict[str, Any] = {"error": None}
        try:
            llm.collective_rpc(lambda worker: sync(worker.model_runner))
        except Exception as exc:  # what the framework's own call raised, said
            found["error"] = f"{type(exc).__name__}: {exc}"
        found["acceptance"] = acceptance(llm)
        found["differs"] = rpc(llm, "draft_differs_from", path=steps.reference[holds])
        out[step] = found

    every = {step1: tensors(step1), step2: tensors(step2)}

    def cut(step: str) -> list[str]:
        """Buckets: the base model, then the MTP layer split inside its fused projection."""
        names = list(every[step])
        first = next(i for i, n in enumerate(names) if n.startswith(mtp))
        return [names[first - 1], f"{mtp}self_attn.q_a_proj.weight"]

    for name, step, holds in (
        ("verl", "verl", step2),
        ("openrlhf", "openrlhf", step1),
        ("skyrl", "skyrl", step2),
        ("trl", "trl", step1),
        ("nemo_rl", "nemo_rl", step2),
    ):
        sync = trainers.SYNCS[name]
        synced(step, holds, lambda runner, s=sync, h=holds: s(runner, every[h], cut(h)))

    def streams(runner: Any) -> None:
        """A checkpoint-engine style caller: the step the draft holds streamed into the
        target's load_weights, then at once the previous one, no step between."""
        for step in (step2, step1):
            runner.model.load_weights(weights=(item for item in every[step].items()))

    synced("streams", step1, streams)
    synced("areal_disk", step1, lambda runner: trainers.areal_disk(runner, step1))
    # The base model alone: the draft keeps step 1's weights while the target is step 2's.
    base = {n: t for n, t in every[step2].items() if not n.startswith(mtp)}
    synced("without_mtp", step1, lambda runner: trainers.openrlhf(runner, base))
    return out


def shard_names(model_dir: str) -> list[set[str]]:
    from safetensors import safe_open

    out = []
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out.append(set(f.keys()))
    return out


def main() -> None:
    what = sys.argv[1]
    if what == "boot":
        model, path = sys.argv[2:4]
        if sys.argv[4:] == ["--keep-linear"]:
            keep_linear_weights()
        llm = make_llm(model)
        found = {"saved": rpc(llm, "save_draft", path=path), "acceptance": acceptance(llm)}
    elif what in ("reloads", "sessions", "direct"):
        step1, step2, work = sys.argv[2:5]
        run = {"reloads": reloads, "sessions": sessions, "direct": direct}[what]
        found = run(step1, step2, Path(work))
    else:
        raise SystemExit(f"sessiondriver: unknown command {what!r}")
    print(json.dumps(found))


if __name__ == "__main__":
    main()
