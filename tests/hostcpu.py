"""What the host's CPU makes vLLM's CPU code choose, and the test-side choices that follow.

vLLM asks ``torch.cpu._is_amx_tile_supported()`` wherever it picks a CPU kernel: the MLA
attention backend (``CpuPlatform.get_attn_backend_cls``: AMX_MLA where AMX tiles are
available, else CPU_MLA), the sgl-kernel GEMM for small linear layers
(``check_cpu_sgl_kernel``), the AMX fused-MoE experts and the CPU attention's ISA. Those AMX
paths call kernels (``convert_weight_packed``) that only the ``_C`` of vLLM's CPU build holds.
Two kinds of load follow from that (docs/testing.md):

- **Served models** (vLLM's CPU build, in a process of their own): vLLM selects as it does on
  this host. Where AMX is available they are served in bfloat16, since AMX_MLA takes only
  bfloat16 and its weight packing rejects float32; elsewhere in float32, what the reference
  kernels compute in (:func:`serving_dtype`).
- **In-process loads** (the CUDA build of vLLM with ``VLLM_TARGET_DEVICE=cpu``): the session
  decides once, by what the kernel library vLLM loads in this process holds, not by the CPU's
  flags (:func:`inprocess_session`). Where that library lacks ``convert_weight_packed`` (the
  CUDA build's does, on every host), vLLM's AMX question is answered no for the whole session,
  whatever the CPU or a forced answer says. Every load also names the one MLA backend every
  library implements, CPU_MLA, and float32 (:func:`inprocess_engine_args`). So no host kind,
  forced answer or choice vLLM cached in an earlier test changes what an in-process load takes.

:func:`force_amx` makes the host's answer (:func:`amx`) yes on any host, so an AMD or AVX2
machine checks what an AMX host selects (``HYBRID_DRAFT_TEST_AMX=1``: for a whole test
session, tests/conftest.py); vLLM in this process hears it too, unless the in-process decision
answers no. :func:`amx_answer_for_vllm` answers vLLM regardless of the decision, for the
controls that show what vLLM would pick by itself.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

#: Set to 1: the in-process test session answers vLLM's AMX question yes (tests/conftest.py).
FORCE_ENV = "HYBRID_DRAFT_TEST_AMX"

#: The kernel vLLM's AMX paths pack their weights with (AMX_MLA's W_UK/W_UV, the sgl GEMM,
#: the AMX experts): where the library vLLM loads lacks it, no AMX path can load.
AMX_KERNEL = "convert_weight_packed"

#: The MLA attention backend every in-process MLA load names: vLLM's reference, which every
#: kernel library implements and which takes float32 and bfloat16 alike.
INPROCESS_MLA_BACKEND = "CPU_MLA"


@dataclasses.dataclass
class _Answers:
    """Who answers vLLM's AMX question in this process, and how."""

    #: torch's own question, kept while :func:`_answer` stands in for it.
    torch_own: Callable[[], bool] | None = None
    #: The host's answer, forced (:func:`force_amx`); None: the CPU's own.
    host: bool | None = None
    #: Why vLLM is answered no in this process (the in-process decision); None: no decision.
    inprocess_no: str | None = None
    #: vLLM's answer whatever the decision (:func:`amx_answer_for_vllm`); None: not set.
    vllm: bool | None = None


_ANSWERS = _Answers()
_IN_SESSION: list[str | None] = []  # the decision of each open in-process session


def amx() -> bool:
    """Whether this host has AMX tiles, as torch answers vLLM (or as :func:`force_amx` says)."""
    if _ANSWERS.host is not None:
        return _ANSWERS.host
    import torch

    return bool((_ANSWERS.torch_own or torch.cpu._is_amx_tile_supported)())


def _answer() -> bool:
    """``torch.cpu._is_amx_tile_supported`` while any answer here is in force: vLLM's view."""
    if _ANSWERS.vllm is not None:
        return _ANSWERS.vllm
    if _ANSWERS.inprocess_no is not None:
        return False
    return amx()


def _forget_vllm_choices() -> None:
    """Drop the attention backends vLLM cached (``_cached_get_attn_backend``, keyed without
    the AMX answer): a choice made under one answer must not serve a load under another."""
    selector = sys.modules.get("vllm.v1.attention.selector")
    cached = getattr(selector, "_cached_get_attn_backend", None)
    if cached is not None:
        cached.cache_clear()


@contextmanager
def _answering(**changes: Any) -> Iterator[None]:
    """:func:`_answer` standing in for torch's question with ``changes`` made, all undone on
    leaving (contexts nest)."""
    import torch

    before = dataclasses.replace(_ANSWERS)
    installed = torch.cpu._is_amx_tile_supported
    if _ANSWERS.torch_own is None:
        _ANSWERS.torch_own = installed
    for key, value in changes.items():
        setattr(_ANSWERS, key, value)
    torch.cpu._is_amx_tile_supported = _answer
    _forget_vllm_choices()
    try:
        yield
    finally:
        for field in dataclasses.fields(_Answers):
            setattr(_ANSWERS, field.name, getattr(before, field.name))
        torch.cpu._is_amx_tile_supported = installed
        _forget_vllm_choices()


def force_amx() -> AbstractContextManager[None]:
    """The host's AMX answer yes in this process, as on an AMX host (vLLM hears it unless the
    in-process decision answers no)."""
    return _answering(host=True)


def amx_answer_for_vllm(answer: bool) -> AbstractContextManager[None]:
    """vLLM's AMX question answered ``answer`` in this process, whatever the in-process
    decision: only for a control that shows what vLLM picks by itself. vLLM's cached backend
    choices are dropped on entry and exit, so none made under it reaches another load."""
    return _answering(vllm=answer)


def inprocess_amx_missing() -> str | None:
    """Why vLLM's AMX paths cannot load in this process, or None where they can: whether the
    kernel library vLLM loads here (``CpuPlatform.import_kernels``, which picks it by the
    host's ISA and never imports one the CPU cannot run) holds :data:`AMX_KERNEL`."""
    import torch

    try:
        import vllm
        from vllm.platforms import current_platform

        current_platform.import_kernels()  # what vllm._custom_ops does before any load
    except Exception as e:  # no kernels load at all: no AMX path can either
        return f"vLLM's kernels cannot be loaded in this process: {type(e).__name__}: {e}"
    if hasattr(torch.ops._C, AMX_KERNEL):
        return None
    return (
        f"vLLM {vllm.__version__}'s kernel library in this process has no {AMX_KERNEL} (only "
        "the _C of vLLM's CPU build holds the AMX kernels)"
    )


@contextmanager
def inprocess_session() -> Iterator[str | None]:
    """The in-process loads of a test session, decided once: vLLM's AMX question answered no
    while it lasts where :func:`inprocess_amx_missing` says why (yielded; None where the
    kernels are there and vLLM hears the host's answer)."""
    missing = inprocess_amx_missing()
    _IN_SESSION.append(missing)
    try:
        with _answering(inprocess_no=missing):
            yield missing
    finally:
        _IN_SESSION.pop()


def inprocess_engine_args(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The engine arguments every in-process load of a model with this ``config.json`` gets
    (its draft's speculative config takes the same ``attention_backend``): float32, and for an
    MLA model :data:`INPROCESS_MLA_BACKEND` by name, on every host. Only inside
    :func:`inprocess_session`, so that no load runs without the session's decision."""
    if not _IN_SESSION:
        raise RuntimeError(
            "an in-process vLLM load outside hostcpu.inprocess_session() (tests/conftest.py "
            "opens it for every session with a test marked vllm)"
        )
    args: dict[str, Any] = {"dtype": "float32"}
    if is_mla(hf_config):
        args["attention_backend"] = INPROCESS_MLA_BACKEND
    return args


def is_mla(hf_config: Mapping[str, Any]) -> bool:
    """Whether a ``config.json`` describes MLA attention (a ``kv_lora_rank``, at any depth:
    a text config nested in a multimodal one)."""
    if hf_config.get("kv_lora_rank"):
        return True
    return any(isinstance(v, Mapping) and is_mla(v) for v in hf_config.values())


def serving_dtype() -> str:
    """The ``--dtype`` a model served by vLLM's CPU build runs in on this host."""
    return "bfloat16" if amx() else "float32"


#: The MLA attention backend of a served model whose weights a test reloads or updates in
#: place, on every host: AMX_MLA packs W_UK/W_UV into kernel tensors that vLLM's layerwise
#: reload cannot restore (``_copy_and_restore_kernel_tensors``: "The size of tensor a (0)
#: must match the size of tensor b (512)"), with the layer or without it; CPU_MLA keeps them
#: as its processing made them. tests/e2e/test_isa.py shows both on an AMX host's selection.
RELOAD_MLA_BACKEND = "CPU_MLA"


def reload_serving() -> dict[str, str]:
    """The engine arguments of a served model whose weights a test reloads or updates, the
    same on every host: CPU_MLA for the target and its draft (``attention_backend``, which
    the speculative config takes too), in float32, which CPU_MLA computes in everywhere (and
    which keeps vLLM's AMX GEMM, bfloat16 only, off an AMX host's linear layers too)."""
    return {"dtype": "float32", "attention_backend": RELOAD_MLA_BACKEND}


def reload_server_flags() -> list[str]:
    """:func:`reload_serving` as the OpenAI server's command-line flags (later flags win)."""
    args = reload_serving()
    return [
        "--dtype",
        args["dtype"],
        "--attention-backend",
        args["attention_backend"],
        "--speculative-config.attention_backend",
        args["attention_backend"],
    ]


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


def describe() -> str:
    """The host's CPU model and the ISA flags vLLM's CPU build selects on, in one line."""
    model, flags = "unknown CPU", set[str]()
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
