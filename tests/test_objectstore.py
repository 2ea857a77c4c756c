"""A Run:ai target in object storage: the draft of an ``s3://`` checkpoint, in real vLLM on
the CPU, against a real S3-compatible server on loopback (moto's, ``tests/s3server.py``)
that counts every byte it serves, read by Run:ai's real S3 client.

The draft's plan is made from the shards' headers alone (ranged requests); its read
transfers its own tensors and the headers of the shards it opens, nothing else; in a load
scope it transfers nothing at all (one pass). Nothing stands in for anything here."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    QWEN35_REPLACED,
    Events,
    assert_qwen35_draft_is_the_checkpoints,
    differing,
    engine_config,
    garble,
    load_target_and_draft,
    model_runner,
    params,
    reload_weights,
    reloads,
    rule_keeps,
)
from hybrid_draft.core.checkpoint import read_checkpoint
from s3server import S3Server

pytestmark = pytest.mark.vllm

REPLACED = QWEN35_REPLACED
BUCKET = "models"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


@pytest.fixture
def s3_qwen35(
    s3: S3Server, qwen35: Path, vllm_runtime: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    """``qwen35`` uploaded under a prefix of its own; this process set to reach the server
    (as a container would be, with ``AWS_ENDPOINT_URL`` and credentials), vLLM's copy of
    the config files kept in this test's folder."""
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VLLM_ASSETS_CACHE", str(tmp_path / "vllm-assets"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    return s3.upload_dir(qwen35, BUCKET, f"qwen35-{uuid.uuid4().hex[:8]}")


def _load(config: Any, s3: S3Server) -> tuple[Any, Any, int]:
    """The target by ``get_model``, then the draft by model runner v2's ``load_eagle_model``
    (both releases' route); the server's record position between the two."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

    with set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        target = get_model(vllm_config=config)
        between = s3.mark()
        draft = load_eagle_model(target, config)
    return target, draft, between


def _header_bytes(shard: Path) -> int:
    with shard.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _prefix(uri: str) -> str:
    return uri.removeprefix(f"s3://{BUCKET}/")


def test_the_draft_of_an_s3_target_transfers_only_its_tensors_and_headers(
    s3: S3Server, s3_qwen35: str, qwen35: Path, events: Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRID_DRAFT_HOLD_BUDGET", "0")  # the filtered read alone
    config = engine_config(s3_qwen35, load_format="runai_streamer", config_dir=qwen35)
    start = s3.mark()

    target, draft, between = _load(config, s3)

    shards = read_checkpoint(qwen35)
    sizes = {t.name: t.nbytes for s in shards for t in s.tensors}
    where = {t.name: s.path.name for s in shards for t in s.tensors}
    own = rule_keeps(qwen35, draft) - REPLACED
    own_shards = {where[n] for n in own}
    prefix = _prefix(s3_qwen35)
    every_shard = {s.path.name: s.path.stat().st_size for s in shards}
    # The target: every shard whole, once (Run:ai's read of each shard's length and
    # header, then its tensors).
    both = s3.bytes_by_key(since=start, bucket=BUCKET)
    later = s3.bytes_by_key(since=between, bucket=BUCKET)
    assert {k: v - later.get(k, 0) for k, v in both.items() if k.endswith(".safetensors")} == {
        f"{prefix}/{name}": size for name, size in every_shard.items()
    }
    # The draft: every shard's header once (its plan), then its own shards' headers and its
    # own tensors (the streamer's read): nothing else crossed the wire.
    served = {k.removeprefix(f"{prefix}/"): v for k, v in later.items()}
    headers = {s.path.name: _header_bytes(s.path) for s in shards}
    expected = {
        name: headers[name]
        + (
            headers[name] + sum(sizes[n] for n in own if where[n] == name)
            if name in own_shards
            else 0
        )
        for name in headers
    }
    assert served == expected
    assert sum(served.values()) <= sum(sizes[n] for n in own) + 2 * sum(headers.values())
    # No tensor byte of any shard that holds none of the draft's tensors.
    for request in s3.object_gets(since=between):
        name = request.key.rpartition("/")[2]
        span = request.span
        if name not in own_shards:
            assert span is not None and span[1] < headers[name], request
    # Each object the draft streams from is checked to be the version its plan read, before
    # and after the stream: a HEAD each (no body).
    heads = [r for r in s3.requests(since=between) if r.method == "HEAD"]
    assert sorted(r.key.removeprefix(f"{prefix}/") for r in heads) == 2 * sorted(own_shards)

    (decision,) = events.decisions("draft")
    assert (decision["action"], decision["reason"], decision["chosen_format"]) == (
        "switched",
        "same_checkpoint",
        "runai_streamer",
    )
    assert "plan_error" not in decision
    target_load, draft_load = events.named("hybrid_draft.loaded")
    assert target_load["network_bytes"] == sum(sizes.values())
    assert (target_load["shards"], target_load["tensors"]) == (len(shards), len(sizes))
    own_bytes = sum(sizes[n] for n in own)
    assert draft_load["network_bytes"] == own_bytes
    assert (target_load["retried"], draft_load["retried"]) == (None, 0)
    assert draft_load["sources"]["storage"] == {"tensors": len(own), "bytes": own_bytes}
    assert draft_load["sources"]["replaced_by_target"]["tensors"] == len(REPLACED)
    assert (draft_load["shards"], draft_load["checkpoint_shards"]) == (1, len(shards))
    assert draft_load["checkpoint_bytes"] == sum(every_shard.values())
    assert_qwen35_draft_is_the_checkpoints(qwen35, draft)
    assert draft.lm_head is target.lm_head

    # report: the draft against a second full pass counts what crossed the network.
    from hybrid_draft.tools import report

    summary = report.summarize(events.all())
    (proc,) = summary["processes"]
    saved = proc["loads"][1]["vs_full_pass"]
    assert saved["network_bytes"] == own_bytes
    assert saved["bytes_read"] == own_bytes + draft_load["bytes_read"]
    # (storage bytes the process read meanwhile, code paged in cold, can exceed a tiny
    # checkpoint: the saving is then 0, never negative)
    assert saved["bytes_saved"] == max(draft_load["checkpoint_bytes"] - saved["bytes_read"], 0)
    text = report.render(summary)
    assert any(
        ln.split()[:2] == ["draft", "runai_streamer"] and "(network)" in ln
        for ln in text.splitlines()
    )


def test_in_a_load_scope_the_draft_of_an_s3_target_transfers_nothing(
    s3: S3Server, s3_qwen35: str, qwen35: Path, events: Events
) -> None:
    from hybrid_draft.adapter import loadscope

    config = engine_config(s3_qwen35, load_format="runai_streamer", config_dir=qwen35)
    with loadscope.scope():
        _target, draft, between = _load(config, s3)

    assert s3.requests(since=between) == []  # the draft's load sent no request
    sizes = {t.name: t.nbytes for s in read_checkpoint(qwen35) for t in s.tensors}
    own = rule_keeps(qwen35, draft) - REPLACED
    (target_decision,) = events.decisions("target")
    assert target_decision["one_pass"]["enabled"] is True
    target_load, draft_load = events.named("hybrid_draft.loaded")
    assert target_load["network_bytes"] == sum(sizes.values())
    assert draft_load["sources"]["stream"] == {
        "tensors": len(own),
        "bytes": sum(sizes[n] for n in own),
    }
    assert draft_load["sources"]["storage"] == {"tensors": 0, "bytes": 0}
    assert draft_load["network_bytes"] is None
    # The target's load planned the draft and checked what it held once its stream ended.
    assert (target_load["retried"], draft_load["retried"]) == (0, None)
    assert_qwen35_draft_is_the_checkpoints(qwen35, draft)
    # Every event names the model as the user gave it, not the folder vLLM copied its
    # config files into (that folder is where vLLM reads config.json: the config is local).
    named = [e for e in events.all() if "model" in e]
    assert named and {e["model"] for e in named} == {s3_qwen35}, named
    assert {d["target_model"] for d in events.decisions("draft")} == {s3_qwen35}
    assert str(config.model_config.model) != s3_qwen35


@pytest.mark.parametrize("budget", ["8GiB", "0"])
def test_a_reload_from_s3_reloads_the_draft_from_the_targets_stream_or_its_own_tensors(
    budget: str,
    s3: S3Server,
    s3_qwen35: str,
    qwen35: Path,
    events: Events,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's model runner reloads a Run:ai target from ``s3://`` (after a level-2 sleep,
    say): with one pass the draft's reload sends no request of its own; with the hold off
    it transfers its own tensors (and the headers of its plan)."""
    monkeypatch.setenv("HYBRID_DRAFT_HOLD_BUDGET", budget)
    runner = model_runner(engine_config(s3_qwen35, load_format="runai_streamer", config_dir=qwen35))
    draft = runner.get_draft_model()
    boot = params(draft)
    own = rule_keeps(qwen35, draft) - REPLACED
    garble(draft)
    start = s3.mark()

    reload_weights(runner)

    assert differing(draft, boot) == []
    shards = read_checkpoint(qwen35)
    sizes = {t.name: t.nbytes for s in shards for t in s.tensors}
    target_load = reloads(events, "hybrid_draft.loaded", "target")[0]
    (draft_load,) = reloads(events, "hybrid_draft.loaded")
    served = s3.bytes_by_key(since=start, bucket=BUCKET)
    whole = sum(s.path.stat().st_size for s in shards)
    headers = {s.path.name: _header_bytes(s.path) for s in shards}
    assert target_load["network_bytes"] == sum(sizes.values())
    if budget == "0":
        # The target's stream; the draft's plan (each shard's header), then its own shards'
        # headers and its own tensors (the streamer's read).
        where = {t.name: s.path.name for s in shards for t in s.tensors}
        mine = sum(headers[name] for name in {where[n] for n in own})
        assert draft_load["network_bytes"] == sum(sizes[n] for n in own)
        assert draft_load["sources"]["storage"]["bytes"] == sum(sizes[n] for n in own)
        assert sum(served.values()) == (
            whole + sum(headers.values()) + mine + sum(sizes[n] for n in own)
        )
    else:
        # The target's stream, and the headers its tap planned the draft from (each shard's
        # once); nothing of the draft's own.
        assert draft_load["network_bytes"] is None
        assert draft_load["sources"]["stream"]["bytes"] == sum(sizes[n] for n in own)
        assert sum(served.values()) == whole + sum(headers.values())


def test_a_reload_from_a_new_s3_checkpoint_reloads_the_draft_from_it(
    s3: S3Server,
    s3_qwen35: str,
    qwen35: Path,
    tmp_path: Path,
    events: Events,
) -> None:
    """``reload_weights(weights_path=s3://...)``, a training step's checkpoint uploaded
    beside the first: the draft holds the new step's values, taken from the target's
    stream of it."""
    from hybrid_draft.tools import synth

    step2 = tmp_path / "qwen35-step2"
    layout = synth.qwen3_5("tiny")
    synth.write_checkpoint(
        step2, layout, synth.shard(layout, num_shards=3, mtp_own_shard=True), seed=2
    )
    uri = s3.upload_dir(step2, BUCKET, f"step2-{uuid.uuid4().hex[:8]}")
    expected = params(
        load_target_and_draft(
            engine_config(uri, load_format="runai_streamer", config_dir=step2)
        ).draft
    )
    runner = model_runner(engine_config(s3_qwen35, load_format="runai_streamer", config_dir=qwen35))
    draft = runner.get_draft_model()
    garble(draft)

    reload_weights(runner, weights_path=uri)

    assert differing(draft, expected) == []
    (decision,) = [d for d in events.decisions("draft") if d["trigger"] == "reload"]
    assert (decision["reason"], decision["model"]) == ("same_checkpoint", uri)
    (load,) = reloads(events, "hybrid_draft.loaded")
    assert load["sources"]["storage"] == {"tensors": 0, "bytes": 0}
    assert load["network_bytes"] is None


def _plan(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hybrid_draft", "plan", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_plan_of_an_s3_checkpoint_reads_headers_only_and_matches_the_local_one(
    s3: S3Server, qwen35: Path, tmp_path: Path
) -> None:
    uri = s3.upload_dir(qwen35, BUCKET, f"plan-{uuid.uuid4().hex[:8]}")
    env = {**s3.client_env(), "VLLM_TARGET_DEVICE": "cpu"}
    start = s3.mark()
    remote = _plan(uri, "--json", env=env)
    assert remote.returncode == 0, remote.stderr[-2000:]
    served = s3.bytes_by_key(since=start, bucket=BUCKET)
    local = _plan(str(qwen35), "--json", "--load-format", "runai_streamer", env=env)
    assert local.returncode == 0, local.stderr[-2000:]

    got, want = json.loads(remote.stdout), json.loads(local.stdout)
    assert got["model_dir"] == uri and got["load_format"] == "runai_streamer"
    assert {k: v for k, v in got.items() if k != "model_dir"} == {
        k: v for k, v in want.items() if k != "model_dir"
    }
    assert got["auto"] == {
        "action": "switched",
        "reason": "same_checkpoint",
        "chosen_format": "runai_streamer",
        "tensor_filter": True,
    }
    # Each shard's length and header, and the JSON files: not one tensor byte.
    prefix = _prefix(uri)
    for shard in sorted(qwen35.glob("*.safetensors")):
        assert served.pop(f"{prefix}/{shard.name}") == _header_bytes(shard)
    assert served == {f"{prefix}/{p.name}": p.stat().st_size for p in sorted(qwen35.glob("*.json"))}
    assert not list(Path(tempfile.gettempdir()).glob("hybrid-draft-plan-*"))


def test_plan_of_a_bad_s3_address_is_one_line_and_exit_2(s3: S3Server, tmp_path: Path) -> None:
    env = {**s3.client_env(), "VLLM_TARGET_DEVICE": "cpu"}
    empty = _plan(f"s3://{BUCKET}/nothing-here", env=env)
    assert empty.returncode == 2
    assert (
        empty.stderr
        == f"hybrid-draft plan: s3://{BUCKET}/nothing-here: holds no *.safetensors objects\n"
    )
    missing = _plan("s3://no-such-bucket/m", env=env)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert missing.stderr.startswith("hybrid-draft plan: s3://no-such-bucket/m: cannot be listed: ")
    # An endpoint that never answers: bounded by --timeout, not by the client's retries.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)  # accepts connections into the backlog, never answers
    try:
        port = silent.getsockname()[1]
        hung = _plan(
            f"s3://{BUCKET}/m",
            "--timeout",
            "3",
            env={**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"},
        )
    finally:
        silent.close()
    assert hung.returncode == 2
    assert hung.stderr == (
        f"hybrid-draft plan: s3://{BUCKET}/m: no answer from the object store within 3 s "
        "(--timeout); check the address, AWS_ENDPOINT_URL and the credentials\n"
    )
    assert not list(Path(tempfile.gettempdir()).glob("hybrid-draft-plan-*"))
