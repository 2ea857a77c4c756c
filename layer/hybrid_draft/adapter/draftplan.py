"""The draft's plan from what vLLM resolves at load time: its shards, its class, its rule,
what vLLM replaces, and whether ``selective`` can stream it on this host.

At load time (:func:`for_call`): the shards vLLM's own loader of the draft's format resolves
for its model and revision (``DefaultModelLoader``'s, downloading from the hub as vLLM
would; the Run:ai loader's for a Run:ai draft, a local directory or object storage), each
header read once (an object's by ranged requests: ``objectstore``), the class vLLM's
registry builds (:func:`draft_class`; :func:`is_mtp`: read from the target's own checkpoint),
its checkpoint-weight rule probed with the config the built class holds
(``rules.probe_for``), what vLLM will replace once it is loaded (``sharing.expected``) and
whether selective streaming can run on this host (:func:`host_blocker`). The same from a
model directory, for ``hybrid-draft plan``, is ``hybrid_draft.tools.draftinfo.for_model_dir``.

``selective`` streams a draft with the ``instanttensor_selective`` loader: InstantTensor
0.2.2's ``safe_open(..., tensor_filter=[names], tensor_name_match_mode="exact")`` skips
unselected tensors before any I/O. That needs a checkpoint-weight rule (to plan the names),
safetensors shards, a plan that keeps something, a CUDA device and an InstantTensor with
``tensor_filter``. When one is missing the draft falls back to the filtered lazy path, and
the decision says why: a stable ``fallback`` code and a ``detail``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from hybrid_draft.adapter import calls, internals, rules, sharing
from hybrid_draft.core import checkpoint, figures, objectstore, policy
from hybrid_draft.core.planning import DraftPlan

if TYPE_CHECKING:
    from vllm.config import ModelConfig


# --- the draft's class -------------------------------------------------------------------


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


# --- whether selective can stream here -----------------------------------------------------


#: ``fallback`` codes of a ``selective_fallback`` decision.
FALLBACKS = (
    "no_rule",
    "no_safetensors",
    "empty_plan",
    "no_cuda",
    "no_tensor_filter",
    "planning_failed",
    "part_skipped",
)

Blocker = tuple[str, str]  # (fallback code, detail)


def tensor_filter_supported() -> str | None:
    """None when the installed InstantTensor can filter tensors, else why not."""
    try:
        import instanttensor
    except Exception as exc:  # its CUDA extension may fail to load, not only be missing
        return f"instanttensor does not import: {exc!r}"
    try:
        params: Mapping[str, Any] = inspect.signature(instanttensor.safe_open).parameters
    except (TypeError, ValueError):
        params = {}
    if "tensor_filter" not in params or "tensor_name_match_mode" not in params:
        version = getattr(instanttensor, "__version__", "installed")
        return f"instanttensor {version} has no tensor_filter (0.2.2 or later has)"
    return None


def cuda_unavailable(device: Any = None) -> str | None:
    """None when vLLM runs on CUDA and ``device`` (default: CUDA) is a CUDA device."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda() or not torch.cuda.is_available():
        platform = current_platform.device_type or "none detected"
        return f"CUDA is not available (vLLM platform: {platform})"
    if device is not None and torch.device(device).type != "cuda":
        return f"the draft loads onto {device}, not a CUDA device"
    return None


def host_blocker(device: Any = None) -> Blocker | None:
    """Why selective cannot stream on this host, as ``(fallback code, detail)``, or None:
    the host's half of the selective preflight (the checkpoint's half is the plan's)."""
    for code, problem in (
        ("no_cuda", cuda_unavailable(device)),
        ("no_tensor_filter", tensor_filter_supported()),
    ):
        if problem:
            return code, problem
    return None


# --- the plan ------------------------------------------------------------------------------


def weight_files(call: calls.Call) -> list[str]:
    """The safetensors shards vLLM resolves for this model ([] when it has none)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    lazy = calls.lazy_load_config(call.load_config)
    _, files, use_safetensors, _ = internals.prepare_weights(
        DefaultModelLoader(lazy),
        call.model_config.model,
        None,
        call.model_config.revision,
        False,
        None,
    )
    return sorted(files) if use_safetensors else []


def shards(
    call: calls.Call, access: objectstore.Access | None = None, runai_off: str | None = None
) -> list[checkpoint.Shard]:
    """The draft's shards as its loader resolves them, each header read once (an object's
    within ``access``, keeping the version it was read from); ``runai_off``: why the
    ``runai_stream`` part is off (a Run:ai draft is then not planned)."""
    if str(call.load_config.load_format).lower() != policy.RUNAI_STREAMER:
        return checkpoint.read_files(weight_files(call))
    off = runai_off
    if off is not None:
        raise internals.Unsupported(f"the runai_stream part is off: {off}")
    config = call.model_config
    source = str(getattr(config, "model_weights", "") or config.model)
    files = sorted(internals.runai_weight_files(call.load_config, source, config.revision))
    if any(map(figures.is_object_uri, files)):
        return objectstore.read_shards(files, access)
    return checkpoint.read_files(files)


def device_of(call: calls.Call) -> str | torch.device | None:
    return call.load_config.device or call.vllm_config.device_config.device


def for_call(
    call: calls.Call,
    skip_replaced: bool = True,
    access: objectstore.Access | None = None,
    runai_off: str | None = None,
) -> DraftPlan | None:
    """The plan of the draft this call loads (None: it has no safetensors shards);
    ``skip_replaced`` false plans the tensors vLLM replaces as read like the rest; ``access``
    bounds the requests of a plan from object storage; ``runai_off``: why the
    ``runai_stream`` part is off, if it is (the caller asks ``parts``)."""
    found = tuple(shards(call, access, runai_off))
    if not found:
        return None
    cls = draft_class(call.model_config)
    source = rules.install(cls)
    rule = rules.probe_for(
        cls, call.vllm_config.model_config.hf_config, call.model_config.hf_config
    )
    spec = call.speculative_config
    architectures = getattr(call.model_config.hf_config, "architectures", None) or [""]
    shared = (
        sharing.expected(
            cls,
            call.vllm_config.parallel_config.pipeline_parallel_size,
            getattr(spec, "method", None),
            is_mtp(str(architectures[0])),
        )
        if skip_replaced
        else frozenset()
    )
    return DraftPlan(
        shards=found,
        draft_class=cls.__name__,
        rule_source=source,
        rule=rule,
        vllm_rule=rule if source == "vllm" else None,
        shared=shared,
        mtp_layers=mtp_layers(call.model_config.hf_config),
        host_blocker=host_blocker(device_of(call)),
    )
