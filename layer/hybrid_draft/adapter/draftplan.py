"""Building a :class:`~hybrid_draft.core.planning.DraftPlan` from what vLLM resolves.

At load time (:func:`for_call`): the shards vLLM's own loader of the draft's format resolves
for its model and revision (``DefaultModelLoader``'s, downloading from the hub as vLLM
would; the Run:ai loader's for a Run:ai draft, a local directory or object storage), each
header read once (an object's by ranged requests: ``objectstore``), the class vLLM's
registry builds, its checkpoint-weight rule probed with the config the built class holds
(``rules.probe_for``), what vLLM will replace once it is loaded (``sharing.expected``) and
whether selective streaming can run on this host. The
same from a model directory, for ``hybrid-draft plan``, is
``hybrid_draft.tools.draftinfo.for_model_dir``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybrid_draft.adapter import calls, drafts, internals, parts, rules, selective, sharing
from hybrid_draft.core import checkpoint, figures, objectstore, policy
from hybrid_draft.core.planning import DraftPlan

if TYPE_CHECKING:
    import torch


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


def shards(call: calls.Call, access: objectstore.Access | None = None) -> list[checkpoint.Shard]:
    """The draft's shards as its loader resolves them, each header read once (an object's
    within ``access``, keeping the version it was read from)."""
    if str(call.load_config.load_format).lower() != policy.RUNAI_STREAMER:
        return checkpoint.read_files(weight_files(call))
    off = parts.part_off("runai_stream")
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
    call: calls.Call, skip_replaced: bool = True, access: objectstore.Access | None = None
) -> DraftPlan | None:
    """The plan of the draft this call loads (None: it has no safetensors shards);
    ``skip_replaced`` false plans the tensors vLLM replaces as read like the rest; ``access``
    bounds the requests of a plan from object storage."""
    found = tuple(shards(call, access))
    if not found:
        return None
    cls = drafts.draft_class(call.model_config)
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
            drafts.is_mtp(str(architectures[0])),
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
        mtp_layers=drafts.mtp_layers(call.model_config.hf_config),
        host_blocker=selective.host_blocker(device_of(call)),
    )
