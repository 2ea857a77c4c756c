"""Pipeline parallelism: only the last stage loads the draft, so its load must never wait
on a collective that the other stages do not join.

vLLM builds the drafter only where ``get_pp_group().is_last_rank`` (both model runners),
so with a pipeline-parallel size above 1 the draft's ``get_model`` runs on part of the
world. vLLM 0.33's ``instanttensor_weights_iterator`` reads with ``process_group=`` the
world group's device group whenever the world has more than one rank, and InstantTensor
then all-reduces and all-gathers over that group: the draft's load would wait for ranks
that never call it. vLLM guards ``fastsafetensors`` that way
(``get_pp_safe_draft_load_config``, model runner v2 only), not InstantTensor.

What each mode's draft does with PP > 1:

- lazy safetensors (``auto`` and ``selective`` on the target's checkpoint, ``safetensors``,
  every selective fallback) and the filtered loader: no collective at all;
- ``instanttensor_selective`` (``selective``): InstantTensor with ``process_group=None``;
- InstantTensor kept (``instanttensor``; ``auto``/``selective`` for a draft with a checkpoint
  of its own): :func:`guard` routes it to the ``instanttensor_ungrouped`` loader, vLLM's
  InstantTensor read with ``process_group=None``; each rank of the last stage reads it.

The target is loaded by every rank, so its grouped read is left as vLLM makes it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from hybrid_draft.adapter import calls, internals
from hybrid_draft.core import policy

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.load import LoadConfig


def pipeline_size(vllm_config: VllmConfig) -> int:
    """The server's pipeline-parallel size: the largest of the call's parallel config, the
    target's (a standalone draft's config says 1) and vLLM's PP group, when initialised."""
    spec = getattr(vllm_config, "speculative_config", None)
    sizes = (
        getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", None),
        getattr(getattr(spec, "target_parallel_config", None), "pipeline_parallel_size", None),
        internals.pp_world_size(),
    )
    return max((s for s in sizes if isinstance(s, int) and not isinstance(s, bool)), default=1)


@dataclasses.dataclass(frozen=True)
class Route:
    """A draft that keeps InstantTensor under PP > 1: how it is read (the decision's
    ``pipeline_parallel_size`` and ``process_group``)."""

    pipeline_parallel_size: int
    process_group: str
    #: The draft's load config from here (None: the call's own, vLLM's grouped read).
    load_config: LoadConfig | None


def route(
    call: calls.Call,
    role: str,
    load_format: str | None,
    load_config: LoadConfig | None,
    ungrouped_off: str | None,
) -> Route | None:
    """With PP > 1, a draft that keeps InstantTensor loads without vLLM's world group
    (None: nothing to route). ``ungrouped_off`` says why the ``ungrouped_draft`` part is
    off (None: it is on), in which case vLLM's grouped read is kept."""
    if role != "draft" or load_format != policy.INSTANTTENSOR:
        return None
    size = pipeline_size(call.vllm_config)
    if size <= 1:
        return None
    if ungrouped_off is not None:  # this vLLM's loader is not one the read knows
        return Route(size, f"vLLM's own (part_skipped: {ungrouped_off})", load_config)
    base = load_config if load_config is not None else call.load_config
    return Route(size, "none", dataclasses.replace(base, load_format=policy.UNGROUPED))
