"""The ``selective`` mode: stream only the draft's tensors to its GPU with InstantTensor.

InstantTensor 0.2.2's ``safe_open(..., tensor_filter=[names], tensor_name_match_mode="exact",
process_group=None)`` skips unselected tensors before any I/O. The names come from the shard
headers filtered by the draft class's checkpoint-weight rule (vLLM's or ours). The loader is
registered with vLLM's own ``register_model_loader`` under ``instanttensor_selective`` and
reuses ``DefaultModelLoader`` for everything but the weights iterator, so vLLM's checks
(missing weights, expert-parallel filtering, quantization) apply unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Generator, Iterable
from typing import Any

import torch

from hybrid_draft import checkpoint, policy
from hybrid_draft.adapter import configs, rules

_REGISTERED = False


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a selective draft load streams: per shard, the tensor names it keeps."""

    files: dict[str, list[str]]
    nbytes: int

    @property
    def names(self) -> list[str]:
        return [n for names in self.files.values() for n in names]

    def summary(self) -> dict[str, int]:
        return {"planned_shards": len(self.files), "planned_tensors": len(self.names),
                "planned_bytes": self.nbytes}


def make_plan(files: Iterable[str], is_unused: Any) -> Plan:
    """The tensors ``is_unused`` keeps, per shard in file order, from the shard headers."""
    keep: dict[str, list[str]] = {}
    nbytes = 0
    for shard in checkpoint.read_files(sorted(files)):
        for t in shard.tensors:
            if not is_unused(t.name):
                keep.setdefault(str(shard.path), []).append(t.name)
                nbytes += t.nbytes
    return Plan(keep, nbytes)


def tensor_filter_supported() -> str | None:
    """None when the installed InstantTensor can filter tensors, else why not."""
    try:
        import instanttensor
    except ImportError:
        return "instanttensor is not installed"
    try:
        params = inspect.signature(instanttensor.safe_open).parameters
    except (TypeError, ValueError):
        params = {}
    if "tensor_filter" not in params or "tensor_name_match_mode" not in params:
        version = getattr(instanttensor, "__version__", "installed")
        return f"instanttensor {version} has no tensor_filter (0.2.2 or later has)"
    return None


def cuda_unavailable(call: configs.Call) -> str | None:
    """None when the draft loads onto a CUDA device, else why not."""
    from vllm.platforms import current_platform

    device = call.load_config.device or call.vllm_config.device_config.device
    if not current_platform.is_cuda() or not torch.cuda.is_available():
        return f"CUDA is not available (vLLM platform: {current_platform.device_type})"
    if torch.device(device).type != "cuda":
        return f"the draft loads onto {device}, not a CUDA device"
    return None


def draft_class(model_config: Any) -> type:
    from vllm.model_executor.model_loader.utils import get_model_architecture

    return get_model_architecture(model_config)[0]


def preflight(call: configs.Call) -> tuple[str | None, Plan | None]:
    """Whether a selective draft load can run here: (why not, None) or (None, its plan).

    The plan comes first (a rule and the shard headers): it holds on any host, so a draft
    that would plan nothing says so even where CUDA is missing.
    """
    cls = draft_class(call.model_config)
    rules.install(cls)
    # vLLM builds an MTP draft with the target's model config: probe with the config the
    # built class would hold, not only the draft's rewritten one.
    is_unused = rules.probe_for(cls, call.vllm_config.model_config.hf_config,
                                call.model_config.hf_config)
    if is_unused is None:
        return f"{cls.__name__} has no checkpoint-weight rule to plan its tensors with", None
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    lazy = configs.lazy_load_config(call.load_config)
    _, files, use_safetensors, _ = DefaultModelLoader(lazy)._prepare_weights(
        call.model_config.model, None, call.model_config.revision, False, None)
    if not use_safetensors:
        return "the checkpoint has no safetensors shards", None
    plan = make_plan(files, is_unused)
    if not plan.files:
        return f"the {cls.__name__} rule keeps none of the checkpoint's tensors", None
    for check in (cuda_unavailable(call), tensor_filter_supported()):
        if check:
            return check, None
    return None, plan


def instanttensor_selective_iterator(
    files: list[str], names: list[str], device: torch.device, use_tqdm_on_load: bool = True,
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Stream exactly ``names`` from ``files`` to ``device`` with InstantTensor.

    ``process_group=None``: every rank reads its own copy of the (small) draft, which the
    tensor filter requires; ``copy=True`` keeps tensors valid after the buffer is reused.
    """
    import instanttensor
    from tqdm.auto import tqdm
    from vllm.model_executor.model_loader.weight_utils import enable_tqdm

    with (
        instanttensor.safe_open(
            list(files), framework="pt", device=device, process_group=None, copy=True,
            tensor_filter=list(names), tensor_name_match_mode="exact",
        ) as f,
        tqdm(total=getattr(f, "total_tensor_size", None), unit="B", unit_scale=True,
             unit_divisor=1024, mininterval=1.0, disable=not enable_tqdm(use_tqdm_on_load),
             desc="Loading the draft's tensors using InstantTensor (selective)") as bar,
    ):
        for name, tensor in f.tensors():
            bar.update(tensor.numel() * tensor.element_size())
            yield name, tensor


def _loader_class() -> type:
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight

    class SelectiveInstantTensorLoader(DefaultModelLoader):
        """``DefaultModelLoader`` whose primary weights come from the selective iterator."""

        def __init__(self, load_config: Any) -> None:
            # The base class resolves files as for safetensors; only the iterator differs.
            super().__init__(configs.lazy_load_config(load_config))
            self.selective_load_config = load_config

        def _device(self) -> torch.device:
            device = torch.device(self.load_config.device
                                  or get_current_vllm_config().device_config.device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            return device

        def get_all_weights(
            self, model_config: Any, model: torch.nn.Module
        ) -> Generator[tuple[str, torch.Tensor], None, None]:
            self.counter_before_loading_weights = time.perf_counter()
            is_unused = getattr(model, "is_unused_checkpoint_weight", None)
            if is_unused is None:
                raise RuntimeError(f"{type(model).__name__} has no checkpoint-weight rule; "
                                   "hybrid-draft sends only drafts with one to this loader")
            _, files, _, _ = self._prepare_weights(
                model_config.model, None, model_config.revision, False,
                getattr(model, "allow_patterns_overrides", None))
            local = self.local_expert_ids
            plan = make_plan(files, lambda n: is_unused(n) or should_skip_weight(n, local))
            if not plan.files:
                raise RuntimeError(f"the {type(model).__name__} rule keeps none of the "
                                   f"tensors in {model_config.model}")
            yield from instanttensor_selective_iterator(
                list(plan.files), plan.names, self._device(), self.load_config.use_tqdm_on_load)
            for source in getattr(model, "secondary_weights", ()):
                yield from self._get_weights_iterator(source)

    return SelectiveInstantTensorLoader


def register() -> None:
    """Register the loader with vLLM once per process (on the first selective draft)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(policy.SELECTIVE_FORMAT)(_loader_class())
    _REGISTERED = True
