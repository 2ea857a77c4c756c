"""``scripts/gpu-check.sh`` on this CPU host, as CI runs it, so that the GPU check cannot rot:
the same script and the same product code as on the GPU machine (the draft's plan without
vLLM, ``core.draftload`` with each format's reader, the hold tapping the target's stream),
CPU tensors where the GPU gets CUDA ones, vLLM unimportable in every process it starts. No
timings asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.once]  # no vLLM (docs/testing.md)

REPO = Path(__file__).resolve().parents[1]


def gpu_check(tmp_path: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    """The script at the tests' scale, with no GPU and a ``vllm`` package that records any
    import of it (and fails it) ahead of the real one."""
    fake = tmp_path / "fake-vllm" / "vllm"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text(
        f"open({str(tmp_path / 'vllm-imported')!r}, 'a').write(__name__)\n"
        "raise ImportError('vLLM is not for this run')\n"
    )
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "SIZE": "0.05",
        "RUNS": "1",
        "CHECKPOINT": str(tmp_path / "checkpoint"),
        "PYTHON": sys.executable,
        "WHEELS": "",  # this Python has what it needs
        "CUDA_VISIBLE_DEVICES": "",  # the CPU rows, on any host
        "PYTHONPATH": os.pathsep.join(
            [str(fake.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        **settings,
    }
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu-check.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )


def test_the_gpu_check_runs_the_core_on_the_cpu(tmp_path: Path) -> None:
    proc = gpu_check(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "vllm-imported").exists()  # nothing even tried to import vLLM
    out = proc.stdout
    assert "CUDA is not available here: the GPU rows" in out
    assert "skipping it_full, it_selective (InstantTensor reads onto CUDA only)" in out
    assert "selective passes safe_open: ['buffer_size', 'chunk_size', 'io_depth']" in out

    result = json.loads((tmp_path / "out" / "bench" / "bench.json").read_text())
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "out" / "bench" / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert (result["draft_class"], result["rule_source"]) == ("DeepSeekMTP", "layout")
    assert "gpu_strategies" not in result and "failed" not in result
    expected = ["full_pass", "limit", "auto", "selective", "one_pass"]
    for name, module in (
        ("fastsafetensors_filtered", "fastsafetensors"),
        ("runai_filtered", "runai_model_streamer"),
    ):
        if importlib.util.find_spec(module) is not None:
            expected.append(name)
    strategies, ck = result["strategies"], result["checkpoint"]
    assert list(strategies) == expected
    for name, s in strategies.items():
        assert s["device"] == "cpu" and s["cold"] and len(s["seconds"]) == 1, name
    full = strategies["full_pass"]["bytes_read"]
    # The product's filtered reads: the draft's own tensors, not the replaced ones.
    assert strategies["auto"]["ran"] == "safetensors_filtered"
    assert strategies["selective"]["ran"] == "auto (CUDA is not available (torch))"
    for name in ("auto", "selective", *expected[5:]):
        assert ck["own_bytes"] <= strategies[name]["bytes_read"] < full / 4, name
    for name, ran in (
        ("fastsafetensors_filtered", "fastsafetensors_filtered"),
        ("runai_filtered", "runai_streamer_filtered"),
    ):
        assert strategies.get(name, {"ran": ran})["ran"] == ran, name
    # One pass: the hold tapped the target's stream for the draft's own tensors; the
    # draft's load took them and read nothing.
    one = strategies["one_pass"]
    assert one["ran"] == "the whole-shard stream + tap + safetensors_filtered"
    assert one["held_bytes"] == ck["own_bytes"]
    assert one["draft_bytes_read"] < ck["own_bytes"] / 4
    assert len(one["target_seconds"]) == len(one["untapped_target_seconds"]) == 1
    assert "one_pass: the draft's load" in out


def test_the_gpu_check_refuses_bad_settings_in_one_line(tmp_path: Path) -> None:
    proc = gpu_check(tmp_path, SIZE="-1")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("hybrid-draft bench: argument --size: "), line
