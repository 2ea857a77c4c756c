"""The model of an update's steps (``core/update.py``), against every sequence of calls.

No vLLM, no tensor: names, the model each call is made on, and the ends. A stateful
property-based test (hypothesis's rule-based state machine) drives one ``update.Step`` after
another as the adapter does (each call's tensors taken in order, the step ended at a repeat
or an end, the next begun with what the call brought from the repeat on) and checks it
against the rules as docs/contract.md states them, restated here on plain dictionaries: a
name brought again ends the step, unless a call on the draft brings what a call on the
target brought in it; a step commits only whole and unfailed; every step that does not
commit says why. The real thing, on real vLLM, is tests/test_update_sequences.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hybrid_draft.core import update

pytestmark = pytest.mark.once

OWN = tuple(f"mtp.{i}" for i in range(6))  # the draft's tensors, in file order
OTHERS = ("embed", "layer.0", "layer.1")  # the target's alone
LABELS = ("A", "B", "C")


class Spec:
    """The rules, restated: the draft's tensors of the open step by model, each with the
    label (the checkpoint) it came from; what the draft holds; each step's outcome."""

    def __init__(self) -> None:
        self.by_target: dict[str, str] = {}
        self.by_draft: dict[str, str] = {}
        self.failed = False
        self.draft = "A"
        self.outcomes: list[tuple[str, str | None]] = []

    def bring(self, name: str, label: str, role: str) -> bool:
        """A tensor a call brings: whether the open step takes it (to stage). A repeat
        ends the step first; a failed step notes the name and stages nothing."""
        if name not in OWN or (role == "draft" and name in self.by_target):
            return False
        if name in self.by_target or name in self.by_draft:
            self.end()
        (self.by_target if role == "target" else self.by_draft)[name] = label
        return not self.failed

    def end(self, target_failed: bool = False, commit_fails: bool = False) -> None:
        taken = {**self.by_draft, **self.by_target}
        if self.failed:
            self.outcomes.append(("failed", None))
        elif target_failed:
            self.outcomes.append(("kept", "target_failed"))
        elif not taken:
            self.outcomes.append(("kept", "no_draft_tensors"))
        elif set(taken) != set(OWN):
            self.outcomes.append(("kept", "incomplete_stream"))
        elif commit_fails:
            self.outcomes.append(("failed", None))
        else:
            self.outcomes.append(("committed", None))
            labels = set(taken.values())
            self.draft = labels.pop() if len(labels) == 1 else "mixed"
        self.by_target, self.by_draft, self.failed = {}, {}, False


brought = st.lists(st.sampled_from(OWN + OTHERS), max_size=12)


class Steps(RuleBasedStateMachine):
    """The adapter's loop around ``update.Step`` (``carry.Carry.feed``), the spec beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.spec = Spec()
        self.step = update.Step(OWN, "the direct update")
        self.outcomes: list[tuple[str, str | None]] = []
        self.draft = "A"
        #: What the open step staged, by name, with its label.
        self.staged: dict[str, str] = {}
        #: A failure armed for the next staging of a call's tensors (the draft's feed).
        self.armed = False

    def _ended(self, outcome: update.Outcome) -> None:
        assert outcome.state is not update.State.KEPT or (outcome.reason and outcome.detail), (
            "a kept step says why"
        )
        self.outcomes.append((outcome.state.value, outcome.reason))
        if outcome.state is update.State.COMMITTED:
            labels = set(self.staged.values())
            self.draft = labels.pop() if len(labels) == 1 else "mixed"
        self.staged = {}

    def _stage(self) -> None:
        """The adapter's staging of the call's pending tensors: the armed failure lands on
        the first that stages any."""
        pending = self.step.drain()
        if not pending:
            return
        if self.armed:
            self.armed = False
            self.step.fail(RuntimeError("the draft cannot take this call"))
            return
        for name, label in pending:
            assert name not in self.staged, f"{name} staged twice in one step"
            self.staged[name] = label

    @rule(names=brought, label=st.sampled_from(LABELS), role=st.sampled_from(["target", "draft"]))
    def call(self, names: list[str], label: str, role: update.Role) -> None:
        armed = self.armed
        for name in names:
            if self.spec.bring(name, label, role) and armed:
                self.spec.failed, armed = True, False
        for name in names:
            self.step.take(name, label, role)
        self._stage()
        while self.step.spill:
            self._ended(self.step.end())
            self.step = self.step.next()
            self._stage()

    @rule()
    def arm_a_failure(self) -> None:
        self.armed = True

    @rule(target_failed=st.booleans(), commit_fails=st.booleans())
    def end(self, target_failed: bool, commit_fails: bool) -> None:
        self.spec.end(target_failed, commit_fails)
        outcome = self.step.end(target_failed=target_failed)
        if outcome.state is update.State.COMMITTED and commit_fails:
            self.step.fail(RuntimeError("the commit failed"))
            outcome = self.step.outcome or outcome
        self._ended(outcome)
        self.step = update.Step(OWN, "the direct update")

    @invariant()
    def as_the_spec_says(self) -> None:
        assert self.outcomes == self.spec.outcomes
        assert self.draft == self.spec.draft
        assert self.step.by_target == self.spec.by_target.keys()
        assert self.step.by_draft == self.spec.by_draft.keys()


Steps.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSteps = Steps.TestCase


def test_an_ended_step_takes_nothing_more_and_says_what_it_may_do() -> None:
    step = update.Step(OWN, "the nccl session")
    for name in OWN:
        assert step.take(name, None, "target") is update.Given.TAKEN
    outcome = step.end()
    assert outcome == update.Outcome(update.State.COMMITTED)
    assert not step.may("take") and not step.may("end") and step.may("fail")
    with pytest.raises(RuntimeError, match="an ended committed step cannot take"):
        step.take(OWN[0], None, "target")
    with pytest.raises(RuntimeError, match="cannot end"):
        step.end()
    step.fail(RuntimeError("its commit"))
    assert step.outcome == update.Outcome(update.State.FAILED)


def test_a_step_kept_names_what_it_lacked_in_file_order() -> None:
    step = update.Step(OWN, "the nccl session")
    for name in reversed(OWN[2:]):
        step.take(name, None, "target")
    outcome = step.end()
    assert (outcome.state, outcome.reason) == (update.State.KEPT, "incomplete_stream")
    assert outcome.detail == (
        "the nccl session brought 4 of the draft's 6 tensors; it lacked 2: mtp.0, mtp.1: "
        "the draft keeps its weights"
    )


def test_a_step_without_a_plan_commits_only_what_vllm_finds_whole() -> None:
    fed = update.Step(None, "the direct update")
    assert fed.take("anything", None, "draft") is update.Given.TAKEN
    assert fed.take("anything", None, "draft") is update.Given.REPEAT
    whole = update.Step(None)
    whole.take("x", None, "draft")
    assert whole.end(complete=True).state is update.State.COMMITTED
    part = update.Step(None)
    part.take("x", None, "draft")
    assert part.end(complete=False).reason == "incomplete_stream"
    nothing = update.Step(None, "the direct update").end()
    assert (nothing.reason, "no plan" in (nothing.detail or "")) == ("incomplete_stream", True)
