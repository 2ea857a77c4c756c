"""No part is ever off in silence: a part vLLM's shape turns off is said off with
``part_skipped``, the draft's decision says why it skipped nothing, and ``hybrid-draft
doctor`` fails on a supported release unless ``HYBRID_DRAFT_ALLOW_PARTS_OFF`` allows it.

Real vLLM on the CPU, whichever supported release is installed; a private name is given
another shape by wrapping the real one (vLLM's own calls still work), as in
test_vllm_shapes.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Events, Recorder, engine_config, load_target_and_draft
from hybrid_draft.adapter import internals, parts
from hybrid_draft.tools import doctor

# As in test_releases.py: vLLM 0.34's CPU platform needs Triton to report a driver.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

EMBED = "vllm.v1.worker.gpu.spec_decode.eagle.utils"


def test_allowing_something_that_is_not_a_part_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(doctor.ALLOW_ENV, "one_pass, warp_drive")
    assert doctor.run() == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [
        f"hybrid-draft doctor: {doctor.ALLOW_ENV}='one_pass, warp_drive': warp_drive is not a "
        "part; accepted: all, or comma-separated names of draft_loaders, one_pass, "
        "direct_loads, runai_stream, ungrouped_draft, skip_replaced, reload, weight_update, "
        "direct_update"
    ]


@pytest.mark.parametrize(
    ("value", "allowed"),
    [
        ("", set()),
        ("ALL", set(internals.PARTS)),
        (" one_pass ,skip_replaced", {"one_pass", "skip_replaced"}),
    ],
)
def test_the_parts_allowed_off(
    value: str, allowed: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(doctor.ALLOW_ENV, value)
    assert doctor.allowed_off() == allowed


@pytest.fixture
def embed_reshaped(vllm_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Model runner v2's ``maybe_share_target_embed`` in another shape (both layouts of
    the skip use it): the ``skip_replaced`` part is off, vLLM still replaces the modules."""
    module = importlib.import_module(EMBED)
    real = module.maybe_share_target_embed

    def maybe_share_target_embed(*args: Any) -> None:
        real(*args)

    monkeypatch.setattr(module, "maybe_share_target_embed", maybe_share_target_embed)
    parts._LATE_SAID.clear()
    yield
    monkeypatch.undo()
    parts._LATE_SAID.clear()
    assert internals.late_part("skip_replaced")[0] is None


@pytest.mark.vllm
def test_the_skip_off_is_said_and_the_draft_says_why_it_skipped_nothing(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    embed_reshaped: None,
) -> None:
    from hybrid_draft.adapter import loadscope

    # The V1 proposer where this release has it, else model runner v2's route.
    v1 = importlib.util.find_spec("vllm.v1.spec_decode.eagle") is not None
    route = "eagle" if v1 else "mrv2_eagle"
    with loadscope.scope():
        load_target_and_draft(engine_config(deepseek), route)
    (skipped,) = events.named("hybrid_draft.part_skipped")  # once, though asked twice
    assert skipped["part"] == "skip_replaced"
    assert skipped["shapes"] == {f"{EMBED}:maybe_share_target_embed": "(*args)"}
    (draft,) = events.decisions("draft")
    assert draft["sources"]["replaced_by_target"] == {"tensors": 0, "bytes": 0}
    assert draft["sources_detail"] == {"replaced_by_target": f"part_skipped: {skipped['reason']}"}
    (load,) = [e for e in events.named("hybrid_draft.loaded") if e["role"] == "draft"]
    assert load["sources"]["replaced_by_target"] == {"tensors": 0, "bytes": 0}
    assert load["sources"]["storage"] == {"tensors": 0, "bytes": 0}  # all from the stream


@pytest.mark.vllm
def test_doctor_fails_on_a_part_off_unless_allowed(
    embed_reshaped: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    (check,) = [c for c in doctor.CHECKS if getattr(c, "part", None) == "skip_replaced"]
    version = internals.vllm_version()
    assert version in internals.SUPPORTED_RELEASES
    ok, line = doctor.isolated(check)
    assert not ok
    assert line.startswith(f"part skip_replaced: off on vLLM {version}, a supported release: ")
    assert f"{EMBED}:maybe_share_target_embed is (*args)" in line
    assert line.endswith(f"(set {doctor.ALLOW_ENV}=skip_replaced to accept it)")
    monkeypatch.setenv(doctor.ALLOW_ENV, "skip_replaced")
    ok, line = doctor.isolated(check)
    assert ok and line.startswith(f"part skip_replaced: off, allowed by {doctor.ALLOW_ENV}: ")
    # The other parts are on, each on its own line.
    others = [doctor.isolated(c) for c in doctor.CHECKS if isinstance(c, doctor.PartCheck)]
    assert [ok for ok, _ in others] == [True] * len(internals.PARTS)
