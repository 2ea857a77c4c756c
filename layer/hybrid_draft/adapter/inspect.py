"""Which MTP draft class vLLM builds for a checkpoint, and its weight rule, without loading it.

Follows vLLM's own path: the checkpoint's config through ``get_config``, rewritten by
``SpeculativeConfig.hf_config_override`` (what ``method: mtp`` does), then the draft
architecture through the model registry. No ``ModelConfig`` is built (that inspects the
model class in a subprocess), so ``hybrid-draft plan`` stays well under a second.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

from hybrid_draft.adapter import rules


@dataclass(frozen=True)
class Draft:
    draft_class: str | None
    rule_source: str
    #: The draft's effective rule under hybrid-draft (None: it has none).
    is_unused: Callable[[str], bool] | None
    #: The rule stock vLLM applies (only when the class ships one).
    vllm_rule: Callable[[str], bool] | None


def mtp_draft(model_dir: str) -> Draft:
    from vllm.config.speculative import SpeculativeConfig
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.config import get_config

    config = get_config(model_dir, trust_remote_code=False)
    before = list(getattr(config, "architectures", None) or [])
    target = copy.deepcopy(config)  # the override rewrites the config in place
    config = SpeculativeConfig.hf_config_override(config)
    after = list(getattr(config, "architectures", None) or [])
    if not after or after == before:
        return Draft(None, "none", None, None)
    cls = ModelRegistry._try_load_model_cls(after[0])
    if cls is None:
        return Draft(after[0], "none", None, None)
    source = rules.rule_source(cls)
    if source == "vllm":
        rule = rules.probe(cls, config)
        return Draft(cls.__name__, source, rule, rule)
    if source == "hybrid-draft":
        ours = rules.rule_for(cls)
        assert ours is not None
        return Draft(cls.__name__, source,
                     functools.partial(ours, rules.config_for(cls, target, config)), None)
    return Draft(cls.__name__, source, None, None)

