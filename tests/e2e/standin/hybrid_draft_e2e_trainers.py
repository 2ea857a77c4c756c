"""TEST-ONLY: how each RL framework syncs a training step into vLLM's served target, its calls
as the framework's own source makes them (the newest release of each on the package index,
read 2026-12-06; NeMo RL as its issue #2999 and its ``vllm_backend`` describe it), each
reaching the worker's model runner as a worker extension does (``self.model_runner``).

- **verl 0.9.1** (``verl/workers/rollout/vllm_rollout/utils.py``,
  ``vLLMColocateWorkerExtension``): per bucket, ``model.load_weights(bucket)`` for each model
  of ``_iter_all_models()`` (the target, and ``model_runner.drafter.model`` where the
  speculative method is ``mtp`` and a ``drafter`` exists), then
  ``process_weights_after_loading(model, model_config, device)`` once per model;
- **OpenRLHF 0.11.2** (``openrlhf/trainer/ray/vllm_worker_wrap.py``):
  ``model_runner.model.load_weights(weights=[(name, weight)])``, one tensor per call;
- **AReaL 1.0.4** (``areal/engine/vllm_ext/vllm_worker_extension.py``): over NCCL one tensor
  per call as OpenRLHF; from disk ``model_runner.model_config.model = path``, then
  ``get_model_loader(load_config).load_weights(model_runner.model, model_config=...)``;
- **skyrl 0.3.0** (``backends/skyrl_train/inference_servers``):
  ``model.load_weights(weights=bucket)``, then ``drafter.model.load_weights(iter(bucket))``
  where a ``drafter`` exists;
- **TRL 1.16.0** (``trl/generation/vllm_generation.py``, colocate mode):
  ``model_runner.model.load_weights([(name, param)])`` per tensor;
- **NeMo RL**: per chunk the target's ``load_weights``, then ``drafter.model.load_weights``.

None of them signals an end but verl (its post-load processing): the others' next
generation is the end. Never in the wheel or an image.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

Tensors = Mapping[str, Any]
Bucket = list[tuple[str, Any]]


def buckets(tensors: Tensors, *after: str) -> list[Bucket]:
    """``tensors`` in order, cut into buckets right after each name of ``after``."""
    out: list[Bucket] = [[]]
    for name, tensor in tensors.items():
        out[-1].append((name, tensor))
        if name in after:
            out.append([])
    return [b for b in out if b]


def _drafter_model(runner: Any) -> Any:
    drafter = getattr(runner, "drafter", None)
    return drafter.model if drafter is not None and hasattr(drafter, "model") else None


def verl(runner: Any, parts: Iterable[Bucket]) -> None:
    """verl's ``update_weights_from_ipc``, unquantized, without LoRA."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    spec = runner.vllm_config.speculative_config
    models = [(runner.model, runner.vllm_config.model_config)]
    drafter = _drafter_model(runner)
    if spec is not None and spec.method == "mtp" and drafter is not None:
        models.append((drafter, spec.draft_model_config))
    with set_current_vllm_config(runner.vllm_config):
        for bucket in parts:
            for model, _ in models:
                model.load_weights(bucket)
        for model, config in models:
            process_weights_after_loading(model, config, runner.device)


def openrlhf(runner: Any, tensors: Tensors) -> None:
    """OpenRLHF's ``WorkerWrap.update_weight``: one tensor per call (AReaL over NCCL too)."""
    for name, weight in tensors.items():
        runner.model.load_weights(weights=[(name, weight)])


def areal_disk(runner: Any, path: str) -> None:
    """AReaL's ``areal_update_weights``: a model loader's ``load_weights`` from ``path``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    runner.model_config.model = path
    loader = get_model_loader(runner.vllm_config.load_config)
    with set_current_vllm_config(runner.vllm_config):
        loader.load_weights(runner.model, model_config=runner.model_config)


def skyrl(runner: Any, parts: Iterable[Bucket]) -> None:
    """skyrl's IPC update: the target's bucket, then the drafter's from the same list."""
    for bucket in parts:
        runner.model.load_weights(weights=bucket)
        drafter = _drafter_model(runner)
        if drafter is not None:
            drafter.load_weights(iter(bucket))


def trl(runner: Any, tensors: Tensors) -> None:
    """TRL's colocated ``_sync_fsdp_params_to_vllm``: one tensor per call, positional."""
    for name, param in tensors.items():
        runner.model.load_weights([(name, param)])


def nemo_rl(runner: Any, parts: Iterable[Bucket]) -> None:
    """NeMo RL's refit: per chunk, the target's ``load_weights`` then the drafter's."""
    for bucket in parts:
        runner.model.load_weights(weights=bucket)
        drafter = _drafter_model(runner)
        if drafter is not None:
            drafter.load_weights(weights=bucket)


#: Each framework's sync of a whole step given as one mapping of tensors (the bucketed ones
#: one bucket per checkpoint shard's worth: ``split`` cuts where a test asks).
SYNCS: dict[str, Callable[[Any, Tensors, list[str]], None]] = {
    "verl": lambda runner, tensors, cut: verl(runner, buckets(tensors, *cut)),
    "openrlhf": lambda runner, tensors, cut: openrlhf(runner, tensors),
    "skyrl": lambda runner, tensors, cut: skyrl(runner, buckets(tensors, *cut)),
    "trl": lambda runner, tensors, cut: trl(runner, tensors),
    "nemo_rl": lambda runner, tensors, cut: nemo_rl(runner, buckets(tensors, *cut)),
}
