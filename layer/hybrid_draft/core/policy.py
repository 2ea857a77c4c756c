"""The loader policy: what one ``get_model`` call should load with. Pure: no vLLM import.

Inputs are plain values the adapter reads off vLLM's configs; the output is a
:class:`Decision` whose ``reason`` is one of the stable codes in docs/contract.md. The rules, in
the order they apply:

1. the target model is never touched (``target_model``);
2. a load whose format is not one the layer handles (:data:`TARGET_FORMATS`: InstantTensor,
   fastsafetensors, Run:ai Model Streamer, less those the ``formats`` setting keeps untouched)
   is left alone: ``explicit_draft_loader`` when it is the user's own ``draft_load_config``,
   ``no_tensor_filter`` when the format's installed library cannot filter by tensor name,
   ``not_instanttensor`` otherwise;
3. mode ``instanttensor`` keeps InstantTensor (``mode_instanttensor``);
4. mode ``safetensors`` switches every such draft, standalone ones too (``forced_safetensors``);
5. modes ``auto`` and ``selective`` switch only a draft that reads the target's own
   checkpoint (``same_checkpoint`` / ``selective``), else keep it (``different_checkpoint``).

A draft of a fastsafetensors or Run:ai target is switched to its target's own loader family
(``chosen_format`` is the family: the adapter reads it filtered by the plan); mode
``selective`` asks for InstantTensor's tensor filter, which for these families is the
family's own filter, so it decides as ``auto``.

A selective decision the adapter cannot carry out becomes ``selective_fallback`` (lazy
safetensors) through :func:`fall_back`.

A reload of weights already loaded (:class:`Reload`, the trigger of a model runner's
``reload_weights``) is decided by the same rules, with the trigger as data: a draft whose
target reloads is reloaded as it was loaded, unless the reload gives it nothing to read
(:data:`NOT_RELOADED`: its reason says why, and the draft keeps its weights): the
``reload`` setting is off, the target reloads from weights already in kernel format, or a
draft with a checkpoint of its own sees its target reload from a new checkpoint or stream.
A draft that reads its target's checkpoint takes its tensors from a reload's weights
iterator (``reload_stream``).

A trainer's weight-transfer session (``source`` ``weight_update``: vLLM's
``start_weight_update`` ... ``finish_weight_update``) is a reload like the others, with the
backend and the session's kind as data: a target session gives a draft that reads the
target's checkpoint the draft's own tensors as they pass (``weight_update``); vLLM's own draft
session (``start_draft_weight_update``) loads the draft itself and is left to vLLM
(``draft_session``); a session whose engine patches the target's parameters in place brings
nothing in checkpoint format (``kernel_format``).

A trainer's direct ``load_weights`` calls on the served target (``source`` ``direct``: verl,
OpenRLHF, AReaL, skyrl-train, TRL, NeMo RL) are one more such update: the draft takes its own
tensors as the calls pass them (``direct_update``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Literal

from hybrid_draft.core import figures

INSTANTTENSOR = "instanttensor"
SAFETENSORS = "safetensors"
#: The load format of the registered selective loader (InstantTensor with a tensor filter).
SELECTIVE_FORMAT = "instanttensor_selective"
FASTSAFETENSORS = "fastsafetensors"
RUNAI_STREAMER = "runai_streamer"

#: The target load formats whose drafts the layer reads filtered, in the target's own loader
#: family. The ``formats`` setting may keep any of them untouched.
TARGET_FORMATS = (INSTANTTENSOR, FASTSAFETENSORS, RUNAI_STREAMER)

#: The load formats the layer's draft loaders are registered under with vLLM.
FILTERED = "safetensors_filtered"
SELECTIVE = SELECTIVE_FORMAT
UNGROUPED = "instanttensor_ungrouped"
FASTSAFETENSORS_FILTERED = "fastsafetensors_filtered"
RUNAI_FILTERED = "runai_streamer_filtered"
#: The layer's loader of a switched draft, by the loader family its decision chose
#: (``Decision.chosen_format``): the target's own family, filtered by the plan.
FILTERED_BY_FAMILY = {
    SAFETENSORS: FILTERED,
    FASTSAFETENSORS: FASTSAFETENSORS_FILTERED,
    RUNAI_STREAMER: RUNAI_FILTERED,
}

#: The ``chosen_format`` of a draft whose reload takes its tensors from the weights iterator
#: the target's reload was given.
WEIGHTS_ITERATOR = "weights_iterator"
#: The ``chosen_format`` of a draft that takes its tensors from its target's weight-transfer
#: session as they pass.
WEIGHT_TRANSFER = "weight_transfer"
#: The ``chosen_format`` of a draft that takes its tensors from a trainer's direct
#: ``load_weights`` calls on its target as they pass.
DIRECT_LOAD = "direct_load"

#: The draft's load format each mode aims for (what the compose smoke test expects).
DRAFT_FORMAT_BY_MODE = {
    "auto": SAFETENSORS,
    "safetensors": SAFETENSORS,
    "instanttensor": INSTANTTENSOR,
    "selective": SELECTIVE_FORMAT,
}

Role = Literal["target", "draft"]
Action = Literal["kept", "switched"]

#: The reasons of a reload's draft decision that reloads nothing: the draft keeps its weights.
NOT_RELOADED = (
    "reload_off",
    "kernel_format",
    "own_checkpoint_kept",
    "no_draft_tensors",
    "incomplete_stream",
    "target_failed",
)

#: Every ``reason`` a decision event can carry. ``layer_error`` is the adapter's: the layer
#: itself failed on a call, which then loads exactly as vLLM would without it.
REASONS = (
    "target_model",
    "not_instanttensor",
    "mode_instanttensor",
    "explicit_draft_loader",
    "different_checkpoint",
    "same_checkpoint",
    "forced_safetensors",
    "selective",
    "selective_fallback",
    "layer_error",
    "no_plan",
    "no_tensor_filter",
    "reload_stream",
    "weight_update",
    "direct_update",
    "draft_session",
    *NOT_RELOADED,
)


@dataclass(frozen=True)
class Checkpoint:
    """Where a model's weights come from: a local directory or a hub id, and a revision.

    ``aliases`` are other names the same weights go by (vLLM's ``model_weights``).
    """

    model: str
    revision: str | None = None
    aliases: tuple[str, ...] = ()

    @property
    def shown(self) -> str:
        """The name the user gave: an object-storage address (``s3://``, ``gs://``,
        ``az://``) the weights are read from, rather than the local folder vLLM copied the
        checkpoint's JSON files into; else the model."""
        return next((a for a in self.aliases if figures.is_object_uri(a)), self.model)


ReloadSource = Literal["checkpoint", "weights_path", "iterator", "weight_update", "direct"]
#: The triggers whose target update hands the draft its tensors as they pass (nothing held):
#: a weight-transfer session, a trainer's direct ``load_weights`` calls.
CARRIED = ("weight_update", "direct")
#: The model a weight-transfer session loads into: the target (``start_weight_update``) or
#: the draft (vLLM's own ``start_draft_weight_update``).
SessionKind = Literal["target", "draft"]


@dataclass(frozen=True)
class Reload:
    """A reload in place of weights already loaded: where the target's new weights come
    from (vLLM's ``reload_weights`` from its checkpoint again, a new ``weights_path`` or a
    weights iterator; a trainer's weight-transfer session, ``weight_update``; or a trainer's
    direct ``load_weights`` calls, ``direct``), and whether they are in checkpoint format. A
    session names its backend and its kind; a direct update the checkpoint a model loader
    read it from (``weights_path``, AReaL's sync from disk) and, once it is over, what ended
    it (``ended_by``)."""

    source: ReloadSource
    checkpoint_format: bool = True
    backend: str | None = None
    session: SessionKind | None = None
    weights_path: str | None = None
    ended_by: str | None = None

    @property
    def kind(self) -> str:
        """The events' ``trigger``: ``reload``, ``weight_update`` or ``direct_update``."""
        return {"weight_update": "weight_update", "direct": "direct_update"}.get(
            self.source, "reload"
        )

    @property
    def carries(self) -> bool:
        """Whether the target's update hands the draft its tensors as they pass."""
        return self.source in CARRIED


@dataclass(frozen=True)
class Request:
    """One ``get_model`` call as the policy sees it."""

    role: Role
    requested_format: str
    method: str | None = None
    explicit_draft_format: str | None = None
    #: The checkpoint this call loads, and (for a draft) the target's.
    model: Checkpoint | None = None
    target: Checkpoint | None = None
    #: What a reload in place reloads from (None: the model's first load).
    trigger: Reload | None = None

    @property
    def reads_target_checkpoint(self) -> bool:
        """A draft that reads its target's own checkpoint (:func:`same_checkpoint`)."""
        return (
            self.model is not None
            and self.target is not None
            and same_checkpoint(self.model, self.target)
        )


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    requested_format: str
    chosen_format: str
    detail: str | None = None
    #: Why a selective decision fell back (a stable code, ``adapter.draftplan.FALLBACKS``).
    fallback: str | None = None

    @property
    def switched(self) -> bool:
        return self.action == "switched"


def _local_identity(model: str) -> str | None:
    """The resolved path of a local checkpoint directory (symlinks, ``..``, trailing ``/``)."""
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        return os.path.realpath(expanded)
    return None


def _identity(model: str, revision: str | None) -> tuple[str, ...]:
    local = _local_identity(model)
    if local is not None:
        # vLLM reads a local directory as it is; a revision does not select anything there.
        return ("dir", local)
    return ("hub", model.strip().strip("/"), revision or "")


def same_checkpoint(draft: Checkpoint, target: Checkpoint) -> bool:
    """Whether the draft reads the target's own checkpoint.

    Compared on identity, not strings: a local directory is the same whichever symlink,
    relative path or trailing slash names it. A draft with no revision reads the target's
    revision, because vLLM builds the MTP draft config with ``revision=None`` even when the
    target is served with ``--revision``.
    """
    revision = draft.revision if draft.revision is not None else target.revision
    mine = _identity(draft.model, revision)
    return any(mine == _identity(name, target.revision) for name in (target.model, *target.aliases))


def decide(
    request: Request,
    mode: str,
    formats: tuple[str, ...] = TARGET_FORMATS,
    unfiltered: tuple[str, ...] = (),
    reload_setting: str = "auto",
) -> Decision:
    """The decision for one call under ``mode`` (one of settings.MODES), for a layer that
    handles the target formats ``formats``; ``unfiltered``: target formats whose installed
    library cannot filter by tensor name (a fastsafetensors before 0.5, a Run:ai Model
    Streamer before 0.17); ``reload_setting``: the ``reload`` setting (settings.RELOADS)."""
    requested = request.requested_format

    def kept(reason: str, detail: str | None = None) -> Decision:
        return Decision("kept", reason, requested, requested, detail)

    def switched(reason: str, chosen: str = SAFETENSORS) -> Decision:
        return Decision("switched", reason, requested, chosen)

    if request.role == "target":
        return kept("target_model")
    trigger = request.trigger
    if trigger is not None:
        if trigger.session == "draft":
            return kept(
                "draft_session",
                f"vLLM's own draft weight update ({trigger.backend}) loads the draft: the "
                "layer leaves it as vLLM runs it",
            )
        if reload_setting == "off":
            return kept("reload_off", "the reload setting is off: the draft keeps its weights")
        if not trigger.checkpoint_format:
            what = (
                f"the {trigger.backend} weight-transfer session patches the target's "
                "parameters in place (kernel format)"
                if trigger.source == "weight_update"
                else "the target reloads weights already in kernel format"
            )
            return kept(
                "kernel_format",
                f"{what}, which hold nothing of the draft's: the draft keeps its weights",
            )
        if not request.reads_target_checkpoint and trigger.source != "checkpoint":
            whence = {
                "weights_path": "a new checkpoint",
                "iterator": "a weights stream",
                "weight_update": "a weight-transfer session",
                "direct": "direct load_weights calls",
            }[trigger.source]
            return kept(
                "own_checkpoint_kept",
                f"the draft has a checkpoint of its own and the target reloads from {whence}: "
                "the draft keeps its weights",
            )
        if trigger.source == "iterator":
            return switched("reload_stream", WEIGHTS_ITERATOR)
        if trigger.source == "weight_update":
            return switched("weight_update", WEIGHT_TRANSFER)
        if trigger.source == "direct":
            return switched("direct_update", DIRECT_LOAD)
    if requested not in formats or requested not in TARGET_FORMATS:
        explicit = request.explicit_draft_format
        if explicit == requested:
            return kept("explicit_draft_loader")
        return kept("no_tensor_filter" if requested in unfiltered else "not_instanttensor")
    if mode == "instanttensor":
        return kept("mode_instanttensor")
    family = SAFETENSORS if requested == INSTANTTENSOR else requested
    if mode == "safetensors":
        return switched("forced_safetensors", family)
    if mode not in ("auto", "selective"):
        raise ValueError(
            f"mode={mode!r}: accepted values are auto, safetensors, instanttensor, selective"
        )
    if (
        request.model is None
        or request.target is None
        or not same_checkpoint(request.model, request.target)
    ):
        return kept("different_checkpoint")
    if mode == "selective" and requested == INSTANTTENSOR:
        return switched("selective", SELECTIVE_FORMAT)
    return switched("same_checkpoint", family)


def handled_formats(keep: tuple[str, ...], available: tuple[str, ...]) -> tuple[str, ...]:
    """The target formats the layer handles: those whose library imports (``available``),
    less those the ``keep_formats`` setting keeps untouched."""
    return tuple(f for f in TARGET_FORMATS if f in available and f not in keep)


def unplanned(decision: Decision, detail: str) -> Decision:
    """A draft of a fastsafetensors or Run:ai target that cannot be read by its plan: left
    to its target's loader, as vLLM loads it (``no_plan``)."""
    return Decision("kept", "no_plan", decision.requested_format, decision.requested_format, detail)


def not_reloaded(decision: Decision, reason: str, detail: str) -> Decision:
    """A draft reload that finds nothing of the draft's to read (``reason``, one of
    :data:`NOT_RELOADED`): the draft keeps its weights."""
    return Decision("kept", reason, decision.requested_format, decision.requested_format, detail)


def fall_back(decision: Decision, code: str, detail: str) -> Decision:
    """A selective decision that cannot stream selectively: lazy safetensors instead."""
    return replace(
        decision,
        reason="selective_fallback",
        chosen_format=SAFETENSORS,
        detail=detail,
        fallback=code,
    )
