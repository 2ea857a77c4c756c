"""Reading vLLM's configs into policy inputs, and building the draft's load configs.

vLLM loads a speculative draft along three routes, and each hands ``get_model`` its
configs differently: the V1 ``EagleProposer`` passes ``load_config=``; model runner v2's
``load_eagle_model`` swaps ``vllm_config.load_config``; the standalone ``draft_model``
proposers pass neither (their ``vllm_config.model_config`` is the draft's). The draft is
recognised by identity with ``speculative_config.draft_model_config`` on all three. A
reload in place (a model runner's ``reload_weights``) resolves the same configs, with its
trigger (``policy.Reload``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from hybrid_draft.core import policy

if TYPE_CHECKING:
    from vllm.config import LoadConfig, ModelConfig, SpeculativeConfig, VllmConfig


@dataclasses.dataclass(frozen=True)
class Call:
    """The configs one ``get_model`` call resolves to, as vLLM itself would resolve them."""

    vllm_config: VllmConfig
    model_config: ModelConfig
    load_config: LoadConfig
    speculative_config: SpeculativeConfig | None
    #: What a reload in place reloads from (None: the model's first load).
    trigger: policy.Reload | None = None

    @classmethod
    def resolve(
        cls,
        vllm_config: VllmConfig,
        model_config: ModelConfig | None = None,
        load_config: LoadConfig | None = None,
        trigger: policy.Reload | None = None,
    ) -> Call:
        return cls(
            vllm_config=vllm_config,
            model_config=model_config if model_config is not None else vllm_config.model_config,
            load_config=load_config if load_config is not None else vllm_config.load_config,
            speculative_config=getattr(vllm_config, "speculative_config", None),
            trigger=trigger,
        )

    @property
    def is_draft(self) -> bool:
        spec = self.speculative_config
        draft = getattr(spec, "draft_model_config", None)
        # ngram, suffix and custom proposers alias the target's config: no draft model.
        return (
            draft is not None
            and self.model_config is draft
            and draft is not getattr(spec, "target_model_config", None)
        )

    @property
    def target_model_config(self) -> ModelConfig:
        return getattr(self.speculative_config, "target_model_config", None) or (
            self.vllm_config.model_config
        )

    def reloads_from(self, source: policy.ReloadSource) -> bool:
        """Whether this is a reload in place (or a weight-transfer session) whose new
        weights come from ``source``."""
        return self.trigger is not None and self.trigger.source == source

    def skips_replaced(self, setting: bool) -> bool:
        """Whether the draft's plan leaves out what vLLM replaces with the target's: the
        ``skip_replaced`` ``setting`` at a first load; always at a reload, where those
        parameters are the target's own, which the target's reload has just restored."""
        return self.trigger is not None or setting

    def request(self) -> policy.Request:
        spec = self.speculative_config
        explicit = getattr(spec, "draft_load_config", None)
        role: policy.Role = "draft" if self.is_draft else "target"
        return policy.Request(
            role=role,
            requested_format=str(self.load_config.load_format).lower(),
            method=getattr(spec, "method", None),
            explicit_draft_format=(
                str(explicit.load_format).lower() if explicit is not None else None
            ),
            model=checkpoint_of(self.model_config),
            target=checkpoint_of(self.target_model_config) if role == "draft" else None,
            trigger=self.trigger,
        )


def checkpoint_of(model_config: ModelConfig) -> policy.Checkpoint:
    weights = getattr(model_config, "model_weights", None)
    return policy.Checkpoint(
        model=str(model_config.model),
        revision=model_config.revision,
        aliases=(str(weights),) if weights else (),
    )


def _field_names(load_config: LoadConfig) -> set[str]:
    return {f.name for f in dataclasses.fields(load_config)}


def lazy_load_config(load_config: LoadConfig) -> LoadConfig:
    """A copy that loads with memory-mapped safetensors; the original is never mutated.

    ``enable_multithread_load`` is dropped: vLLM's multi-thread iterator reads whole files,
    which is what a lazy draft load is meant to avoid.
    """
    changes: dict[str, Any] = {"load_format": policy.SAFETENSORS}
    if "safetensors_load_strategy" in _field_names(load_config):
        changes["safetensors_load_strategy"] = "lazy"
    extra = getattr(load_config, "model_loader_extra_config", None)
    if isinstance(extra, dict) and "enable_multithread_load" in extra:
        changes["model_loader_extra_config"] = {
            k: v for k, v in extra.items() if k != "enable_multithread_load"
        }
    return dataclasses.replace(load_config, **changes)


def loader_load_config(load_config: LoadConfig, load_format: str) -> LoadConfig:
    """A lazy copy that routes the draft to one of this layer's registered loaders.

    A Run:ai target's ``model_loader_extra_config`` (``distributed``, ``concurrency``,
    ``memory_limit``) is not one a ``DefaultModelLoader`` takes: it is dropped (the target's
    loader has put the streamer's settings in the environment, where the draft's streamer
    reads them too)."""
    out = dataclasses.replace(lazy_load_config(load_config), load_format=load_format)
    if str(load_config.load_format).lower() == policy.RUNAI_STREAMER:
        out = dataclasses.replace(out, model_loader_extra_config={})
    return out
