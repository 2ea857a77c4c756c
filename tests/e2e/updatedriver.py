"""Run by the CPU environment's Python (``tests/e2e/test_reload.py``): vLLM's offline ``LLM``
with the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), a target and its MTP
draft (agreeing checkpoints: ``hybrid-draft make-checkpoint``), then its weights updated in
place, and after each update the draft compared with a fresh boot's of the checkpoint it
should now hold, and its acceptance measured.

    python updatedriver.py boot MODEL_DIR OUT.pt
        boot MODEL_DIR and save its draft's own weights and buffers to OUT.pt;
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
        session with STEP1's MTP block, embedding and head.

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
        llm = make_llm(model)
        found = {"saved": rpc(llm, "save_draft", path=path), "acceptance": acceptance(llm)}
    elif what in ("reloads", "sessions"):
        step1, step2, work = sys.argv[2:5]
        found = (reloads if what == "reloads" else sessions)(step1, step2, Path(work))
    else:
        raise SystemExit(f"sessiondriver: unknown command {what!r}")
    print(json.dumps(found))


if __name__ == "__main__":
    main()
