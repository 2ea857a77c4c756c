"""The load events' schemas: one frozen type per event a model load writes.

A load's ``hybrid_draft.decision`` and ``hybrid_draft.loaded`` / ``load_failed`` events are
rendered from these types and nothing else, so a type's fields are the event's keys, in
order (docs/contract.md lists the same keys; ``tests/test_records.py`` compares them). A
field whose value is :data:`ABSENT` is left out of the event (a key the contract gives
"only when ..."); ``None`` is written as null (a key every such event carries, unknown
here). Pure: no vLLM import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, TypeVar


class Absent:
    """The value of a key this event leaves out (falsy, one instance)."""

    _instance: Absent | None = None

    def __new__(cls) -> Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Final = Absent()

T = TypeVar("T")
#: A key this event carries (``T``) or leaves out.
Opt: TypeAlias = T | Absent
#: Per-source counts: ``{"storage"|"stream"|"replaced_by_target": {"tensors", "bytes"}}``.
Sources: TypeAlias = Mapping[str, Mapping[str, int]]


def render(record: Any) -> dict[str, Any]:
    """A record's event keys in field order: nested records flattened, ABSENT left out."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if f.metadata.get("flatten"):
            out.update(render(value))
        elif value is not ABSENT:
            out[f.name] = render(value) if dataclasses.is_dataclass(value) else value
    return out


def keys(cls: type) -> list[str]:
    """Every key an event of type ``cls`` can carry, in order."""
    out: list[str] = []
    for f in dataclasses.fields(cls):
        nested = f.metadata.get("flatten")
        out += keys(nested) if nested else [f.name]
    return out


@dataclass(frozen=True, kw_only=True)
class Where:
    """Where a load happened and with which settings (``hybrid-draft report`` groups ranks
    by it): computed once per load."""

    node: str
    rank: int | None
    #: Null when the settings are invalid.
    settings_fingerprint: str | None
    #: The Ray driver's host, where its settings were carried here.
    settings_from: Opt[str] = ABSENT


@dataclass(frozen=True, kw_only=True)
class OnePass:
    """A target decision's ``one_pass``: whether its stream keeps the draft's tensors."""

    enabled: bool
    reason: Opt[str] = ABSENT
    detail: Opt[str] = ABSENT
    budget: Opt[int] = ABSENT
    planned_tensors: Opt[int] = ABSENT
    planned_bytes: Opt[int] = ABSENT
    draft_tensors: Opt[int] = ABSENT
    draft_bytes: Opt[int] = ABSENT


@dataclass(frozen=True, kw_only=True)
class SettingsChanged:
    """A draft decision's ``settings_changed``: what the draft did about settings other
    than the ones its target's hold was made with."""

    target_settings_fingerprint: str
    changed: tuple[str, ...]
    #: ``held`` or ``replanned``.
    plan: str
    #: ``taken``, ``released`` or ``unused``.
    stream: str


@dataclass(frozen=True, kw_only=True)
class Decision:
    """``hybrid_draft.decision``: every model load's one decision."""

    role: str | None
    mode: str | None
    mode_source: str | None
    method: str | None
    requested_format: str | None
    chosen_format: str | None
    action: str | None
    reason: str | None
    detail: Opt[str] = ABSENT
    fallback: Opt[str] = ABSENT
    model: str | None = None
    revision: str | None = None
    target_model: Opt[str | None] = ABSENT
    target_revision: Opt[str | None] = ABSENT
    #: ``load``: the model's first load; ``reload``: a reload of its weights in place;
    #: ``weight_update``: a trainer's weight-transfer session; ``direct_update``: a
    #: trainer's direct ``load_weights`` calls on the target.
    trigger: str = "load"
    #: A reload's: where the target's new weights come from (``policy.ReloadSource``).
    reload_source: Opt[str] = ABSENT
    #: A weight-transfer session's: its backend, and the model it loads into (``target``, or
    #: ``draft`` for vLLM's own draft session).
    backend: Opt[str] = ABSENT
    session: Opt[str] = ABSENT
    #: A direct update's: the checkpoint a model loader read it from (AReaL's sync from
    #: disk), and, in its ``loaded`` events, what ended it.
    weights_path: Opt[str] = ABSENT
    ended_by: Opt[str] = ABSENT
    #: A target's.
    one_pass: Opt[OnePass] = ABSENT
    #: A draft's, from here to ``process_group``.
    pruning_rule: Opt[str | None] = ABSENT
    rule_error: Opt[str] = ABSENT
    settings_changed: Opt[SettingsChanged] = ABSENT
    plan_error: Opt[str] = ABSENT
    warnings: Opt[list[dict[str, str]] | None] = ABSENT
    planned_shards: Opt[int] = ABSENT
    planned_tensors: Opt[int] = ABSENT
    planned_bytes: Opt[int] = ABSENT
    tensor_filter: Opt[bool] = ABSENT
    sources: Opt[Sources] = ABSENT
    #: Why a source the draft takes nothing from (``stream``, ``replaced_by_target``) is
    #: empty: a reason code, then ``: `` and the detail.
    sources_detail: Opt[Mapping[str, str]] = ABSENT
    pipeline_parallel_size: Opt[int] = ABSENT
    process_group: Opt[str] = ABSENT
    where: Where = dataclasses.field(metadata={"flatten": Where})


@dataclass(frozen=True, kw_only=True)
class HoldFigures:
    """``one_pass`` of a ``loaded`` event: what a target's stream kept, or a draft took."""

    held_tensors: int
    held_bytes: int
    peak_bytes: int
    budget: int
    held_seconds: float


@dataclass(frozen=True, kw_only=True)
class Cost:
    """What a load cost (``adapter.stats``); null where unknown."""

    seconds: float
    bytes_read: int | None
    #: Tensor bytes received from object storage (None: the load read local files).
    network_bytes: int | None
    #: Requests of the layer's own to object storage that failed transiently and were
    #: retried (None: the load made none).
    retried: int | None
    tensors: int | None
    shards: int | None
    checkpoint_shards: int | None
    checkpoint_bytes: int | None


@dataclass(frozen=True, kw_only=True)
class FailedRead:
    """``failed_read`` of a ``load_failed`` whose error names no file: the shard or object
    the layer found refused when it asked again, and the store's answer."""

    address: str
    answer: str
    #: The HTTP status and the store's error code, where it answered with them.
    status: int | None = None
    code: str | None = None


@dataclass(frozen=True, kw_only=True)
class Loaded:
    """``hybrid_draft.loaded`` (``error_type``/``error`` absent) or ``load_failed``."""

    role: str | None
    model: str | None
    load_format: str | None
    tensor_filter: bool
    trigger: str = "load"
    reload_source: Opt[str] = ABSENT
    backend: Opt[str] = ABSENT
    session: Opt[str] = ABSENT
    weights_path: Opt[str] = ABSENT
    ended_by: Opt[str] = ABSENT
    cost: Cost = dataclasses.field(metadata={"flatten": Cost})
    where: Where = dataclasses.field(metadata={"flatten": Where})
    sources: Opt[Sources] = ABSENT
    one_pass: Opt[HoldFigures] = ABSENT
    #: A weight-transfer session's: the ``update_weights`` calls (chunks) whose tensors the
    #: model took (for a draft fed from its target's session, those that carried any of
    #: its tensors), and the seconds its loads of them took inside those calls.
    chunks: Opt[int] = ABSENT
    chunk_seconds: Opt[float] = ABSENT
    #: A direct update's: the caller's ``load_weights`` calls on the target (for the draft,
    #: those that carried any of its tensors, the caller's own calls on the draft included),
    #: the seconds the model's loads took inside them, and (a draft's) how many of the
    #: calls the caller made on the draft itself.
    calls: Opt[int] = ABSENT
    call_seconds: Opt[float] = ABSENT
    draft_calls: Opt[int] = ABSENT
    #: A load the watcher saw stall: how often, and the longest; and, for a load that ran
    #: longer than ``progress_seconds``, its slowest stretch between two progress events.
    stalls: Opt[int] = ABSENT
    longest_stall_seconds: Opt[float] = ABSENT
    slowest: Opt[Mapping[str, float]] = ABSENT
    #: ``load_failed`` only: ``stalled`` for a load the layer stopped (``load_timeout``).
    reason: Opt[str] = ABSENT
    error_type: Opt[str] = ABSENT
    error: Opt[str] = ABSENT
    failed_read: Opt[FailedRead] = ABSENT
