"""Run by the CPU environment's Python (``tests/e2e/test_reload.py``): vLLM's offline ``LLM``
with the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), a target and its MTP
draft, then ``collective_rpc("reload_weights")`` three ways. Prints one JSON object: what the
probe (``hybrid_draft_e2e_probe.DraftProbe``) found after each step.

    python reloaddriver.py MODEL_DIR DOUBLED_DIR DTYPE
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    model, doubled, dtype = sys.argv[1:4]
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        load_format="instanttensor",
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        max_model_len=256,
        enforce_eager=True,
        dtype=dtype,
        worker_extension_cls="hybrid_draft_e2e_probe.DraftProbe",
    )

    def rpc(method: str, **kwargs: str) -> object:
        (result,) = llm.collective_rpc(method, kwargs=kwargs)
        return result

    out: dict[str, object] = {"own_parameters": rpc("remember_draft")}
    rpc("garble_draft")
    out["garbled"] = len(rpc("draft_mismatches"))  # type: ignore[arg-type]
    rpc("reload_weights")
    out["after_reload"] = rpc("draft_mismatches")
    rpc("garble_draft")
    rpc("reload_weights", weights_path=doubled)
    out["after_weights_path"] = rpc("draft_mismatches", scale="2")
    rpc("garble_draft")
    rpc("reload_from_stream", model_dir=doubled)
    out["after_stream"] = rpc("draft_mismatches", scale="2")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    out["generated"] = len(llm.generate(["Hello"], params)[0].outputs[0].token_ids)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
