"""TEST-ONLY stand-in for InstantTensor's GPU read, for serving vLLM's CPU build end to end.

vLLM refuses InstantTensor on a platform without CUDA inside
``weight_utils.instanttensor_weights_iterator`` (``current_platform.is_cuda()``), before it
calls ``instanttensor.safe_open``. Copy (or bind-mount) this module and
``hybrid_draft_e2e_standin.pth`` into the site-packages of a TEST environment: in every
Python process started there (vLLM's API server, engine core, workers), the ``.pth`` puts a
post-import finder on ``sys.meta_path`` which, once ``weight_utils`` has executed, replaces
its ``instanttensor_weights_iterator`` (and the name ``default_loader`` binds) by one that
reads the same files as InstantTensor does, every byte of every shard, each tensor a copy
(vLLM's own safetensors iterator, strategy ``eager``), and then drops them from the page
cache, as a checkpoint far larger than memory would not stay there. Nothing else in vLLM, and
nothing of hybrid-draft, is replaced. On a CUDA platform it calls the real iterator.

It never goes into the wheel or an image. Every call is recorded, one JSON line each, in
``$HYBRID_DRAFT_STANDIN_LOG`` when that variable is set: ``{"event": "call", "pid", "files"
(base names, sorted), "model_dir", "local_expert_ids"}``, after one ``{"event":
"installed", "pid"}`` per process that imported ``weight_utils``.

Standard library only at start-up, like any ``.pth`` module must be.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

TARGETS = (
    "vllm.model_executor.model_loader.weight_utils",
    "vllm.model_executor.model_loader.default_loader",
)
NAME = "instanttensor_weights_iterator"
LOG_ENV = "HYBRID_DRAFT_STANDIN_LOG"
_MARK = "_hybrid_draft_e2e_standin"


def record(**fields: Any) -> None:
    """Append one JSON line to the log (one write with O_APPEND: whole lines across processes)."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    data = (json.dumps({**fields, "pid": os.getpid()}) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _leaving_cold(files: list[str], weights: Any) -> Any:
    """Yield ``weights``, then drop the shards' pages from the page cache: a checkpoint of
    hundreds of GB does not stay cached behind its streaming read, so a later load reads
    from storage whatever it reads, and its ``bytes_read`` shows it."""
    yield from weights
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_standin(weight_utils: Any) -> Any:
    real = getattr(weight_utils, NAME)

    def instanttensor_weights_iterator(
        hf_weights_files: list[str],
        use_tqdm_on_load: bool,
        local_expert_ids: set[int] | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        from vllm.platforms import current_platform

        if current_platform.is_cuda():  # a real GPU: nothing to stand in for
            return real(hf_weights_files, use_tqdm_on_load, local_expert_ids, *args, **kwargs)
        files = list(hf_weights_files)
        record(
            event="call",
            files=sorted(os.path.basename(f) for f in files),
            model_dir=os.path.dirname(os.path.abspath(files[0])) if files else None,
            local_expert_ids=sorted(local_expert_ids) if local_expert_ids else None,
        )
        # As InstantTensor does: every byte of every shard read, every tensor a copy.
        return _leaving_cold(
            files,
            weight_utils.safetensors_weights_iterator(
                files, use_tqdm_on_load, "eager", local_expert_ids
            ),
        )

    instanttensor_weights_iterator.__wrapped__ = real  # type: ignore[attr-defined]
    setattr(instanttensor_weights_iterator, _MARK, True)
    return instanttensor_weights_iterator


def patch(fullname: str, module: Any) -> None:
    weight_utils = sys.modules.get(TARGETS[0])
    if weight_utils is None or not hasattr(module, NAME):
        return
    current = getattr(weight_utils, NAME)
    if not getattr(current, _MARK, False):
        current = make_standin(weight_utils)
        weight_utils.instanttensor_weights_iterator = current
        record(event="installed")
    setattr(module, NAME, current)


class StandinFinder:
    """Finds nothing itself: runs :func:`patch` after a target module has executed."""

    _hybrid_draft_e2e_standin = True

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> Any:
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if getattr(finder, _MARK, False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_patch(module: Any) -> None:
            exec_module(module)
            patch(fullname, module)

        loader.exec_module = exec_then_patch  # type: ignore[union-attr]
        return spec


if not any(getattr(f, _MARK, False) for f in sys.meta_path):
    sys.meta_path.insert(0, StandinFinder())
