"""The benchmark runs once at a tiny scale, so that it cannot rot. It asserts no timings:
only that it produced its JSON (the contract's shape) and its chart, from cold runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

STRATEGIES = ("full_pass", "lazy", "lazy_pruned", "auto", "selective", "limit", "one_pass")


def test_bench_at_a_tiny_scale(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybrid_draft",
            "bench",
            "--size",
            "0.05",
            "--runs",
            "2",
            "--out",
            str(out),
            "--startup-runs",
            "3",
            "--hook-runs",
            "1",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    ck = result["checkpoint"]
    assert {"shards", "tensors", "bytes", "draft_bytes"} <= ck.keys()
    assert 0 < ck["draft_bytes"] < ck["bytes"] and ck["shards"] >= 2
    assert result["draft_class"] == "DeepSeekMTP" and result["rule_source"] == "hybrid-draft"
    assert list(result["strategies"]) == list(STRATEGIES)
    for name, s in result["strategies"].items():
        assert len(s["seconds"]) == 2 and all(t > 0 for t in s["seconds"]), name
        for key in ("bytes_read", "resident_bytes", "peak_rss"):
            assert isinstance(s[key], int) and s[key] >= 0, (name, key)
        assert s["cold"], f"{name}: the page cache could not be emptied before a run"
        assert s["warmup_seconds"] > 0, name  # an untimed run first, in every worker
    # The checkpoint is in DeepSeek-V3's proportions: the draft, and what vLLM replaces.
    real, synthetic = result["proportions"]["real"], result["proportions"]["synthetic"]
    assert result["proportions"]["model"] == "DeepSeek-V3"
    assert synthetic["replaced_tensors"] == real["replaced_tensors"] == 3
    for key in ("draft", "replaced"):
        assert abs(synthetic[key] / real[key] - 1) < 0.25, (key, synthetic, real)
    assert ck["own_bytes"] + ck["replaced_bytes"] == ck["draft_bytes"]
    assert ck["replaced_tensors"] == 3 and ck["own_bytes"] > 0
    strategies = result["strategies"]
    full, limit = strategies["full_pass"], strategies["limit"]
    assert full["bytes_read"] >= ck["bytes"]  # cold: every byte came from storage
    assert ck["own_bytes"] <= limit["bytes_read"] < full["bytes_read"]
    # auto is the product's own loader; selective, without CUDA, the path it falls back to;
    # both read the draft's own tensors, not the ones vLLM replaces.
    auto, selective = strategies["auto"], strategies["selective"]
    assert auto["ran"] == "safetensors_filtered"
    assert selective["ran"] == "auto (CUDA is not available (vLLM platform: cpu))"
    assert ck["own_bytes"] <= auto["bytes_read"] < full["bytes_read"]
    # Stock lazy reads what the rule keeps, the replaced tensors too.
    assert strategies["lazy_pruned"]["bytes_read"] >= ck["draft_bytes"]
    assert "(selective ran auto (CUDA is not available" in proc.stdout
    # One pass: the target's pass (every byte) keeps the draft's tensors; the draft's load
    # then reads nothing from storage.
    one = strategies["one_pass"]
    assert one["held_bytes"] == ck["own_bytes"]
    assert one["draft_bytes_read"] < ck["own_bytes"] / 4
    assert len(one["target_seconds"]) == len(one["untapped_target_seconds"]) == 2
    assert isinstance(one["tap_overhead"], float)
    assert one["warmup_seconds"] > 0  # an untimed pass first: neither side pays the first one
    assert "one_pass: the draft's load" in proc.stdout

    startup = result["startup"]
    assert startup["python_c_pass"]["runs"] == 3
    assert startup["model_loader"]["hook"]["runs"] == 1
    for line in ("CPU, cold page cache", ".pth cost:", "hook cost:", "bench.json"):
        assert line in proc.stdout, line

    # A second run reuses the checkpoint instead of writing it again; where matplotlib is
    # absent (as in the image), it prints the table and says the chart needs the extra.
    no_matplotlib = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from hybrid_draft.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    again = subprocess.run(
        [
            sys.executable,
            "-c",
            no_matplotlib,
            "bench",
            "--size",
            "0.05",
            "--runs",
            "1",
            "--out",
            str(out),
            "--strategies",
            "limit",
            "--startup-runs",
            "0",
            "--hook-runs",
            "0",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert "writing a" not in again.stdout
    assert "CPU, cold page cache" in again.stdout and "limit" in again.stdout
    assert again.stdout.splitlines()[-2:] == [
        f"wrote {out / 'bench.json'}",
        "the chart (bench.png) needs the `bench` extra: pip install 'hybrid-draft[bench]'",
    ]
    assert list(json.loads((out / "bench.json").read_text())["strategies"]) == ["limit"]


def test_settle_waits_out_the_processes_this_one_started() -> None:
    """Nothing the bench's process started (vLLM's background kernel builds, say) runs when
    settle returns; a child that has ended but is not reaped yet does not hold it up."""
    from hybrid_draft.tools.bench import pagecache

    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert running.pid in pagecache.children()
        pagecache.settle(timeout=60)
        assert running.poll() == 0  # it had ended: settle waited for it
        assert pagecache.children() == []  # the ended, unreaped one is not counted
        assert ended.poll() == 0
    finally:
        running.kill()
        ended.kill()
        running.wait()
        ended.wait()
