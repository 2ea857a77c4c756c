"""Load a checkpoint's target and MTP draft with vLLM's CPU build, as this host or an AMX
host selects its kernels.

Run by the CPU environment's Python (tests/e2e/test_isa.py). vLLM asks
``torch.cpu._is_amx_tile_supported()`` wherever it picks a CPU kernel. With ``--select amx``
that question is answered yes before vLLM is imported, so the real ``get_model`` and
``EagleProposer`` build the AMX_MLA attention, the sgl-kernel GEMM and the AMX fused-MoE
experts and run their ``process_weights_after_loading``: the VNNI packing
(``convert_weight_packed``) whose shape and dtype checks reject what an AMX host cannot
serve. Packing only rearranges memory, so it runs on any host whose CPU can load the kernel
library that holds it (vLLM's ``_C``, built for AVX-512); nothing here computes with AMX
instructions (no forward pass). With ``--select host`` (the default) nothing is answered for
vLLM: the load is what this host serves with.

With ``--reload``, each case's target is then reloaded in place from its own checkpoint by
vLLM's layerwise reload (``initialize_layerwise_reload``, the model's ``load_weights``,
``finalize_layerwise_reload``: what ``reload_weights`` and a weight-transfer session run),
which restores the kernel tensors each layer's processing made: ``"reload"`` is ``"ok"`` or
the error it stopped with. A case may name the MLA attention backend for its target and
draft (``NAME=DIR:DTYPE:BACKEND``).

Prints one JSON object: per case, what was selected, or the error the load stopped with;
under ``"host"``, the kernel library vLLM loaded (``CpuPlatform.import_kernels``: the file
mapped into this process) and whether it has the shared-memory communicator's
``init_shm_manager``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import Any

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _linear_kind(linear: Any) -> str:
    """What a linear layer's ``cpu_linear`` (``dispatch_cpu_unquantized_gemm``) calls."""
    if linear is torch.nn.functional.linear:
        return "torch linear"
    code = getattr(linear, "__code__", None)
    names = code.co_names if code is not None else ()
    if "weight_packed_linear_cpu" in names:
        return "sgl weight_packed_linear"
    if "onednn_mm" in names:
        return "oneDNN onednn_mm"
    return str(getattr(linear, "__qualname__", type(linear).__name__))


def _selected(model: Any, config: Any) -> dict[str, list[str]]:
    """The kernels each module of a loaded model was given, by kind."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    seen: dict[str, set[str]] = {
        "attention": set(),
        "attention_isa": set(),
        "linear": set(),
        "experts": set(),
    }
    for module_name, module in model.named_modules():
        impl = getattr(module, "impl", None)
        if impl is not None and type(module).__name__.endswith("Attention"):
            seen["attention"].add(type(impl).__name__)
            head_size = getattr(impl, "head_size", None)
            block_size = config.cache_config.block_size
            if type(impl).__name__ == "CPUAttentionBackendImpl" and head_size and block_size:
                # The CPU attention's ISA is fixed when the KV cache is laid out (no forward
                # pass here): vLLM's own choice for this layer's dtype, block and head size.
                seen["attention_isa"].add(
                    _get_attn_isa(config.model_config.dtype, block_size, head_size)
                )
        linear = getattr(module, "cpu_linear", None)
        if linear is not None:
            kind = _linear_kind(linear)
            if kind == "torch linear":  # which layer keeps torch's own, by its name
                kind += f": {module_name.rsplit('.', 1)[-1]}"
            seen["linear"].add(kind)
        experts = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if experts is not None:
            fused = getattr(experts, "fused_experts", experts)
            isa = getattr(fused, "isa", None)
            seen["experts"].add(type(fused).__name__ + (f" ({isa})" if isa else ""))
    return {k: sorted(v) for k, v in seen.items()}


def _host() -> dict[str, Any]:
    """The kernel library vLLM loaded into this process, and what it offers."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        mapped = {line.split()[-1] for line in f if "/vllm/_C" in line}
    names = sorted({p.rsplit("/", 1)[-1].split(".", 1)[0] for p in mapped})
    return {
        "kernel_libraries": names,
        "init_shm_manager": hasattr(torch.ops._C, "init_shm_manager"),
        "convert_weight_packed": hasattr(torch.ops._C, "convert_weight_packed"),
        "amx": bool(torch.cpu._is_amx_tile_supported()),
    }


def _reload(model: Any, config: Any, checkpoint: str) -> str:
    """Reload ``model`` in place from ``checkpoint`` by vLLM's layerwise reload."""
    import glob
    import os

    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    def weights() -> Any:
        for path in sorted(glob.glob(os.path.join(checkpoint, "*.safetensors"))):
            yield from load_file(path).items()

    try:
        initialize_layerwise_reload(model)
        model.load_weights(weights())
        finalize_layerwise_reload(model, config.model_config)
    except Exception as e:
        text = str(e).splitlines()[0] if str(e) else ""
        return f"{type(e).__name__}: {text}"
    return "ok"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--case",
        action="append",
        required=True,
        help="NAME=CHECKPOINT_DIR:DTYPE[:MLA_BACKEND], repeated",
    )
    parser.add_argument(
        "--reload", action="store_true", help="then reload each target in place, layerwise"
    )
    parser.add_argument(
        "--select",
        choices=("host", "amx"),
        default="host",
        help="host: as this host selects; amx: vLLM's AMX question answered yes",
    )
    args = parser.parse_args()
    if args.select == "amx":  # before vLLM is imported: it asks wherever it picks
        torch.cpu._is_amx_tile_supported = lambda: True  # type: ignore[assignment]

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
        checkpoint, dtype, *backend = rest.split(":")
        named: dict[str, Any] = {"attention_backend": backend[0]} if backend else {}
        config = EngineArgs(
            model=checkpoint,
            load_format="safetensors",
            speculative_config={"method": "mtp", "num_speculative_tokens": 1, **named},
            dtype=dtype,
            max_model_len=128,
            enforce_eager=True,
            skip_tokenizer_init=True,
            **named,
        ).create_engine_config()
        result: dict[str, Any] = out.setdefault(name, {})
        with set_current_vllm_config(config):
            if not joined:
                init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_free_port()}", 0, "gloo")
                ensure_model_parallel_initialized(1, 1)
                joined = True
            try:
                target = get_model(vllm_config=config)
                result["target"] = _selected(target, config)
                proposer = EagleProposer(config, torch.device("cpu"), runner=None)
                proposer.load_model(target)
                result["draft"] = _selected(proposer.model, config)
                if args.reload:
                    result["reload"] = _reload(target, config, checkpoint)
            except Exception as e:  # the answer the test reads: what an AMX host would hit
                text = str(e).splitlines()[0] if str(e) else ""
                result["error"] = f"{type(e).__name__}: {text}"
    out["host"] = _host()
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
