"""vLLM's private names are checked by shape, not by name: a name that is still there but
takes other arguments, or returns another tuple, switches its part off where ``get_model``
is wrapped (``hybrid_draft.part_skipped`` naming it and the shape found), and the loads
that part would have made stay on vLLM's own path instead of failing mid-load."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Events, Recorder, engine_config, load_target_and_draft
from hybrid_draft.adapter import internals, parts

pytestmark = pytest.mark.vllm

PREPARE = "vllm.model_executor.model_loader.default_loader:DefaultModelLoader._prepare_weights"


@pytest.fixture
def reshape(vllm_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Give ``DefaultModelLoader._prepare_weights`` another shape, then probe this vLLM
    anew as the hook does; the real one (and a clean probe) come back afterwards."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    def apply(replacement: Callable[..., Any]) -> None:
        monkeypatch.setattr(DefaultModelLoader, "_prepare_weights", replacement)
        parts.check_parts()

    yield apply
    monkeypatch.undo()
    parts.check_parts()
    assert not parts.installed().capabilities.off


def test_this_vllm_has_every_private_name_in_the_shape_the_layer_uses(
    vllm_runtime: Any,
) -> None:
    caps = internals.capabilities()
    assert (dict(caps.off), caps.missing, dict(caps.shapes)) == ({}, frozenset(), {})


def test_another_arity_switches_the_parts_off_and_the_draft_loads_on_vllms_path(
    deepseek: Path,
    events: Events,
    instanttensor_standin: Recorder,
    lazy_spy: Recorder,
    reshape: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    real = DefaultModelLoader._prepare_weights

    # vLLM's own call still fits it; the layer's five named arguments no longer do.
    def _prepare_weights(self: Any, model_or_path: str, *args: Any, **kwargs: Any) -> Any:
        return real(self, model_or_path, *args, **kwargs)

    reshape(_prepare_weights)
    skipped = {e["part"]: e for e in events.named("hybrid_draft.part_skipped")}
    assert set(skipped) == {"draft_loaders", "ungrouped_draft"}
    for event in skipped.values():
        assert event["missing"] == []
        assert event["shapes"] == {PREPARE: "(self, model_or_path, *args, **kwargs)"}
        assert event["reason"] == (
            f"this vLLM's {PREPARE} is (self, model_or_path, *args, **kwargs), not (self, "
            "model_name_or_path, subfolder, revision, fall_back_to_pt, "
            "allow_patterns_overrides) -> 4 values"
        )

    monkeypatch.setenv("INSTANTTENSOR_DRAFT_LOADER", "selective")
    load_target_and_draft(engine_config(deepseek))
    (target,) = events.decisions("target")
    assert target["one_pass"]["reason"] == "part_skipped"
    (draft,) = events.decisions("draft")
    assert (draft["action"], draft["chosen_format"], draft["fallback"]) == (
        "switched",
        "safetensors",
        "part_skipped",
    )
    assert draft["detail"] == skipped["draft_loaders"]["reason"]
    assert draft["tensor_filter"] is False and "plan_error" not in draft
    # Loaded by vLLM's own lazy safetensors, without an error.
    assert [c["strategy"] for c in lazy_spy.calls] == ["lazy"]
    assert not events.named("hybrid_draft.load_failed")
    assert [e["role"] for e in events.named("hybrid_draft.loaded")] == ["target", "draft"]


def test_another_return_tuple_switches_the_parts_off(
    events: Events, reshape: Callable[..., None]
) -> None:
    def _prepare_weights(
        self: Any,
        model_name_or_path: str,
        subfolder: str | None,
        revision: str | None,
        fall_back_to_pt: bool,
        allow_patterns_overrides: list[str] | None,
    ) -> Any:
        return model_name_or_path, [], True, "", None

    reshape(_prepare_weights)
    (event, _) = events.named("hybrid_draft.part_skipped")
    assert event["part"] == "draft_loaders"
    assert event["shapes"][PREPARE].endswith("-> 5 values")
    # The load figures that count shards through it are off too, and the one pass with them.
    assert parts.part_off("one_pass") == event["reason"]
