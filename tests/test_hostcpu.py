"""In-process loads take the same kernels on every host, whatever the host or a test answers.

The in-process tests run the CUDA build of vLLM with ``VLLM_TARGET_DEVICE=cpu``. Its kernel
library has none of the CPU kernels vLLM's AMX paths call (``convert_weight_packed``), so the
session decides once (tests/hostcpu.py): vLLM's AMX question answered no, CPU_MLA named for
MLA models. Here that decision holds on this host and with AMX forced, in float32 and in
bfloat16 (where AMX would also take the sgl GEMM); what vLLM picks by itself with AMX stops at
the missing kernel, which is why the decision is made; and what vLLM cached under that answer
reaches no later load.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest

import hostcpu
from conftest import engine_config, load_target_and_draft

pytestmark = pytest.mark.vllm

HOSTS = {"this host": nullcontext, "AMX forced": hostcpu.force_amx}


def _attention_impls(model: Any) -> set[str]:
    return {
        type(m.impl).__name__
        for m in model.modules()
        if getattr(m, "impl", None) is not None and type(m).__name__.endswith("Attention")
    }


def _sgl_gemms(model: Any) -> tuple[int, list[str]]:
    """How many linear layers vLLM gave a CPU GEMM, and those given the sgl (AMX) one."""
    gemms = [(n, m.cpu_linear) for n, m in model.named_modules() if hasattr(m, "cpu_linear")]
    sgl = [
        n
        for n, linear in gemms
        if "weight_packed_linear_cpu" in getattr(getattr(linear, "__code__", None), "co_names", ())
    ]
    return len(gemms), sgl


def _vllms_own_pick(model: Path) -> Any:
    """The engine config with no backend named, in bfloat16: what vLLM picks by itself."""
    return engine_config(
        model,
        dtype="bfloat16",
        attention_backend=None,
        speculative_config={
            "method": "mtp",
            "num_speculative_tokens": 1,
            "attention_backend": None,
        },
    )


@pytest.mark.parametrize("host", list(HOSTS))
def test_vllm_hears_no_amx_in_process_where_its_library_lacks_the_kernels(
    host: str, vllm_runtime: Any
) -> None:
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    kernels = hasattr(torch.ops._C, hostcpu.AMX_KERNEL)
    context: AbstractContextManager[None] = HOSTS[host]()
    with context:
        assert hostcpu.amx() or host != "AMX forced"
        # What vLLM hears: the host's answer only where its library has the AMX kernels.
        assert torch.cpu._is_amx_tile_supported() is (hostcpu.amx() and kernels)
        assert (hostcpu.inprocess_amx_missing() is None) is kernels
    if not kernels:  # this CUDA build, on every host
        assert hostcpu.AMX_KERNEL in (hostcpu.inprocess_amx_missing() or "")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("host", list(HOSTS))
def test_an_mla_load_in_process_takes_cpu_mla_and_no_amx_path(
    host: str, dtype: str, deepseek: Path, instanttensor_standin: object
) -> None:
    context: AbstractContextManager[None] = HOSTS[host]()
    with context:
        config = engine_config(deepseek, dtype=dtype)
        assert config.attention_config.backend.name == "CPU_MLA"
        assert str(config.model_config.dtype) == f"torch.{dtype}"
        loaded = load_target_and_draft(config)
    for model in (loaded.target, loaded.draft):
        assert _attention_impls(model) == {"CPUMLAImpl"}
        gemms, sgl = _sgl_gemms(model)
        assert gemms and sgl == []


def test_vllms_own_amx_pick_stops_at_the_missing_kernel_and_stays_in_its_test(
    deepseek: Path, instanttensor_standin: object
) -> None:
    """vLLM told AMX yes, no backend named: it picks AMX_MLA and the sgl GEMM, which this
    build cannot load. The backend it cached for that config serves no later load: the same
    config then loads with CPU_MLA, and so does the suite's own."""
    with hostcpu.amx_answer_for_vllm(True), pytest.raises(Exception, match=hostcpu.AMX_KERNEL):
        load_target_and_draft(_vllms_own_pick(deepseek))
    for config in (_vllms_own_pick(deepseek), engine_config(deepseek, dtype="bfloat16")):
        loaded = load_target_and_draft(config)
        assert _attention_impls(loaded.target) == {"CPUMLAImpl"}
        assert _attention_impls(loaded.draft) == {"CPUMLAImpl"}
