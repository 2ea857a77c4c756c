"""What would make a draft load fail or waste reads, and whether selective can run here.

The same findings as ``hybrid-draft plan`` (``planning.warnings``), computed at load time for
a draft that reads the target's own checkpoint: the draft class and its rule as vLLM
resolved them, the shard files vLLM resolves, and their headers only (no tensor data).
They are advice: :func:`draft_warnings` never raises, so a fault here cannot fail a load.
"""

from __future__ import annotations

from hybrid_draft import checkpoint, planning, policy
from hybrid_draft.adapter import calls, drafts, rules


def selective_host_blocker() -> tuple[str, str] | None:
    """Why selective cannot stream on this host, as ``(fallback code, detail)``, or None.

    The host's half of the selective preflight (the checkpoint's half, a rule that keeps
    something, is ``planning.modes``'s), in the preflight's order and words.
    """
    from hybrid_draft.adapter import selective

    for code, problem in (
        ("no_cuda", selective.cuda_unavailable()),
        ("no_tensor_filter", selective.tensor_filter_supported()),
    ):
        if problem:
            return code, problem
    return None


def _safetensors_files(call: calls.Call) -> list[str]:
    """The shard files vLLM resolves for this model, as its default loader does."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    lazy = calls.lazy_load_config(call.load_config)
    _, files, use_safetensors, _ = DefaultModelLoader(lazy)._prepare_weights(
        call.model_config.model, None, call.model_config.revision, False, None
    )
    return list(files) if use_safetensors else []


def draft_warnings(call: calls.Call) -> list[dict[str, str]]:
    """The plan's warnings for this draft (empty unless it reads the target's checkpoint)."""
    try:
        request = call.request()
        if (
            request.role != "draft"
            or request.model is None
            or request.target is None
            or not policy.same_checkpoint(request.model, request.target)
        ):
            return []
        from hybrid_draft.adapter.selective import draft_class

        cls = draft_class(call.model_config)
        hf_config = call.model_config.hf_config
        files = _safetensors_files(call)
        if not files:
            return []
        shards = checkpoint.read_files(sorted(files))
        is_unused = planning.evaluated(shards, rules.probe(cls, hf_config))
        return planning.warnings(shards, cls.__name__, is_unused, drafts.mtp_layers(hf_config))
    except Exception:  # advice only: a fault here must never fail or change a load
        return []
