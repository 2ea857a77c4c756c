"""The target formats the layer handles, without vLLM: the policy for drafts of
fastsafetensors and Run:ai targets, and the ``keep_formats`` setting."""

from __future__ import annotations

import pytest

from hybrid_draft import settings
from hybrid_draft.core import policy
from hybrid_draft.core.policy import Checkpoint, Request


def draft(fmt: str, same: bool = True) -> Request:
    return Request(
        role="draft",
        requested_format=fmt,
        method="mtp",
        model=Checkpoint("org/m"),
        target=Checkpoint("org/m" if same else "org/other"),
    )


@pytest.mark.parametrize("fmt", ["fastsafetensors", "runai_streamer"])
@pytest.mark.parametrize(
    ("mode", "same", "expected"),
    [
        ("auto", True, ("switched", "same_checkpoint")),
        ("selective", True, ("switched", "same_checkpoint")),
        ("auto", False, ("kept", "different_checkpoint")),
        ("safetensors", False, ("switched", "forced_safetensors")),
        ("instanttensor", True, ("kept", "mode_instanttensor")),
    ],
)
def test_a_fast_loader_target_draft_stays_in_its_family(
    fmt: str, mode: str, same: bool, expected: tuple[str, str]
) -> None:
    d = policy.decide(draft(fmt, same), mode)
    assert (d.action, d.reason) == expected
    assert d.chosen_format == fmt  # switched or not, the target's own loader family


@pytest.mark.parametrize("fmt", ["fastsafetensors", "runai_streamer", "instanttensor"])
def test_a_format_not_handled_is_left_alone(fmt: str) -> None:
    formats = tuple(f for f in policy.TARGET_FORMATS if f != fmt)
    d = policy.decide(draft(fmt), "auto", formats)
    assert (d.action, d.reason, d.chosen_format) == ("kept", "not_instanttensor", fmt)


@pytest.mark.parametrize("fmt", ["fastsafetensors", "runai_streamer"])
def test_a_library_that_cannot_filter_by_name_is_its_own_reason(fmt: str) -> None:
    formats = tuple(f for f in policy.TARGET_FORMATS if f != fmt)
    d = policy.decide(draft(fmt), "auto", formats, unfiltered=(fmt,))
    assert (d.action, d.reason, d.chosen_format) == ("kept", "no_tensor_filter", fmt)
    assert "no_tensor_filter" in policy.REASONS


def test_an_older_runai_streamer_is_unfiltered_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Run:ai Model Streamer whose ``stream_files`` takes no ``tensor_names`` (before 0.17):
    its targets' drafts are vLLM's, and say why; unless keep_formats already names it."""
    from runai_model_streamer import SafetensorsStreamer

    from hybrid_draft.adapter import loaders

    def stream_files(self: object, paths: list[str], device: str = "cpu") -> None: ...

    monkeypatch.setattr(SafetensorsStreamer, "stream_files", stream_files)
    loaders.available_formats.cache_clear()
    loaders.unfiltered_formats.cache_clear()
    try:
        assert "runai_streamer" not in loaders.available_formats()
        assert "runai_streamer" in loaders.unfiltered_formats()
        current = settings.load({"HYBRID_DRAFT_CONFIG": "/nonexistent"})
        assert "runai_streamer" in loaders.unfiltered(current)
        kept = settings.load(
            {"HYBRID_DRAFT_CONFIG": "/nonexistent", "HYBRID_DRAFT_KEEP_FORMATS": "runai_streamer"}
        )
        assert "runai_streamer" not in loaders.unfiltered(kept)
    finally:
        loaders.available_formats.cache_clear()
        loaders.unfiltered_formats.cache_clear()


def test_handled_formats_are_the_available_ones_less_those_kept() -> None:
    available = ("instanttensor", "fastsafetensors")
    assert policy.handled_formats((), available) == available
    assert policy.handled_formats(("fastsafetensors",), available) == ("instanttensor",)
    assert policy.handled_formats(("runai_streamer",), policy.TARGET_FORMATS) == (
        "instanttensor",
        "fastsafetensors",
    )


def test_settings_and_policy_name_the_same_formats() -> None:
    assert settings.TARGET_FORMATS == policy.TARGET_FORMATS


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("fastsafetensors", ("fastsafetensors",)),
        (" RunAI_Streamer , fastsafetensors,", ("fastsafetensors", "runai_streamer")),
        ("instanttensor,instanttensor", ("instanttensor",)),
    ],
)
def test_keep_formats_from_the_environment(raw: str, expected: tuple[str, ...]) -> None:
    s = settings.load({"HYBRID_DRAFT_KEEP_FORMATS": raw, "HYBRID_DRAFT_CONFIG": "/nonexistent"})
    assert (s.keep_formats.value, s.keep_formats.source) == (expected, "env")


def test_keep_formats_from_the_file(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "c.toml"
    path.write_text('[draft]\nkeep_formats = ["runai_streamer"]\n')
    s = settings.load({"HYBRID_DRAFT_CONFIG": str(path)})
    assert (s.keep_formats.value, s.keep_formats.source) == (("runai_streamer",), "file")
    assert settings.load({"HYBRID_DRAFT_CONFIG": "/nonexistent"}).keep_formats.value == ()


@pytest.mark.parametrize("raw", ["safetensors", "fastsafetensors,bin"])
def test_an_unknown_format_names_the_variable_and_the_accepted_ones(raw: str) -> None:
    with pytest.raises(settings.ConfigError) as info:
        settings.load({"HYBRID_DRAFT_KEEP_FORMATS": raw, "HYBRID_DRAFT_CONFIG": "/nonexistent"})
    assert info.value.source == "HYBRID_DRAFT_KEEP_FORMATS"
    assert "instanttensor, fastsafetensors, runai_streamer" in info.value.detail
    assert "\n" not in str(info.value)


def test_a_held_view_of_a_larger_buffer_is_copied_and_an_own_tensor_is_not() -> None:
    """fastsafetensors' and Run:ai 0.17's tensors are views of a shard's or a ring slot's
    buffer: held as they are, they would keep all of it alive."""
    import torch

    from hybrid_draft.core import hold

    buffer = torch.arange(1024, dtype=torch.float32)
    view = buffer[256:512].view(16, 16)
    held = hold.own(view)
    assert held.untyped_storage().nbytes() == 256 * 4
    assert held.data_ptr() != view.data_ptr() and torch.equal(held, view)
    alone = torch.ones(4, 4)
    assert hold.own(alone) is alone
