"""The benchmark runs once at a tiny scale, so that it cannot rot. It asserts no timings:
only that it produced its JSON (the contract's shape) and its chart, from cold runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: A program's run, measured on the pinned release (docs/testing.md): once.
pytestmark = [pytest.mark.vllm, pytest.mark.once]

STRATEGIES = (
    "full_pass",
    "lazy",
    "lazy_pruned",
    "auto",
    "selective",
    "limit",
    "one_pass",
    "fastsafetensors_stock",
    "fastsafetensors_filtered",
    "fastsafetensors_one_pass",
    "runai_stock",
    "runai_filtered",
    "runai_one_pass",
)
S3_STRATEGIES = ("runai_s3_stock", "runai_s3_filtered", "runai_s3_one_pass")
ONE_PASS = ("one_pass", "fastsafetensors_one_pass", "runai_one_pass")


def tiny(out: Path, *flags: str, runs: int = 1) -> list[str]:
    """``hybrid-draft bench`` at the tests' scale into ``out``, with ``flags`` added (the
    start-up timings off unless they say otherwise)."""
    timings = [] if "--startup-runs" in flags else ["--startup-runs", "0", "--hook-runs", "0"]
    return ["bench", "--size", "0.05", "--runs", str(runs), "--out", str(out), *flags, *timings]


def test_bench_at_a_tiny_scale(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybrid_draft",
            *tiny(out, "--startup-runs", "3", "--hook-runs", "1", runs=2),
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
    # One pass, whatever the target's format: the target's pass (every byte) keeps the
    # draft's tensors; the draft's load then reads nothing from storage.
    for name in ONE_PASS:
        one = strategies[name]
        assert one["held_bytes"] == ck["own_bytes"], name
        assert one["draft_bytes_read"] < ck["own_bytes"] / 4, name
        assert one["draft_seconds"] == one["median_seconds"], name
        assert len(one["target_seconds"]) == len(one["untapped_target_seconds"]) == 2, name
        assert isinstance(one["tap_overhead"], float), name
        assert one["warmup_seconds"] > 0, name  # an untimed pass first: neither side pays it
        assert f"{name}: the draft's load" in proc.stdout
    assert strategies["fastsafetensors_one_pass"]["ran"] == "tap + fastsafetensors_filtered"
    assert strategies["runai_one_pass"]["ran"] == "tap + runai_streamer_filtered"
    # fastsafetensors and Run:ai: stock vLLM reads the rule's shards whole; the product's
    # loader of the draft reads its own tensors, not the ones vLLM replaces.
    for stock, filtered, ran in (
        ("fastsafetensors_stock", "fastsafetensors_filtered", "fastsafetensors_filtered"),
        ("runai_stock", "runai_filtered", "runai_streamer_filtered"),
    ):
        assert strategies[stock]["bytes_read"] >= ck["draft_bytes"], stock
        assert strategies[filtered]["ran"] == ran
        assert ck["own_bytes"] <= strategies[filtered]["bytes_read"], filtered
        assert strategies[filtered]["bytes_read"] < strategies[stock]["bytes_read"] / 2, filtered
    assert "nogds" in strategies["fastsafetensors_stock"]["ran"]  # vLLM's iterator stood in
    assert not any("network_bytes" in s for s in strategies.values())  # no object storage
    # A reload in place: what each strategy's draft adds to the target's own reload.
    reload = result["reload"]
    assert list(reload) == list(STRATEGIES)
    assert reload["full_pass"]["added_bytes"] == full["bytes_read"]
    assert reload["auto"]["added_bytes"] == auto["bytes_read"]
    assert reload["auto"]["vs_full_pass_bytes"] == auto["bytes_read"] / full["bytes_read"]
    for name in ONE_PASS:
        one = strategies[name]
        tap = one["median_target_seconds"] - one["median_untapped_target_seconds"]
        assert reload[name]["added_seconds"] == one["draft_seconds"] + tap, name
        assert reload[name]["added_bytes"] == one["draft_bytes_read"], name
    assert "a reload in place: what the draft adds to the target's own reload" in proc.stdout

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
        [sys.executable, "-c", no_matplotlib, *tiny(out, "--strategies", "limit")],
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


def test_bench_against_object_storage(tmp_path: Path) -> None:
    """With --s3-endpoint, the checkpoint is uploaded once and the Run:ai strategies run
    against its s3:// copy: the server's own count of what each one pulled (between the
    bench's "running" lines) shows the filtered draft pulling a fraction of what stock
    vLLM pulls, and the one-pass draft pulling nothing."""
    pytest.importorskip("moto")
    pytest.importorskip("boto3")
    pytest.importorskip("runai_model_streamer_s3")
    from s3server import S3Server

    out = tmp_path / "bench"
    with S3Server() as s3:
        env = s3.client_env()
        # --s3-endpoint alone reaches the server: the bench sets what Run:ai's client needs.
        del env["AWS_ENDPOINT_URL"], env["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"]
        env["VLLM_TARGET_DEVICE"] = "cpu"
        marks: dict[str, int] = {}
        with (tmp_path / "stderr").open("w") as stderr:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hybrid_draft",
                    *tiny(
                        out, "--strategies", ",".join(S3_STRATEGIES), "--s3-endpoint", s3.endpoint
                    ),
                ],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
            )
            assert proc.stdout is not None
            lines = []
            for line in proc.stdout:  # each strategy's worker starts after this line
                lines.append(line)
                if line.startswith("running "):
                    marks[line.split()[1]] = s3.mark()
            proc.wait()
        stdout = "".join(lines)
        assert proc.returncode == 0, stdout[-3000:] + (tmp_path / "stderr").read_text()[-3000:]
        ends = [*list(marks.values())[1:], s3.mark()]
        served = {}
        for (name, start), end in zip(marks.items(), ends, strict=True):
            both, later = s3.bytes_by_key(since=start), s3.bytes_by_key(since=end)
            served[name] = sum(both.values()) - sum(later.values())

    result = json.loads((out / "bench.json").read_text())
    ck = result["checkpoint"]
    assert list(result["strategies"]) == list(S3_STRATEGIES) == list(marks)
    assert result["s3"]["uri"] == "s3://hybrid-draft-bench/checkpoint-0.05GiB-v3"
    assert result["s3"]["uploaded_files"] > ck["shards"]  # the shards, config and index
    strategies = result["strategies"]
    stock, filtered = strategies["runai_s3_stock"], strategies["runai_s3_filtered"]
    one = strategies["runai_s3_one_pass"]
    for name, s in strategies.items():
        for key in ("bytes_read", "resident_bytes", "peak_rss"):
            assert isinstance(s[key], int) and s[key] >= 0, (name, key)
        assert len(s["network_bytes"]) == len(s["product_network_bytes"]) == 1, name
    # What the server sent (a warm-up run and a timed one each): stock vLLM's Run:ai read
    # pulls the rule's shards whole; the product's pulls its own tensors and some headers.
    assert served["runai_s3_stock"] >= 2 * ck["draft_bytes"]
    assert 2 * ck["own_bytes"] <= served["runai_s3_filtered"] < served["runai_s3_stock"] / 4
    # The bench's own figures say the same: the socket reads (rchar, which also counts the
    # few small files the S3 client reads) and the product's count of tensor bytes.
    assert stock["network_bytes"][0] >= ck["draft_bytes"]
    assert stock["product_network_bytes"] == [None]  # stock vLLM: nothing of the product's
    assert filtered["product_network_bytes"] == [ck["own_bytes"]]
    assert ck["own_bytes"] <= filtered["network_bytes"][0] < stock["network_bytes"][0]
    assert filtered["ran"] == "runai_streamer_filtered"
    # One pass: the target's pass pulls every tensor, the draft's load nothing.
    assert one["held_bytes"] == ck["own_bytes"] and one["ran"] == "tap + runai_streamer_filtered"
    assert one["product_network_bytes"] == [None]
    assert one["network_bytes"][0] < ck["own_bytes"] / 4
    assert one["target_product_network_bytes"][0] >= ck["own_bytes"]
    assert one["target_network_bytes"][0] >= one["target_product_network_bytes"][0]
    assert "runai_s3_filtered: the draft's load received" in stdout
    assert "network" in stdout  # the table's column


def test_bench_refuses_an_endpoint_it_cannot_reach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad --s3-endpoint, or an object-storage strategy without one, is one line and exit
    status 2, before anything is written: no traceback, and no wait past the bound."""
    import socket
    import time

    from hybrid_draft.tools import cli
    from hybrid_draft.tools.bench import s3

    pytest.importorskip("boto3")
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "HUMMING_DISABLE_PARALLEL_BUILD": "1",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(s3, "CONNECT_TIMEOUT_S", 1)
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    out = tmp_path / "bench"
    cases = [
        (["--s3-endpoint", closed], "--s3-endpoint " + closed + ": Could not connect"),
        (["--s3-endpoint", "ftp://example"], "not an http:// or https:// address"),
        (["--s3-endpoint", "http://10.255.255.1:9"], "--s3-endpoint http://10.255.255.1:9: "),
        ([], "runai_s3_stock read from object storage: name its endpoint with --s3-endpoint"),
    ]
    for extra, message in cases:
        start = time.monotonic()
        code = cli.main(
            ["bench", "--size", "0.05", "--out", str(out), "--strategies", "runai_s3_stock", *extra]
        )
        elapsed = time.monotonic() - start
        captured = capsys.readouterr()
        assert code == 2, (extra, captured.err)
        (line,) = captured.err.splitlines()
        assert line.startswith("hybrid-draft bench: ") and message in line, (extra, line)
        assert elapsed < s3.ATTEMPTS * s3.CONNECT_TIMEOUT_S + 10, extra  # the attempts' bound
        assert not out.exists(), extra  # refused before the checkpoint was written
