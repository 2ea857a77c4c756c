"""The layer's settings on every Ray worker vLLM starts, on any node.

vLLM hands the environment to its Ray workers along two routes (``vllm/ray/ray_env.py``
and ``vllm/v1/executor/ray_env_utils.py``, the same in vLLM 0.32 and 0.33):

- ``get_env_vars_to_copy()`` returns *names* (vLLM's registered variables, those starting
  with ``VLLM_``, ``NCCL_``, ``HF_``... or a user's ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY``,
  and ``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY``); the caller copies their driver values. vLLM
  0.33's Ray data-parallel engine actors get them as their ``runtime_env`` and vLLM 0.32's
  ``RayDistributedExecutor`` sets them on its workers, both overriding the node's own.
  ``INSTANTTENSOR_DRAFT_LOADER`` and ``HYBRID_DRAFT_*`` are not among them.
- ``get_driver_env_vars()`` returns the driver's whole environment, which vLLM 0.33's
  ``RayExecutorV2`` applies on each worker with ``setdefault``: the node's own values win.

Neither carries what the driver read from its config *file*: a worker on another node reads
that node's file. So two post-import hooks wrap both functions. Each first puts the
driver's effective settings in ``HYBRID_DRAFT_DRIVER_SETTINGS`` (``settings.py`` says how a
worker uses them); ``get_env_vars_to_copy`` then also names the layer's variables through
its ``additional_vars`` parameter, the one vLLM offers callers, so vLLM's own exclusions
(``exclude_vars``, ``ray_non_carry_over_env_vars.json``) still apply and a user's
``VLLM_RAY_*`` settings are neither read nor changed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, MutableMapping
from types import ModuleType
from typing import Any

from hybrid_draft import settings

#: Every variable the layer reads starts with this, except the mode's.
PREFIX = "HYBRID_DRAFT_"
_WRAPPED = "__hybrid_draft_wrapped__"


def names(environ: MutableMapping[str, str] | None = None) -> set[str]:
    """The layer's variables to copy: the mode's, and every ``HYBRID_DRAFT_*`` set here."""
    env = os.environ if environ is None else environ
    return {n for n in env if n.startswith(PREFIX)} | {settings.ENV_MODE, settings.ENV_DRIVER}


def export(environ: MutableMapping[str, str] | None = None) -> str:
    """Put this process's effective settings in ``HYBRID_DRAFT_DRIVER_SETTINGS`` (an invalid
    configuration as its error, so that workers fail as the driver's own host would); a
    process that itself runs with another host's settings passes those on unchanged."""
    env = os.environ if environ is None else environ
    here = settings.this_node()
    current, error = settings.load_lenient(env, node=here)
    carried = env.get(settings.ENV_DRIVER, "")
    from_elsewhere = current is not None and current.carried_from is not None
    if from_elsewhere or (error is not None and error.source.startswith(settings.ENV_DRIVER)):
        value = carried
    elif current is not None:
        value = current.carry(here)
    else:
        assert error is not None
        value = settings.carry_error(error, here)
    env[settings.ENV_DRIVER] = value
    return value


def _skip(target: str, reason: str) -> None:
    from hybrid_draft.adapter.internals import vllm_version
    from hybrid_draft.events import emit

    emit(
        "hybrid_draft.patch_skipped",
        "warning",
        sink=settings.process_sink(),
        vllm_version=vllm_version(),
        target=target,
        reason=reason,
    )


def _wrap_copy(original: Callable[..., set[str]]) -> Callable[..., set[str]]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_env_vars_to_copy(*args: Any, **kwargs: Any) -> set[str]:
        try:
            bound = signature.bind(*args, **kwargs)
            export()
            extra = set(bound.arguments.get("additional_vars") or ()) | names()
            bound.arguments["additional_vars"] = extra
            args, kwargs = bound.args, bound.kwargs
        except Exception:  # never stop vLLM from starting its workers: copy as it would
            pass
        return original(*args, **kwargs)

    setattr(get_env_vars_to_copy, _WRAPPED, True)
    return get_env_vars_to_copy


def _wrap_driver_env(original: Callable[..., dict[str, str]]) -> Callable[..., dict[str, str]]:
    @functools.wraps(original)
    def get_driver_env_vars(*args: Any, **kwargs: Any) -> dict[str, str]:
        # As above: on any fault, vLLM's own copy, without the driver's file settings.
        with contextlib.suppress(Exception):
            export()
        return original(*args, **kwargs)

    setattr(get_driver_env_vars, _WRAPPED, True)
    return get_driver_env_vars


def on_ray_env(module: ModuleType) -> None:
    """Post-import hook of ``vllm.ray.ray_env``: wrap ``get_env_vars_to_copy`` once."""
    original = getattr(module, "get_env_vars_to_copy", None)
    target = f"{module.__name__}.get_env_vars_to_copy"
    if getattr(original, _WRAPPED, False):
        return
    try:
        params = inspect.signature(original).parameters if callable(original) else {}
    except (TypeError, ValueError):
        params = {}
    if original is None or "additional_vars" not in params:
        _skip(target, "no callable get_env_vars_to_copy(additional_vars=...): settings stay local")
        return
    module.get_env_vars_to_copy = _wrap_copy(original)  # type: ignore[attr-defined]


def on_ray_env_utils(module: ModuleType) -> None:
    """Post-import hook of ``vllm.v1.executor.ray_env_utils``: wrap ``get_driver_env_vars``."""
    original = getattr(module, "get_driver_env_vars", None)
    if getattr(original, _WRAPPED, False):
        return
    if not callable(original):
        _skip(
            f"{module.__name__}.get_driver_env_vars",
            "no callable get_driver_env_vars: the driver's file settings stay local",
        )
        return
    module.get_driver_env_vars = _wrap_driver_env(original)  # type: ignore[attr-defined]
