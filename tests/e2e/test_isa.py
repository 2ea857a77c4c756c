"""Every checkpoint the suite serves loads with the kernels this host selects, and with those
an AMX host selects wherever the host can load them.

vLLM's CPU build loads one of three kernel libraries by the host's ISA
(``CpuPlatform.import_kernels``): ``_C`` (AVX-512 with BF16), ``_C_AVX512`` or ``_C_AVX2``,
and takes other kernels where AMX tiles are available: the AMX_MLA attention backend
(bfloat16 only, W_UK/W_UV VNNI-packed by ``convert_weight_packed``, which wants out features
a multiple of 16 and in features a multiple of 32), the sgl-kernel GEMM for small linear
layers and the AMX fused-MoE experts. Those kernels live in ``_C`` alone.

tests/e2e/isaprobe.py loads each served preset through the real ``get_model`` and
``EagleProposer`` in the dtype the servers use (tests/hostcpu.py):

- as this host selects, on every host: the library mapped, the attention backend and ISA,
  the GEMM and the experts each module got, and whether the shared-memory communicator's
  ``init_shm_manager`` is there (an AVX2 host: ``_C_AVX2``, CPU_MLA, the CPU attention's
  ``vec`` ISA, oneDNN GEMMs, the ``vec`` experts, no shared memory: TP and PP groups use
  torch.distributed);
- as an AMX host selects (vLLM's AMX question answered yes), where the host loads ``_C``: the
  real packing code checks every shape here, on an AMD machine too, and two controls show
  that the probe rejects what such a host rejects. Elsewhere these tests skip, naming the
  missing flag and the library vLLM loads instead.
"""

from __future__ import annotations

import json

import pytest

import hostcpu
from hybrid_draft.tools import synth

from .harness import REPO, Checkpoint, CpuEnv, Timer, run

pytestmark = pytest.mark.e2e


def _probe(cpu_env: CpuEnv, cases: list[str], select: str) -> dict[str, dict]:
    out = run(
        [
            cpu_env.python,
            REPO / "tests/e2e/isaprobe.py",
            f"--select={select}",
            *(f"--case={c}" for c in cases),
        ],
        env=cpu_env.env(),
        timeout=900,
        what=f"tests/e2e/isaprobe.py --select={select}",
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def on_this_host(cpu_env: CpuEnv, checkpoints: dict[str, Checkpoint]) -> dict[str, dict]:
    dtype = hostcpu.serving_dtype()
    cases = [f"{arch}={checkpoints[arch].path}:{dtype}" for arch in synth.CPU_SERVABLE]
    with Timer("isa: the served presets loaded as this host selects"):
        return _probe(cpu_env, cases, "host")


@pytest.fixture(scope="module")
def probed(
    cpu_env: CpuEnv, checkpoints: dict[str, Checkpoint], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict]:
    unavailable = hostcpu.amx_kernels_unavailable()
    if unavailable is not None:
        pytest.skip(f"an AMX host's kernels cannot be checked here: {unavailable}")
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
        return _probe(cpu_env, cases, "amx")


def test_this_host_loads_the_kernel_library_its_cpu_selects(on_this_host: dict[str, dict]) -> None:
    host = on_this_host["host"]
    library = hostcpu.kernel_library()
    assert host["kernel_libraries"] == [library], (hostcpu.describe(), host)
    # The AMX kernels and the shared-memory communicator are in the AVX-512 libraries only.
    assert host["convert_weight_packed"] is (library == "_C"), host
    assert host["init_shm_manager"] is (library != "_C_AVX2"), host
    assert host["amx"] is hostcpu.amx()


@pytest.mark.parametrize("arch", synth.CPU_SERVABLE)
def test_each_served_preset_loads_with_the_kernels_this_host_selects(
    on_this_host: dict[str, dict], arch: str
) -> None:
    result = on_this_host[arch]
    assert "error" not in result, f"{arch} --preset cpu on {hostcpu.describe()}: {result['error']}"
    amx = hostcpu.amx()
    for role in ("target", "draft"):
        selected = result[role]
        linear = set(selected["linear"])
        # With AMX the small GEMMs take the sgl kernel, the rest oneDNN; without, all go to
        # oneDNN (vLLM falls back to torch's linear, with a warning, for a shape oneDNN
        # refuses). MLA's kv_b_proj alone keeps torch's: the MLA backend unpacks its weight
        # into W_UK/W_UV itself.
        assert ("sgl weight_packed_linear" if amx else "oneDNN onednn_mm") in linear, selected
        mla = arch == "deepseek_v3"
        kept = {k for k in linear if k.startswith("torch linear")}
        assert kept <= ({"torch linear: kv_b_proj"} if mla else set()), selected
        assert linear - kept <= {"sgl weight_packed_linear", "oneDNN onednn_mm"}, selected
        if mla:
            assert selected["attention"] == (["AMXMLAImpl"] if amx else ["CPUMLAImpl"]), selected
        else:
            assert selected["attention"] == ["CPUAttentionBackendImpl"], selected
            assert selected["attention_isa"] == (["amx"] if amx else ["vec"]), selected
        # The fused-MoE experts (both presets are MoE models) and the ISA they pack for: the
        # vector kernels in every library without AMX.
        isas = {e.rsplit(" ", 1)[-1] for e in selected["experts"]}
        assert isas and isas <= ({"(amx)", "(vec)"} if amx else {"(vec)"}), selected


def test_the_served_dtype_on_an_amx_host_is_the_one_amx_mla_takes() -> None:
    with hostcpu.force_amx():
        assert hostcpu.serving_dtype() == "bfloat16"


@pytest.mark.parametrize("arch", synth.CPU_SERVABLE)
def test_each_served_preset_loads_with_the_amx_kernels(probed: dict[str, dict], arch: str) -> None:
    result = probed[arch]
    assert "error" not in result, f"{arch} --preset cpu on an AMX host: {result['error']}"
    assert probed["host"]["kernel_libraries"] == ["_C"], probed["host"]
    for role in ("target", "draft"):
        selected = result[role]
        # The AMX paths were really taken, so their checks really ran.
        assert "sgl weight_packed_linear" in selected["linear"], selected
        if arch == "deepseek_v3":
            assert selected["attention"] == ["AMXMLAImpl"], selected


@pytest.fixture(scope="module")
def reloaded(cpu_env: CpuEnv, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The reload tests' dense DeepSeek-V3 preset loaded and reloaded in place as an AMX host
    selects: with the choice every reload test names (tests/hostcpu.py), and as vLLM picks."""
    unavailable = hostcpu.amx_kernels_unavailable()
    if unavailable is not None:
        pytest.skip(f"an AMX host's kernels cannot be checked here: {unavailable}")
    dense = tmp_path_factory.mktemp("isa-reload") / "deepseek_v3"
    layout = synth.deepseek_v3("cpu", moe=False)
    synth.write_checkpoint(dense, layout, synth.shard(layout, num_shards=2), seed=3)
    synth.write_tokenizer(dense, layout.config["vocab_size"])
    chosen = hostcpu.reload_serving()
    with hostcpu.force_amx():
        amx_dtype = hostcpu.serving_dtype()
    cases = [
        f"named={dense}:{chosen['dtype']}:{chosen['attention_backend']}",
        f"picked={dense}:{amx_dtype}",  # control: what vLLM picks on an AMX host
    ]
    with Timer("isa: the reload tests' choice reloaded as on an AMX host"):
        out = run(
            [cpu_env.python, REPO / "tests/e2e/isaprobe.py", "--select=amx", "--reload"]
            + [f"--case={c}" for c in cases],
            env=cpu_env.env(),
            timeout=900,
            what="tests/e2e/isaprobe.py --select=amx --reload",
        )
    result: dict[str, dict] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_an_amx_host_reloads_the_weights_of_what_the_reload_tests_serve(
    reloaded: dict[str, dict],
) -> None:
    """Every served test that reloads or updates weights names CPU_MLA in float32: an AMX
    host then reloads in place; with vLLM's own pick there (AMX_MLA, bfloat16) its layerwise
    reload stops at the packed kernel tensors, with the layer or without it."""
    named = reloaded["named"]
    assert "error" not in named, named
    assert named["target"]["attention"] == named["draft"]["attention"] == ["CPUMLAImpl"]
    assert "sgl weight_packed_linear" not in named["target"]["linear"], named
    assert named["reload"] == "ok"
    picked = reloaded["picked"]
    assert picked["target"]["attention"] == ["AMXMLAImpl"], picked
    assert "must match the size of tensor b" in picked["reload"], picked


def test_the_probe_rejects_what_an_amx_host_rejects(probed: dict[str, dict]) -> None:
    assert "invalid weight input features 16" in probed["nope16"]["error"]
    assert "expect weight to be bfloat16" in probed["float32"]["error"]
