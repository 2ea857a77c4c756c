"""The load events' schema is the record types, and docs/contract.md lists the same keys in
the same order: a key added to a type and not documented (or the other way) fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybrid_draft import records

pytestmark = pytest.mark.once  # the same on every vLLM release (docs/testing.md)

CONTRACT = (Path(__file__).parent.parent / "docs" / "contract.md").read_text()


def table_keys(after: str) -> list[str]:
    """The backticked names in the first column of the first table after ``after``."""
    start = CONTRACT.index(after)
    lines = CONTRACT[start:].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    out: list[str] = []
    for line in lines[first + 2 :]:
        if not line.startswith("|"):
            break
        out += re.findall(r"`([a-z_]+)`", line.split("|")[1])
    return out


WHERE = ["node", "rank", "settings_fingerprint", "settings_from"]


def test_the_decision_event_is_its_type_and_the_contract_lists_it() -> None:
    common = table_keys("Every decision carries")
    assert common[-4:] == WHERE == records.keys(records.Where)
    assert "A **target** decision adds `one_pass`" in CONTRACT
    draft = table_keys("A **draft** decision (other than `layer_error`) adds:")
    assert records.keys(records.Decision) == [*common[:-4], "one_pass", *draft, *WHERE]


def test_the_one_pass_report_is_its_type_and_the_contract_lists_it() -> None:
    documented = table_keys("A **target** decision adds `one_pass`")
    assert documented == records.keys(records.OnePass)


def test_the_loaded_event_is_its_type_and_the_contract_lists_it() -> None:
    documented = table_keys("### `hybrid_draft.loaded` and `hybrid_draft.load_failed`")
    assert documented == records.keys(records.Loaded)
    held = CONTRACT[CONTRACT.index("| `one_pass` | the target whose stream kept tensors") :]
    line = held.splitlines()[0]
    assert re.findall(r"`([a-z_]+)`", line.split("|")[2]) == records.keys(records.HoldFigures)


def test_absent_keys_are_left_out_and_null_ones_kept() -> None:
    where = records.Where(node="n", rank=None, settings_fingerprint=None)
    assert records.render(where) == {"node": "n", "rank": None, "settings_fingerprint": None}
    report = records.OnePass(enabled=False, reason="hold_budget_zero")
    assert records.render(report) == {"enabled": False, "reason": "hold_budget_zero"}
    decision = records.Decision(
        role="target",
        mode="auto",
        mode_source="default",
        method=None,
        requested_format="instanttensor",
        chosen_format="instanttensor",
        action="kept",
        reason="target_model",
        model="m",
        revision=None,
        one_pass=report,
        where=where,
    )
    rendered = records.render(decision)
    assert rendered["one_pass"] == {"enabled": False, "reason": "hold_budget_zero"}
    assert list(rendered)[-3:] == ["node", "rank", "settings_fingerprint"]
    assert "pruning_rule" not in rendered and rendered["method"] is None
