"""What the host's CPU makes vLLM's CPU code choose, and the test-side choices that follow.

vLLM asks ``torch.cpu._is_amx_tile_supported()`` wherever it picks a CPU kernel: the MLA
attention backend (``CpuPlatform.get_attn_backend_cls``: AMX_MLA where AMX tiles are
available, else CPU_MLA), the sgl-kernel GEMM for small linear layers
(``check_cpu_sgl_kernel``), the AMX fused-MoE experts and the CPU attention's ISA. The
tests ask the same question, so each host runs what vLLM selects for it, with two
exceptions that follow from the kernels themselves (docs/testing.md):

- **Served models** (vLLM's CPU build): where AMX is available they are served in bfloat16,
  since AMX_MLA takes only bfloat16 and its weight packing (``convert_weight_packed``)
  rejects float32; elsewhere in float32, what the reference kernels compute in.
- **In-process loads** (vLLM 0.33's CUDA build with ``VLLM_TARGET_DEVICE=cpu``): that build's
  ``vllm._C`` has none of the CPU kernels AMX_MLA and the sgl GEMM call
  (``convert_weight_packed``), so on an AMX host an MLA model gets CPU_MLA explicitly and
  every load stays float32 (``check_cpu_sgl_kernel`` is false for it). On other hosts vLLM's
  own selection already gives CPU_MLA, and nothing is forced.

:func:`force_amx` makes vLLM's own question (and so :func:`amx`) answer yes on any host, so
an AMD or AVX2 machine checks what an AMX host selects; ``HYBRID_DRAFT_TEST_AMX=1`` does so
for a whole in-process test session (tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

#: Set to 1: the in-process test session answers vLLM's AMX question yes (tests/conftest.py).
FORCE_ENV = "HYBRID_DRAFT_TEST_AMX"


def amx() -> bool:
    """Whether vLLM's CPU code takes its AMX paths here: the question vLLM asks."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def serving_dtype() -> str:
    """The ``--dtype`` a model served by vLLM's CPU build runs in on this host."""
    return "bfloat16" if amx() else "float32"


def inprocess_mla_backend() -> dict[str, Any]:
    """Engine arguments an MLA model loaded in process needs on this host (CUDA build)."""
    return {"attention_backend": "CPU_MLA"} if amx() else {}


def kernel_library() -> str:
    """The kernel library vLLM's CPU build loads on this x86 host.

    ``CpuPlatform.import_kernels`` asks torch: ``_C`` (AVX-512 with BF16; the only one with
    the AMX kernels and the sgl GEMM: ``convert_weight_packed``), ``_C_AVX512`` (AVX-512
    without BF16), else ``_C_AVX2``. tests/e2e/test_isa.py checks the answer against the
    library a real load maps.
    """
    import torch

    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"


def amx_kernels_unavailable() -> str | None:
    """Why vLLM's AMX kernels cannot be loaded on this host, AMX answered yes or not; None
    where they can (the host loads ``_C``)."""
    library = kernel_library()
    if library == "_C":
        return None
    if library == "_C_AVX2":
        return (
            "this CPU has no avx512f: vLLM's CPU build loads _C_AVX2, which has none of the "
            "AMX kernels (no convert_weight_packed), and its AVX-512 library vllm._C cannot be "
            "imported here (SIGILL)"
        )
    return (
        "this CPU has avx512f but no avx512_bf16: vLLM's CPU build loads _C_AVX512, which has "
        "none of the AMX kernels (no convert_weight_packed), instead of vllm._C"
    )


@contextmanager
def amx_answer(answer: bool) -> Iterator[None]:
    """vLLM's AMX question answered ``answer`` in this process."""
    import torch

    real = torch.cpu._is_amx_tile_supported
    torch.cpu._is_amx_tile_supported = lambda: answer  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cpu._is_amx_tile_supported = real  # type: ignore[assignment]


def force_amx() -> AbstractContextManager[None]:
    """vLLM's AMX question answered yes in this process, as on an AMX host."""
    return amx_answer(True)


def without_amx() -> AbstractContextManager[None]:
    """vLLM's AMX question answered no in this process: for an in-process bfloat16 load,
    which on an AMX host would take the sgl GEMM (``convert_weight_packed``) that the
    CUDA build's ``vllm._C`` lacks. A no-op elsewhere."""
    return amx_answer(False)


def describe() -> str:
    """The host's CPU model and the ISA flags vLLM's CPU build selects on, in one line."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("amx_tile", "amx_bf16", "avx512f", "avx512_bf16", "avx512_vnni", "avx2")
    return f"{model}: {' '.join(f for f in wanted if f in flags) or 'none of ' + ','.join(wanted)}"
