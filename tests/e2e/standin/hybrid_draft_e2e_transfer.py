"""TEST-ONLY weight-transfer backend for the weight-update tests, registered with vLLM's
``WeightTransferEngineFactory`` as ``hybrid_draft_test`` (:func:`register`).

It is vLLM's own IPC engine (``IPCWeightTransferEngine``: its session's start and finish,
vLLM's layerwise reload of the model the session loads into, the MTP completeness check
off per chunk), but for where a chunk's tensors come from: CUDA IPC handles need CUDA, so
the trainer (the test process) writes each chunk as a safetensors file and names it in the
update info (``{"path": ..., "names": [...]}``: the chunk's tensors in that order). The
engine reads it into tensors of its own, as IPC rebuilds the trainer's, and hands them to
the model's ``load_weights``. With ``refill`` in the init info, each chunk's tensors are
overwritten once ``update_weights`` returns, as a trainer's staging buffer is refilled for
its next chunk. With ``in_place``, it is an engine that patches the model's parameters in
place (as ``sparse_nccl`` does): no layerwise reload, each tensor named by its parameter and
copied into it. ``update_weights`` skips the base class's ``torch.accelerator.synchronize()``,
which needs an accelerator.

Copied into the CPU test environment with the other stand-ins; never in the wheel or an
image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NAME = "hybrid_draft_test"
#: What a refilled buffer holds after its chunk (any value no checkpoint here holds).
REFILL = -3.0


def register() -> None:
    """Register the backend with vLLM (once per process)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(NAME, engine_class())


def engine_class() -> type:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    @dataclass
    class InitInfo(WeightTransferInitInfo):
        refill: bool = False
        in_place: bool = False

    @dataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        path: str
        names: list[str] | None = None

    class FileIPCWeightTransferEngine(IPCWeightTransferEngine):  # type: ignore[misc]
        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        refill = False
        in_place = False

        def init_transfer_engine(self, init_info: Any) -> None:
            self.refill = bool(init_info.refill)
            self.in_place = bool(init_info.in_place)

        def start_weight_update(self) -> None:
            if not self.in_place:
                super().start_weight_update()

        def finish_weight_update(self) -> None:
            if not self.in_place:
                super().finish_weight_update()

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info: Any) -> None:
            import contextlib

            from safetensors.torch import load_file

            try:  # 0.32 and 0.33: per chunk; 0.34: the session's reload says it for all
                from vllm.model_executor.model_loader.mtp_validation import (
                    disable_mtp_completeness_check,
                )
            except ModuleNotFoundError:
                disable_mtp_completeness_check = contextlib.nullcontext

            tensors = load_file(update_info.path, device=str(self.device))
            names = update_info.names or list(tensors)
            weights = [(name, tensors[name]) for name in names]
            if self.in_place:
                params = dict(self.model.named_parameters())
                for name, tensor in weights:
                    params[name].data.copy_(tensor)
                return
            with disable_mtp_completeness_check():
                self.model.load_weights(weights)
            if self.refill:
                for tensor in tensors.values():
                    tensor.fill_(REFILL)

    return FileIPCWeightTransferEngine


def write_chunk(path: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """The trainer's side of one chunk: ``tensors`` written to ``path``; the update info."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return {"path": path, "names": list(tensors)}
