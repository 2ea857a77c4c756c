"""Every checkpoint the suite serves loads on an AMX host, checked on any x86 host.

vLLM's CPU build takes other kernels where AMX tiles are available: the AMX_MLA attention
backend (bfloat16 only, W_UK/W_UV VNNI-packed by ``convert_weight_packed``, which wants out
features a multiple of 16 and in features a multiple of 32), the sgl-kernel GEMM for small
linear layers and the AMX fused-MoE experts. tests/e2e/isaprobe.py answers vLLM's AMX
question yes and loads each served preset through the real ``get_model`` and
``EagleProposer`` in the dtype such a host serves in (tests/hostcpu.py), so the real packing
code checks every shape here, on an AMD or AVX2 machine too. A preset that an AMX host
could not serve fails this test wherever it runs; two controls show that the probe does
reject what such a host rejects.
"""

from __future__ import annotations

import json

import pytest

import hostcpu
from hybrid_draft.tools import synth

from .harness import REPO, Checkpoint, CpuEnv, Timer, run

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def probed(
    cpu_env: CpuEnv, checkpoints: dict[str, Checkpoint], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("isa")
    # Control: DeepSeek-V3's `cpu` preset as it was, qk_nope_head_dim 16 (W_UK's in features).
    narrow = root / "deepseek_v3-nope16"
    layout = synth.deepseek_v3("cpu", qk_nope_head_dim=16, v_head_dim=16)
    synth.write_checkpoint(narrow, layout, synth.shard(layout, num_shards=1), seed=1)
    synth.write_tokenizer(narrow, layout.config["vocab_size"])
    amx_dtype = "bfloat16"  # what tests/hostcpu.py serves in where AMX is available
    cases = [f"{arch}={checkpoints[arch].path}:{amx_dtype}" for arch in synth.CPU_SERVABLE]
    cases += [
        f"float32={checkpoints['deepseek_v3'].path}:float32",  # control: AMX_MLA's dtype
        f"nope16={narrow}:{amx_dtype}",
    ]
    with Timer("isa: the served presets loaded as on an AMX host"):
        out = run(
            [cpu_env.python, REPO / "tests/e2e/isaprobe.py", *(f"--case={c}" for c in cases)],
            env=cpu_env.env(),
            timeout=900,
            what="tests/e2e/isaprobe.py",
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_served_dtype_on_an_amx_host_is_the_one_amx_mla_takes() -> None:
    with hostcpu.force_amx():
        assert hostcpu.serving_dtype() == "bfloat16"


@pytest.mark.parametrize("arch", synth.CPU_SERVABLE)
def test_each_served_preset_loads_with_the_amx_kernels(probed: dict[str, dict], arch: str) -> None:
    result = probed[arch]
    assert "error" not in result, f"{arch} --preset cpu on an AMX host: {result['error']}"
    for role in ("target", "draft"):
        selected = result[role]
        # The AMX paths were really taken, so their checks really ran.
        assert "sgl weight_packed_linear" in selected["linear"], selected
        if arch == "deepseek_v3":
            assert selected["attention"] == ["AMXMLAImpl"], selected


def test_the_probe_rejects_what_an_amx_host_rejects(probed: dict[str, dict]) -> None:
    assert "invalid weight input features 16" in probed["nope16"]["error"]
    assert "expect weight to be bfloat16" in probed["float32"]["error"]
