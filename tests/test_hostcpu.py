"""In-process loads on every host: what an AMX host selects, checked on any host.

The in-process tests run vLLM 0.33's CUDA build with ``VLLM_TARGET_DEVICE=cpu``. Its
``vllm._C`` has none of the CPU kernels vLLM's AMX paths call, so on an AMX host an MLA
model gets the CPU_MLA backend and every load stays float32 (tests/hostcpu.py). Here vLLM's
AMX question is answered yes in this process: the suite's own choice loads the target and
its MTP draft, and the backend vLLM would pick by itself stops at the missing kernel, which
is why the choice is made.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import hostcpu
from conftest import engine_config, load_target_and_draft

pytestmark = pytest.mark.vllm


def _attention_impls(model: object) -> set[str]:
    return {
        type(m.impl).__name__
        for m in model.modules()  # type: ignore[attr-defined]
        if getattr(m, "impl", None) is not None and type(m).__name__.endswith("Attention")
    }


def test_an_amx_host_loads_mla_in_process_with_the_suites_choice(
    deepseek: Path, instanttensor_standin: object
) -> None:
    with hostcpu.force_amx():
        config = engine_config(deepseek)
        assert config.attention_config.backend.name == "CPU_MLA"
        assert str(config.model_config.dtype) == "torch.float32"
        loaded = load_target_and_draft(config)
    assert _attention_impls(loaded.target) == {"CPUMLAImpl"}
    assert _attention_impls(loaded.draft) == {"CPUMLAImpl"}


def test_without_the_choice_an_amx_host_picks_amx_mla_which_this_build_cannot_load(
    deepseek: Path, instanttensor_standin: object
) -> None:
    with hostcpu.force_amx():
        config = engine_config(  # no backend named: vLLM's own pick
            deepseek,
            dtype="bfloat16",
            attention_backend=None,
            speculative_config={
                "method": "mtp",
                "num_speculative_tokens": 1,
                "attention_backend": None,
            },
        )
        with pytest.raises(Exception, match="convert_weight_packed"):
            load_target_and_draft(config)


def test_on_this_host_nothing_is_forced_unless_amx_is_there(deepseek: Path) -> None:
    config = engine_config(deepseek)
    chosen = config.attention_config.backend
    if hostcpu.amx():
        assert chosen is not None and chosen.name == "CPU_MLA"
    else:
        assert chosen is None  # vLLM's own selection (CPU_MLA without AMX)
