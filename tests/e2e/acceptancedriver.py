"""The draft's acceptance in vLLM's offline ``LLM``, by vLLM's own counters: the figures of
docs/testing.md (checkpoints whose draft agrees with its target). Run by the CPU
environment's Python, the layer installed (tests/e2e builds both):

    VLLM_TARGET_DEVICE=cpu build/cpu-venv/bin/python tests/e2e/acceptancedriver.py \\
        MODEL_DIR DTYPE NUM_SPECULATIVE_TOKENS

Four greedy prompts, 64 tokens each, an MTP draft; prints one JSON object: the accepted and
drafted tokens between two reads of the process's Prometheus registry
(``hybrid_draft.tools.smoke.acceptance``), and the rate.
"""

from __future__ import annotations

import json
import os
import sys

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Speculative decoding works by",
    "The quick brown fox",
)


def main() -> None:
    model, dtype, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import prometheus_client
    from vllm import LLM, SamplingParams

    from hybrid_draft.tools import smoke

    llm = LLM(
        model=model,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=1024,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
        disable_log_stats=False,  # the spec-decode counters, in this process's registry
    )
    before = prometheus_client.generate_latest().decode()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate(list(PROMPTS), params)
    got = smoke.acceptance(before, prometheus_client.generate_latest().decode())
    print(
        json.dumps(
            {
                "model": model,
                "dtype": dtype,
                "num_speculative_tokens": k,
                "accepted": got.accepted,
                "drafted": got.drafted,
                "rate": got.rate,
            }
        )
    )


if __name__ == "__main__":  # the engine's process is spawned: this module is imported again
    main()
