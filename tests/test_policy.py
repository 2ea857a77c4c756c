"""The policy alone: no vLLM, every reason code, checkpoint identity."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hybrid_draft.core import policy
from hybrid_draft.core.policy import Checkpoint, Request

pytestmark = pytest.mark.once  # the same on every vLLM release (docs/testing.md)


def draft(
    model: str = "org/m",
    revision: str | None = None,
    *,
    target: str = "org/m",
    target_revision: str | None = None,
    fmt: str = "instanttensor",
    explicit: str | None = None,
) -> Request:
    return Request(
        role="draft",
        requested_format=fmt,
        method="mtp",
        explicit_draft_format=explicit,
        model=Checkpoint(model, revision),
        target=Checkpoint(target, target_revision),
    )


@pytest.mark.parametrize("mode", ["auto", "safetensors", "instanttensor", "selective"])
def test_target_is_never_touched(mode: str) -> None:
    d = policy.decide(Request(role="target", requested_format="instanttensor"), mode)
    assert (d.action, d.reason, d.chosen_format) == ("kept", "target_model", "instanttensor")


@pytest.mark.parametrize("mode", ["auto", "safetensors", "instanttensor", "selective"])
def test_other_formats_are_left_alone(mode: str) -> None:
    d = policy.decide(draft(fmt="safetensors"), mode)
    assert (d.action, d.reason) == ("kept", "not_instanttensor")
    d = policy.decide(draft(fmt="safetensors", explicit="safetensors"), mode)
    assert (d.action, d.reason) == ("kept", "explicit_draft_loader")


@pytest.mark.parametrize(
    ("mode", "same", "expected"),
    [
        ("auto", True, ("switched", "same_checkpoint", "safetensors")),
        ("auto", False, ("kept", "different_checkpoint", "instanttensor")),
        ("safetensors", True, ("switched", "forced_safetensors", "safetensors")),
        ("safetensors", False, ("switched", "forced_safetensors", "safetensors")),
        ("instanttensor", True, ("kept", "mode_instanttensor", "instanttensor")),
        ("selective", True, ("switched", "selective", "instanttensor_selective")),
        ("selective", False, ("kept", "different_checkpoint", "instanttensor")),
    ],
)
def test_modes(mode: str, same: bool, expected: tuple[str, str, str]) -> None:
    d = policy.decide(draft(target="org/m" if same else "org/other"), mode)
    assert (d.action, d.reason, d.chosen_format) == expected
    assert d.requested_format == "instanttensor"


def test_an_ignored_explicit_draft_loader_does_not_block_the_mode() -> None:
    """vLLM's draft_model route ignores draft_load_config: the request is InstantTensor."""
    d = policy.decide(draft(target="org/other", explicit="safetensors"), "safetensors")
    assert (d.action, d.reason) == ("switched", "forced_safetensors")


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="accepted values are auto, safetensors"):
        policy.decide(draft(), "fast")


def test_fall_back_keeps_the_switch_but_loads_lazily() -> None:
    d = policy.fall_back(policy.decide(draft(), "selective"), "no_cuda", "CUDA is not available")
    assert (d.action, d.reason, d.chosen_format, d.fallback, d.detail) == (
        "switched",
        "selective_fallback",
        "safetensors",
        "no_cuda",
        "CUDA is not available",
    )


# --- checkpoint identity ------------------------------------------------------------------


def test_unset_draft_revision_reads_the_targets_revision() -> None:
    """vLLM builds the MTP draft with revision=None even for a target served with --revision."""
    assert policy.same_checkpoint(Checkpoint("org/m"), Checkpoint("org/m", "v2"))
    assert policy.same_checkpoint(Checkpoint("org/m", "v2"), Checkpoint("org/m", "v2"))
    assert not policy.same_checkpoint(Checkpoint("org/m", "v1"), Checkpoint("org/m", "v2"))
    assert not policy.same_checkpoint(Checkpoint("org/m"), Checkpoint("org/n"))


def test_local_directory_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "models" / "m"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    other = tmp_path / "models" / "copy"
    other.mkdir()
    monkeypatch.chdir(tmp_path / "models")
    target = Checkpoint(str(real), "main")
    for alias in (str(tmp_path / "link"), "./m/", "m", f"{real}/", f"{real}/../m"):
        assert policy.same_checkpoint(Checkpoint(alias), target), alias
    assert not policy.same_checkpoint(Checkpoint(str(other)), target)


def test_model_weights_alias(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    target = Checkpoint(str(cache), None, aliases=("s3://bucket/m",))
    assert policy.same_checkpoint(Checkpoint("s3://bucket/m"), target)


def test_policy_imports_no_vllm() -> None:
    import subprocess

    code = (
        "import sys, hybrid_draft.core.policy; "
        "print(sorted(m for m in ('vllm', 'torch', 'structlog') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "HYBRID_DRAFT_DISABLE": "1"},
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("source", "same", "setting", "checkpoint_format", "expected"),
    [
        # A reload from the checkpoint decides as a first load does.
        ("checkpoint", True, "auto", True, ("switched", "same_checkpoint", "safetensors")),
        ("checkpoint", False, "auto", True, ("kept", "different_checkpoint", "instanttensor")),
        ("weights_path", True, "auto", True, ("switched", "same_checkpoint", "safetensors")),
        # A draft with a checkpoint of its own keeps its weights when the target moves on.
        ("weights_path", False, "auto", True, ("kept", "own_checkpoint_kept", "instanttensor")),
        ("iterator", False, "auto", True, ("kept", "own_checkpoint_kept", "instanttensor")),
        # The draft of the target's checkpoint takes its tensors from the reload's stream.
        ("iterator", True, "auto", True, ("switched", "reload_stream", "weights_iterator")),
        ("iterator", True, "auto", False, ("kept", "kernel_format", "instanttensor")),
        ("checkpoint", True, "auto", False, ("kept", "kernel_format", "instanttensor")),
        ("checkpoint", True, "off", True, ("kept", "reload_off", "instanttensor")),
        ("iterator", True, "off", True, ("kept", "reload_off", "instanttensor")),
    ],
)
def test_a_reloads_draft(
    source: policy.ReloadSource,
    same: bool,
    setting: str,
    checkpoint_format: bool,
    expected: tuple[str, str, str],
) -> None:
    request = draft(target="org/m" if same else "org/other")
    reload = Request(**{**vars(request), "trigger": policy.Reload(source, checkpoint_format)})
    d = policy.decide(reload, "auto", reload_setting=setting)
    assert (d.action, d.reason, d.chosen_format) == expected
    if d.reason in policy.NOT_RELOADED:
        assert d.detail and d.detail.endswith("the draft keeps its weights")
    # The target's reload is never switched, whatever the setting.
    target = Request(role="target", requested_format="instanttensor", trigger=reload.trigger)
    assert policy.decide(target, "auto", reload_setting=setting).reason == "target_model"
