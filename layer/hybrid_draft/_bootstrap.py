"""Start-up hook: the wheel's ``hybrid_draft.pth`` imports this module in every Python process.

It must cost almost nothing and never fail, so it imports only what the interpreter has
already loaded and does one thing: put a finder at the front of ``sys.meta_path`` that
notices when vLLM's model loader package is imported. After that module has executed, and
before anything else can import ``get_model`` from it, the finder hands the module to
``hybrid_draft.adapter``, which wraps ``get_model`` (likewise for the modules in
:data:`HOOKS` that copy the environment to Ray workers). Processes that never load a model
(pip, the API server's front end, tools) never import vLLM, torch or structlog through us.

Modelled on virtualenv's ``_virtualenv.py`` and wrapt's post-import hooks. Python 3.15+
runs :func:`install` from ``hybrid_draft.start`` (PEP 829) instead of the ``.pth`` line.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing is not imported at start-up; type checkers take this as True
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

#: Modules whose execution triggers a hook, and the hook (``module:function``) to call:
#: the model loader's ``get_model``, the model runners, the worker (a trainer's weight-transfer
#: sessions), and vLLM's two ways of handing the environment to Ray workers
#: (``adapter/ray_env.py``), so the settings reach every node.
HOOKS = {
    "vllm.model_executor.model_loader": "hybrid_draft.adapter.patch:on_model_loader",
    # The model runners' load_model: the scope a one-pass hold lives in; their
    # reload_weights: the draft reloaded with its target.
    "vllm.v1.worker.gpu_model_runner": "hybrid_draft.adapter.runners:on_runner",
    "vllm.v1.worker.cpu_model_runner": "hybrid_draft.adapter.runners:on_runner",
    "vllm.v1.worker.gpu.model_runner": "hybrid_draft.adapter.runners:on_runner",
    # The worker's weight-transfer sessions: the draft updated with its target.
    "vllm.v1.worker.gpu_worker": "hybrid_draft.adapter.workers:on_worker",
    "vllm.ray.ray_env": "hybrid_draft.adapter.ray_env:on_ray_env",
    "vllm.v1.executor.ray_env_utils": "hybrid_draft.adapter.ray_env:on_ray_env_utils",
}

#: Set this variable to a non-empty value other than 0 to keep the layer out of a process.
DISABLE_ENV = "HYBRID_DRAFT_DISABLE"

_MARK = "_hybrid_draft_finder"


def _say_skipped(stage: str, exc: BaseException) -> None:
    """Say on stderr that the layer failed, without ever raising (stdlib JSON fallback)."""
    try:
        from hybrid_draft.events import emit
        from hybrid_draft.settings import process_sink

        emit(
            "hybrid_draft.patch_skipped",
            "warning",
            sink=process_sink(),
            reason=f"{stage}: {exc!r}",
            vllm_version=_vllm_version(),
        )
    except BaseException:  # the interpreter must survive anything here: plain JSON instead
        try:
            import json
            import os
            import time

            line = json.dumps(
                {
                    "event": "hybrid_draft.patch_skipped",
                    "level": "warning",
                    "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "pid": os.getpid(),
                    "reason": f"{stage}: {exc!r}",
                    "vllm_version": _vllm_version(),
                }
            )
            sys.stderr.write(line + "\n")
        except BaseException:  # not even stderr: stay silent rather than break start-up
            pass


def _vllm_version() -> str | None:
    vllm = sys.modules.get("vllm")
    return getattr(vllm, "__version__", None)


def _run_hook(fullname: str, module: object) -> None:
    try:
        target = HOOKS[fullname]
        mod_name, _, func_name = target.partition(":")
        __import__(mod_name)
        getattr(sys.modules[mod_name], func_name)(module)
    except BaseException as exc:  # never break the import of vLLM
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        _say_skipped(f"hook for {fullname}", exc)


class PostImportFinder:
    """A meta-path finder that finds nothing itself; it decorates the real loader's spec."""

    _hybrid_draft_finder = True

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname not in HOOKS:
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
        if exec_module is None or getattr(exec_module, _MARK, False):
            return spec

        def exec_then_hook(module: object) -> None:
            exec_module(module)
            _run_hook(fullname, module)

        exec_then_hook._hybrid_draft_finder = True  # type: ignore[attr-defined]
        try:
            loader.exec_module = exec_then_hook  # type: ignore[union-attr]
        except (AttributeError, TypeError):
            return spec
        return spec


def installed() -> bool:
    """Whether a hybrid-draft finder is on ``sys.meta_path`` in this process."""
    return any(getattr(f, _MARK, False) for f in sys.meta_path)


def install() -> None:
    """Install the finder once (a second call, or a second ``.pth`` pass, does nothing)."""
    try:
        import os

        if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
            return
        if not installed():
            sys.meta_path.insert(0, PostImportFinder())
        for fullname in HOOKS:
            module = sys.modules.get(fullname)
            if module is not None:  # imported before us (e.g. install() called late)
                _run_hook(fullname, module)
    except BaseException as exc:  # a .pth line must never break start-up
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        _say_skipped("install", exc)


install()
