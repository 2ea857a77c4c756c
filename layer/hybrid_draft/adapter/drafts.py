"""Which draft class vLLM builds for a load, and what kind of draft it is: the runtime's part.

The same for a checkpoint directory, without a load (``hybrid-draft plan``, ``rules``,
``doctor``), is :mod:`hybrid_draft.tools.draftinfo`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid_draft.adapter import internals

if TYPE_CHECKING:
    from vllm.config import ModelConfig


def mtp_layers(config: Any) -> int | None:
    """The MTP layers a draft config declares (vLLM's ``n_predict``), None if it says none."""
    for key in ("n_predict", "num_nextn_predict_layers", "mtp_num_hidden_layers"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


#: Drafts with MTP in their name that load a checkpoint of their own, and what it is.
OWN_CHECKPOINT = {
    "Gemma4MTPModel": "method mtp, but Gemma 4's assistant checkpoint of its own: every "
    "tensor there is the draft's, loaded whole",
    "EagleDeepSeekMTPModel": "an EAGLE head in DeepSeek-MTP form, with a checkpoint of its "
    "own, loaded whole",
}


def is_mtp(architecture: str) -> bool:
    """An MTP draft: one read from the target's own checkpoint."""
    return "MTP" in architecture and architecture not in OWN_CHECKPOINT


def draft_class(model_config: ModelConfig) -> type:
    """The class vLLM builds for ``model_config`` (its registry's resolution)."""
    return internals.model_class(model_config)
