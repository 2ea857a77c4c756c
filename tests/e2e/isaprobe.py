"""Load a checkpoint's target and MTP draft with vLLM's CPU build as an AMX host would.

Run by the CPU environment's Python (tests/e2e/test_isa.py). vLLM asks
``torch.cpu._is_amx_tile_supported()`` wherever it picks a CPU kernel; here that question is
answered yes before vLLM is imported, so the real ``get_model`` and ``EagleProposer`` build
the AMX_MLA attention, the sgl-kernel GEMM and the AMX fused-MoE experts and run their
``process_weights_after_loading``: the VNNI packing (``convert_weight_packed``) whose shape
and dtype checks reject what an AMX host cannot serve. Packing only rearranges memory, so it
runs on any x86 host; nothing here computes with AMX instructions (no forward pass).

Prints one JSON object: what was selected, or the error the load stopped with.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import Any

import torch

torch.cpu._is_amx_tile_supported = lambda: True  # type: ignore[assignment]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _selected(model: Any) -> dict[str, list[str]]:
    """The kernels each module of a loaded model was given, by kind."""
    seen: dict[str, set[str]] = {"attention": set(), "linear": set(), "experts": set()}
    for module in model.modules():
        impl = getattr(module, "impl", None)
        if impl is not None and type(module).__name__.endswith("Attention"):
            seen["attention"].add(type(impl).__name__)
        linear = getattr(module, "cpu_linear", None)
        if linear is not None:
            name = getattr(linear, "__qualname__", type(linear).__name__)
            code = getattr(linear, "__code__", None)
            sgl = code is not None and "weight_packed_linear_cpu" in code.co_names
            seen["linear"].add("sgl weight_packed_linear" if sgl else name)
        experts = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if experts is not None:
            seen["experts"].add(type(getattr(experts, "fused_experts", experts)).__name__)
    return {k: sorted(v) for k, v in seen.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--case", action="append", required=True, help="NAME=CHECKPOINT_DIR:DTYPE, repeated"
    )
    args = parser.parse_args()

    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()
    out: dict[str, dict[str, Any]] = {}
    joined = False  # one world of one rank for every load of this process
    for case in args.case:
        name, _, rest = case.partition("=")
        checkpoint, _, dtype = rest.rpartition(":")
        config = EngineArgs(
            model=checkpoint,
            load_format="safetensors",
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
            dtype=dtype,
            max_model_len=128,
            enforce_eager=True,
            skip_tokenizer_init=True,
        ).create_engine_config()
        result: dict[str, Any] = out.setdefault(name, {})
        with set_current_vllm_config(config):
            if not joined:
                init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_free_port()}", 0, "gloo")
                ensure_model_parallel_initialized(1, 1)
                joined = True
            try:
                target = get_model(vllm_config=config)
                result["target"] = _selected(target)
                proposer = EagleProposer(config, torch.device("cpu"), runner=None)
                proposer.load_model(target)
                result["draft"] = _selected(proposer.model)
            except Exception as e:  # the answer the test reads: what an AMX host would hit
                text = str(e).splitlines()[0] if str(e) else ""
                result["error"] = f"{type(e).__name__}: {text}"
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
