"""``hybrid-draft doctor``: one line per check, never a traceback, and a selective line that
says what selective really does on this host.

The end-to-end test (tests/e2e) also runs doctor in vLLM's CPU build next to the CUDA
torchvision that build pulls in, where importing vLLM raises RuntimeError: the reported
crash, reproduced for real.
"""

from __future__ import annotations

from typing import Any

import pytest

from hybrid_draft.tools import doctor


def test_a_raising_check_is_one_fail_line_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def check_vllm() -> doctor.Check:
        raise RuntimeError("operator torchvision::nms does not exist\n(a second line)")

    def check_exits() -> doctor.Check:
        raise SystemExit(3)

    ran = []

    def check_after() -> doctor.Check:
        ran.append(True)
        return True, "after: still runs"

    monkeypatch.setattr(doctor, "CHECKS", [check_vllm, check_exits, check_after])
    assert doctor.run() == 1
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        "FAIL vllm: the check raised RuntimeError: operator torchvision::nms does not exist "
        "(a second line)",
        "FAIL exits: the check raised SystemExit: 3",
        "ok   after: still runs",
    ]
    assert ran and "Traceback" not in out.out + out.err


def test_every_check_passing_exits_zero(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(doctor, "CHECKS", [lambda: (True, "a: fine"), lambda: (True, "b: fine")])
    assert doctor.run() == 0
    assert capsys.readouterr().out.splitlines() == ["ok   a: fine", "ok   b: fine"]


@pytest.mark.vllm
def test_selective_falls_back_on_this_host_without_cuda(vllm_runtime: Any) -> None:
    ok, line = doctor.check_selective()
    assert ok
    assert line == (
        "selective: falls back to lazy safetensors here: CUDA is not available (vLLM platform: cpu)"
    )


def _old_safe_open(filenames: Any, framework: str = "pt", device: Any = None) -> Any:
    """InstantTensor's ``safe_open`` before it took a ``tensor_filter``."""
    raise AssertionError("doctor must not call it")


@pytest.mark.vllm
def test_selective_is_available_only_with_cuda_and_a_tensor_filter(
    vllm_runtime: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import instanttensor

    from hybrid_draft.adapter import draftplan

    # As on a CUDA host (this one has none): vLLM on CUDA, the draft's device a CUDA one.
    monkeypatch.setattr(draftplan, "cuda_unavailable", lambda device=None: None)
    assert doctor.check_selective() == (
        True,
        "selective: available (CUDA and InstantTensor's tensor_filter)",
    )

    monkeypatch.setattr(instanttensor, "safe_open", _old_safe_open)
    ok, line = doctor.check_selective()
    assert not ok
    assert line.startswith("selective: falls back to lazy safetensors here: instanttensor ")
    assert "has no tensor_filter" in line

    monkeypatch.undo()
    monkeypatch.setattr(instanttensor, "safe_open", _old_safe_open)
    ok, line = doctor.check_selective()  # both missing: both named
    assert not ok and "CUDA is not available" in line and "has no tensor_filter" in line
