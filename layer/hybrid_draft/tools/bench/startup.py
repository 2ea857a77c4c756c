"""The layer's start-up cost: what its ``.pth`` adds to every interpreter, and what its hook
adds to importing vLLM's model loader.

``.pth`` cost: the same interpreter runs ``site.main()`` under ``-S`` twice over, once as is
and once skipping ``hybrid_draft.pth``; the two commands differ in nothing else, runs
alternate, and the medians are compared (``python -c pass`` itself is timed for scale).
Hook cost: in fresh processes with the layer disabled, vLLM's model loader is imported and
the hook (``hybrid_draft.adapter.on_model_loader``) is then run by hand and timed, garbage
collection included (what its allocations set off inside vLLM's import is its cost). Then
what the process's first load pays that the hook left for it: the load path, the plan and
the readers imported, the layer's parts installed (``adapter.load.unready``: the probe of
vLLM's private names, the load figures, structlog) and the hook's deferred events written.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any

WITH_PTH = "import site; site.main()"
WITHOUT_PTH = (
    "import site\n"
    "_add = site.addpackage\n"
    "site.addpackage = lambda d, n, k: None if n == 'hybrid_draft.pth' else _add(d, n, k)\n"
    "site.main()"
)
HOOK = (
    "import time, json, sys\n"
    "t0 = time.perf_counter()\n"
    "import vllm.model_executor.model_loader as m\n"
    "t1 = time.perf_counter()\n"
    "from hybrid_draft.adapter.patch import on_model_loader\n"
    "on_model_loader(m)\n"
    "t2 = time.perf_counter()\n"
    "assert getattr(m.get_model, '__hybrid_draft_wrapped__', False), 'hook did not wrap'\n"
    "from hybrid_draft import events\n"
    "from hybrid_draft.adapter import load, drafting, draftplan, model_loader\n"
    "from hybrid_draft.core import readers\n"
    "load.unready()\n"
    "events.flush()\n"
    "t3 = time.perf_counter()\n"
    "print(json.dumps({'import': t1 - t0, 'hook': t2 - t1, 'first_load': t3 - t2}))\n"
)


def _time(cmd: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def _stats(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": len(values),
    }


def pth_cost(runs: int, python: str = sys.executable) -> dict[str, Any]:
    plain, with_pth, without = [], [], []
    for _ in range(runs):
        plain.append(_time([python, "-c", "pass"]))
        with_pth.append(_time([python, "-S", "-c", WITH_PTH]))
        without.append(_time([python, "-S", "-c", WITHOUT_PTH]))
    return {
        "python_c_pass": _stats(plain),
        "site_with_layer": _stats(with_pth),
        "site_without_layer": _stats(without),
        "added_median": statistics.median(with_pth) - statistics.median(without),
    }


def hook_cost(runs: int, python: str = sys.executable) -> dict[str, Any]:
    import json

    env = {**os.environ, "HYBRID_DRAFT_DISABLE": "1"}
    imports, hooks, first = [], [], []
    for _ in range(runs):
        out = subprocess.run(
            [python, "-c", HOOK], check=True, env=env, capture_output=True, text=True
        ).stdout
        last = json.loads(out.strip().splitlines()[-1])
        imports.append(last["import"])
        hooks.append(last["hook"])
        first.append(last["first_load"])
    return {
        "model_loader_import": _stats(imports),
        "hook": _stats(hooks),
        "first_load_setup": _stats(first),
    }


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False
