"""Every sequence of a trainer's calls on a served model: the draft follows, or keeps the
previous step whole, and an event says which and why.

Real vLLM on the CPU: model runner v2 (every release) and 0.33's V1 runner, each built once
and loaded as vLLM's CPU worker loads it, the tiny DeepSeek-V3 with MLA and one MTP layer.
A stateful property-based test (hypothesis's rule-based state machine, a fixed seed, a few
hundred sequences) makes a trainer's calls in any order and shape, three checkpoints' worth:

- calls on the target (``load_weights``): every tensor of a checkpoint, or part of the MTP
  layer, or none of it; in file order, reversed or shuffled; one call, buckets or one call
  per tensor; each a list, a tuple or a stream (a generator), by position or ``weights=``;
- calls on the draft itself (verl, skyrl and NeMo RL feed it what they feed the target);
- each end of a step: the caller's processing of the target or of the draft, the runner's
  next step, a data-parallel rank's dummy batch, vLLM's own reload, the start of a
  weight-transfer session;
- failures: the caller's stream raising part way through vLLM's call, vLLM's call raising
  on a tensor it refuses, the draft's staged load raising part way, vLLM's placing of the
  second draft layer at the commit, and vLLM's finalize of the draft raising after its
  attention processing ran.

After every call and every end the draft's weights, read in the very tensors it was built
with (CUDA graphs are captured on them; while a step is staged the draft's modules hold
vLLM's layerwise-reload placeholders instead), equal what the rules of docs/contract.md
("When a step ends") say: a fresh boot of the checkpoint the target was given, or the
previous step's, whole. Each step's end is an event: the draft's ``loaded``, its decision
``kept`` with the reason, or its ``load_failed``, in that order. The rules are restated here
on names and checkpoint labels (:class:`Rules`); the weights a mixed step leaves are what
vLLM's own load and processing of those tensors give a second draft of the same checkpoint
(checked, for each whole checkpoint, against its fresh boot).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from conftest import (
    checkpoint_tensors,
    engine_config,
    failing_commit,
    load_target_and_draft,
    model_runner,
    reload_weights,
)

pytestmark = pytest.mark.vllm

#: The sequences per route: a fixed seed (the same sequences on every run).
EXAMPLES = int(os.environ.get("HYBRID_DRAFT_SEQUENCES", "150"))
LABELS = ("A", "B", "C")
MTP = "model.layers.2."
DECISION, LOADED, FAILED = (
    "hybrid_draft.decision",
    "hybrid_draft.loaded",
    "hybrid_draft.load_failed",
)


def _tensors(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model``: the very objects."""
    out = dict(model.named_parameters())
    out.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    return out


def _values(objects: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in objects.items()}


@dataclass
class World:
    """The checkpoints, their tensors, and what each gives a freshly booted draft."""

    paths: dict[str, Path]
    tensors: dict[str, dict[str, torch.Tensor]]
    #: The draft's own tensors (its plan's: the MTP layer less what vLLM shares).
    own: tuple[str, ...]
    names: tuple[str, ...]
    #: Each checkpoint's fresh boot: the target's values, the draft's own values.
    boot_target: dict[str, dict[str, torch.Tensor]]
    boot_draft: dict[str, dict[str, torch.Tensor]]
    #: A second draft, loaded by vLLM alone: what vLLM's load of given tensors leaves.
    reference: Any
    reference_config: Any
    expected: dict[tuple[str, ...], dict[str, torch.Tensor]] = field(default_factory=dict)

    def draft_state(self, labels: dict[str, str]) -> dict[str, torch.Tensor]:
        """The draft's own values when its tensors came from ``labels`` (name -> checkpoint):
        a whole checkpoint's fresh boot, else vLLM's own load and processing of those
        tensors into the reference draft."""
        key = tuple(labels[n] for n in self.own)
        if key not in self.expected:
            if len(set(key)) == 1:
                self.expected[key] = self.boot_draft[key[0]]
            else:
                self.expected[key] = self._reference(labels)
        return self.expected[key]

    def _reference(self, labels: dict[str, str]) -> dict[str, torch.Tensor]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        config = self.reference_config
        with set_current_vllm_config(config):
            self.reference.load_weights([(n, self.tensors[labels[n]][n]) for n in self.own])
            process_weights_after_loading(
                self.reference, config.speculative_config.draft_model_config, torch.device("cpu")
            )
        keys = self.boot_draft["A"].keys()
        return {n: v for n, v in _values(_tensors(self.reference)).items() if n in keys}


def _own_names(runner: Any) -> set[str]:
    theirs = {id(p) for p in runner.get_model().parameters()}
    return {n for n, t in _tensors(runner.get_draft_model()).items() if id(t) not in theirs}


@pytest.fixture(scope="module")
def world(deepseek: Path, step2: Path, step3: Path, vllm_runtime: Any) -> World:
    paths = {"A": deepseek, "B": step2, "C": step3}
    tensors = {label: checkpoint_tensors(path) for label, path in paths.items()}
    boots = {
        label: load_target_and_draft(engine_config(path, load_format="safetensors"))
        for label, path in paths.items()
    }
    theirs = {id(p) for p in boots["A"].target.parameters()}
    own_keys = {n for n, t in _tensors(boots["A"].draft).items() if id(t) not in theirs}
    boot_draft = {
        label: {n: v for n, v in _values(_tensors(b.draft)).items() if n in own_keys}
        for label, b in boots.items()
    }
    names = tuple(tensors["A"])
    own = tuple(
        n
        for n in names
        if n.startswith(MTP) and not n.endswith(("embed_tokens.weight", "shared_head.head.weight"))
    )
    made = World(
        paths=paths,
        tensors=tensors,
        own=own,
        names=names,
        boot_target={label: _values(_tensors(b.target)) for label, b in boots.items()},
        boot_draft=boot_draft,
        reference=boots["A"].draft,
        reference_config=boots["A"].config,
    )
    # The reference is faithful: vLLM's own load of a whole checkpoint's tensors into it
    # gives what that checkpoint's fresh boot gives (and another's does not).
    for label in ("B", "A"):
        assert _differing(made._reference(dict.fromkeys(own, label)), boot_draft[label]) == []
    assert _differing(boot_draft["A"], boot_draft["B"]), "the checkpoints must differ"
    return made


def _differing(now: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    assert now.keys() == expected.keys(), sorted(now.keys() ^ expected.keys())
    return sorted(n for n in expected if not torch.equal(now[n], expected[n]))


@dataclass
class Runner:
    """One runner, its models' original tensors, and what each call is made through."""

    route: str
    runner: Any
    target: dict[str, torch.Tensor]
    draft: dict[str, torch.Tensor]


@pytest.fixture(scope="module", params=["v2", "v1"])
def served(request: pytest.FixtureRequest, world: World) -> Runner:
    """The runner of ``request.param``'s route, its target loaded with lazy safetensors (a
    direct update follows whatever format the target was first loaded with)."""
    runner = model_runner(engine_config(world.paths["A"], load_format="safetensors"), request.param)
    assert _own_names(runner) == set(world.boot_draft["A"]), "the draft's own tensors"
    theirs = {id(p) for p in runner.get_model().parameters()}
    draft = {n: t for n, t in _tensors(runner.get_draft_model()).items() if id(t) not in theirs}
    return Runner(request.param, runner, _tensors(runner.get_model()), draft)


# --- the rules, restated on names and labels ----------------------------------------------


@dataclass
class Step:
    """One step as the rules see it: the draft's tensors it took, by model, with labels."""

    by_target: dict[str, str] = field(default_factory=dict)
    by_draft: dict[str, str] = field(default_factory=dict)
    failed: bool = False


class Rules:
    """docs/contract.md's rules of a step, on names and the checkpoint each tensor came from:
    what the target was given, what the draft holds, each step's outcome as its events say."""

    def __init__(self, world: World) -> None:
        self.own = frozenset(world.own)
        self.target = dict.fromkeys(world.names, "A")
        self.draft = dict.fromkeys(world.own, "A")
        self.step = Step()
        #: Whether an update is open: the first call since the last end begins one.
        self.begun = False
        self.outcomes: list[tuple[str, str | None]] = []
        #: A failure armed for the draft's next staged load: it lands on the first step
        #: that takes a tensor in a call that returns.
        self.feed_fails = False

    def call(self, role: str, items: list[tuple[str, str]]) -> None:
        """A call that returned: each tensor in order (a name brought again ends the step
        there, the next begins with it); then its tensors staged, step by step."""
        self.begun = True
        ended: list[Step] = []
        first: int | None = None  # the step (by cuts before it) that took first
        for name, label in items:
            if role == "target":
                self.target[name] = label
            step = self.step
            if name not in self.own or (role == "draft" and name in step.by_target):
                continue
            if name in step.by_target or name in step.by_draft:
                ended.append(step)
                self.step = step = Step()
            (step.by_target if role == "target" else step.by_draft)[name] = label
            if first is None and not step.failed:
                first = len(ended)
        if self.feed_fails and first is not None:
            self.feed_fails = False
            (ended[first] if first < len(ended) else self.step).failed = True
        for step in ended:
            self._decide(step)

    def raised(self, items: list[tuple[str, str]]) -> None:
        """A call on the target that raised after taking ``items``: nothing of it staged;
        the update ends, the draft kept."""
        self.begun = True
        for name, label in items:
            self.target[name] = label
        self.end(target_failed=True)

    def complete(self) -> bool:
        step = self.step
        return not step.failed and set(step.by_target) | set(step.by_draft) == self.own

    def end(self, target_failed: bool = False, commit_fails: bool = False) -> None:
        """The open step's end (none without a call since the last end)."""
        if self.begun:
            self._decide(self.step, target_failed, commit_fails)
        self.step, self.begun = Step(), False

    def _decide(self, step: Step, target_failed: bool = False, commit_fails: bool = False) -> None:
        taken = {**step.by_draft, **step.by_target}
        if step.failed:
            self.outcomes.append(("failed", None))
        elif target_failed:
            self.outcomes.append(("kept", "target_failed"))
        elif not taken:
            self.outcomes.append(("kept", "no_draft_tensors"))
        elif set(taken) != self.own:
            self.outcomes.append(("kept", "incomplete_stream"))
        elif commit_fails:
            self.outcomes.append(("failed", None))
        else:
            self.outcomes.append(("committed", None))
            self.draft = taken


def _outcomes(events: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """Each of the draft's direct updates' steps as its events tell it."""
    out: list[tuple[str, str | None]] = []
    for e in events:
        if e.get("role") != "draft" or e.get("trigger") != "direct_update":
            continue
        if e["event"] == DECISION and e["action"] == "kept":
            out.append(("kept", e["reason"]))
        elif e["event"] == LOADED:
            out.append(("committed", None))
        elif e["event"] == FAILED:
            out.append(("failed", None))
    return out


# --- the trainer's calls --------------------------------------------------------------------

SUBSETS = ("all", "no_mtp", "mtp_prefix", "mtp_but_one")
ORDERS = ("file", "reversed", "shuffled")
CUTS = ("one_call", "buckets", "per_tensor")
SHAPES = ("list", "tuple", "stream")


def _names(world: World, subset: str, order: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    names = list(world.names)
    if order == "reversed":
        names.reverse()
    elif order == "shuffled":
        rng.shuffle(names)
    own = [n for n in names if n in world.own]
    if subset == "no_mtp":
        drop = set(own)
    elif subset == "mtp_prefix":
        drop = set(own[rng.randrange(1, len(own)) :])
    elif subset == "mtp_but_one":
        drop = {rng.choice(own)}
    else:
        drop = set()
    return [n for n in names if n not in drop]


def _calls(names: list[str], cut: str, seed: int) -> list[list[str]]:
    if cut == "one_call":
        return [names]
    if cut == "per_tensor":
        return [[n] for n in names]
    rng = random.Random(seed)
    marks = sorted(rng.sample(range(1, len(names)), min(3, len(names) - 1)))
    return [names[a:b] for a, b in zip([0, *marks], [*marks, len(names)], strict=True)]


def _shaped(items: list[tuple[str, torch.Tensor]], shape: str) -> Any:
    if shape == "tuple":
        return tuple(items)
    if shape == "stream":
        return (item for item in items)
    return items


def _raising(items: list[tuple[str, torch.Tensor]], after: int) -> Iterator[tuple[str, Any]]:
    """A caller's stream that fails part way (its broadcast broke)."""
    yield from items[:after]
    raise RuntimeError("the trainer's stream broke")


class Sequences(RuleBasedStateMachine):
    """A trainer's calls on one served runner, the rules beside them."""

    def __init__(self, world: World, served: Runner, events: Path) -> None:
        super().__init__()
        self.world, self.served, self.events = world, served, events
        self.rules = Rules(world)
        #: What puts back a failure armed and not yet met.
        self.disarm: list[Callable[[], None]] = []
        _reset(world, served)
        events.write_text("")

    # -- calls -----------------------------------------------------------------------------

    def _configured(self) -> Any:
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.served.runner.vllm_config)

    def _call(self, model: Any, items: list[tuple[str, Any]], shape: str, by_keyword: bool) -> None:
        weights = _shaped(items, shape)
        with self._configured():
            if by_keyword:
                model.load_weights(weights=weights)
            else:
                model.load_weights(weights)

    @rule(
        label=st.sampled_from(LABELS),
        subset=st.sampled_from(SUBSETS),
        order=st.sampled_from(ORDERS),
        cut=st.sampled_from(CUTS),
        shape=st.sampled_from(SHAPES),
        by_keyword=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def sync_the_target(
        self, label: str, subset: str, order: str, cut: str, shape: str, by_keyword: bool, seed: int
    ) -> None:
        tensors = self.world.tensors[label]
        target = self.served.runner.get_model()
        for call in _calls(_names(self.world, subset, order, seed), cut, seed):
            self._call(target, [(n, tensors[n]) for n in call], shape, by_keyword)
            self.rules.call("target", [(n, label) for n in call])

    @rule(
        label=st.sampled_from(LABELS),
        subset=st.sampled_from(("all", "mtp_prefix")),
        cut=st.sampled_from(("one_call", "buckets")),
        shape=st.sampled_from(SHAPES),
        seed=st.integers(0, 2**16),
    )
    def feed_the_draft(self, label: str, subset: str, cut: str, shape: str, seed: int) -> None:
        """What verl, skyrl and NeMo RL give the drafter: the buckets they gave the target."""
        tensors = self.world.tensors[label]
        draft = self.served.runner.get_draft_model()
        for call in _calls(_names(self.world, subset, "file", seed), cut, seed):
            self._call(draft, [(n, tensors[n]) for n in call], shape, by_keyword=True)
            self.rules.call("draft", [(n, label) for n in call])

    @rule(label=st.sampled_from(LABELS), seed=st.integers(0, 2**16), refused=st.booleans())
    def a_call_that_raises(self, label: str, seed: int, refused: bool) -> None:
        """The caller's stream breaks part way, or vLLM refuses a tensor of its own part way
        (another shape): the call raises to the caller, the target keeps what it took
        before, the update ends."""
        tensors = self.world.tensors[label]
        rng = random.Random(seed)
        names = list(self.world.names)
        rng.shuffle(names)
        items = [(n, tensors[n]) for n in names]
        if refused:
            at = rng.choice([i for i, n in enumerate(names) if not n.startswith(MTP)])
            items[at] = (names[at], torch.zeros(3, 3, 3))
            weights: Any = iter(items)
        else:
            at = rng.randrange(1, len(names))
            weights = _raising(items, at)
        # The caller's own error, or vLLM's: never one of the layer's.
        with self._configured(), pytest.raises(Exception) as raised:
            self.served.runner.get_model().load_weights(weights)
        if refused:
            assert "hybrid_draft" not in "".join(traceback.format_tb(raised.tb)[-1:]), raised
        else:
            assert str(raised.value) == "the trainer's stream broke", raised
        self.rules.raised([(n, label) for n in names[:at]])

    # -- ends ------------------------------------------------------------------------------

    @rule(
        how=st.sampled_from(
            ("process_target", "process_draft", "next_step", "dummy_batch", "session")
        )
    )
    def end_the_step(self, how: str) -> None:
        self._end(how)
        self.rules.end()

    def _end(self, how: str) -> None:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.v1.core.sched.output import SchedulerOutput

        from hybrid_draft.adapter import direct

        runner = self.served.runner
        with self._configured():
            if how == "process_target":
                process_weights_after_loading(runner.model, runner.model_config, runner.device)
            elif how == "process_draft":
                spec = runner.vllm_config.speculative_config
                process_weights_after_loading(
                    runner.get_draft_model(), spec.draft_model_config, runner.device
                )
            elif how == "next_step":
                with contextlib.suppress(AttributeError):  # a load-only runner: no KV cache
                    runner.execute_model(SchedulerOutput.make_empty())
            elif how == "dummy_batch":
                with contextlib.suppress(Exception):  # a load-only runner: no KV cache
                    runner._dummy_run(1)
            elif how == "session":  # what the worker's hook does before vLLM's session begins
                direct.settle(runner, "weight_update")

    @rule()
    def reload(self) -> None:
        """vLLM's own reload of the runner: the open update ends, then both models reload
        from the runner's checkpoint (A)."""
        self.rules.end()
        reload_weights(self.served.runner)
        self.rules.target = dict.fromkeys(self.world.names, "A")
        self.rules.draft = dict.fromkeys(self.world.own, "A")

    # -- failures of the draft's part --------------------------------------------------------

    @precondition(lambda self: not self.rules.feed_fails)
    @rule()
    def the_drafts_next_load_fails_part_way(self) -> None:
        """The draft's next staged load (of the served draft) takes half its tensors, then
        raises."""
        from hybrid_draft.adapter import direct

        draft = self.served.runner.get_draft_model()
        link = vars(self.served.runner)[direct.ATTR]
        cls = type(draft)
        real = cls.load_weights

        def failing(model: Any, weights: Any) -> Any:
            if model is not draft or link.update is None:  # the reference draft; a reload
                return real(model, weights)
            cls.load_weights = real
            items = list(weights)
            real(model, items[: len(items) // 2])
            raise RuntimeError("the draft's load failed part way")

        def disarm() -> None:
            cls.load_weights = real

        cls.load_weights = failing
        self.disarm.append(disarm)
        self.rules.feed_fails = True

    @precondition(lambda self: self.rules.complete())
    @rule(
        which=st.sampled_from(("placing", "finalize")),
        how=st.sampled_from(("next_step", "process_target")),
    )
    def the_commit_fails(self, which: str, how: str) -> None:
        """The step's end decides to commit, and vLLM fails part way through it: placing the
        second processed draft layer into its storage, or its finalize after the attention
        processing has run (on the new weights)."""
        with failing_commit(self.served.runner, which):
            self._end(how)
        self.rules.end(commit_fails=True)

    # -- what must hold ------------------------------------------------------------------------

    @invariant()
    def the_draft_is_a_whole_step(self) -> None:
        """The draft's own tensors hold exactly one step's weights (or the rules' mix of a
        step's tensors), whatever is open; after the rules' end every step said which."""
        expected = self.world.draft_state(self.rules.draft)
        assert _differing(_values(self.served.draft), expected) == []
        events = _read(self.events)
        from hybrid_draft.core import update

        ends = {e.get("ended_by") for e in events if e.get("trigger") == "direct_update"}
        assert ends - {None} <= set(update.ENDS["direct_update"]), ends
        assert _outcomes(events) == self.rules.outcomes, [
            {
                k: e.get(k)
                for k in ("event", "role", "trigger", "action", "reason", "error", "detail")
            }
            for e in events
            if e.get("role") == "draft"
        ]
        if not self.rules.begun:
            self._nothing_waits()

    def _nothing_waits(self) -> None:
        """No update open: the draft is on its own tensors again, none in a reload, and the
        target holds what it was given, where that is one checkpoint."""
        from hybrid_draft.adapter import internals

        draft = self.served.runner.get_draft_model()
        now = {n: t for n, t in _tensors(draft).items() if n in self.served.draft}
        assert all(now[n] is t for n, t in self.served.draft.items()), "the draft's own tensors"
        assert not any(
            (info := internals.layerwise_info(m)) is not None and info.can_load()
            for m in draft.modules()
        )
        labels = set(self.rules.target.values())
        if len(labels) == 1:
            label = labels.pop()
            target = _values(self.served.target)
            assert _differing(target, self.world.boot_target[label]) == []

    def teardown(self) -> None:
        from vllm.v1.core.sched.output import SchedulerOutput

        for disarm in self.disarm:
            disarm()
        with self._configured(), contextlib.suppress(AttributeError):
            self.served.runner.execute_model(SchedulerOutput.make_empty())


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _reset(world: World, served: Runner) -> None:
    """Both models back to the first checkpoint's boot, in their own tensors, with no
    update open (the layer left out: a test's own set-up)."""
    from hybrid_draft.adapter import direct

    runner = served.runner
    link = vars(runner).get(direct.ATTR)
    assert link is not None and link.update is None, "an update left open by the last sequence"
    link.processed = False
    with torch.no_grad():
        for name, tensor in served.target.items():
            tensor.copy_(world.boot_target["A"][name])
        for name, tensor in served.draft.items():
            tensor.copy_(world.boot_draft["A"][name])


def test_every_sequence_of_calls_leaves_the_draft_a_whole_step_and_says_which(
    world: World, served: Runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("HYBRID_DRAFT_EVENTS_FILE", str(events))
    run_state_machine_as_test(
        lambda: Sequences(world, served, events),
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=10,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
