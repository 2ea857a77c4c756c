"""The text-patch mod ``instanttensor-hybrid-draft-loader`` as a base carries it.

spark-vllm-docker's mod of that name (mods/instanttensor-hybrid-draft-loader:
patch_model_loader.py, run by its run.sh) rewrites vLLM's
``vllm/model_executor/model_loader/__init__.py`` in place: it writes its marker line, then a
helper ``_instanttensor_draft_load_config`` that switches a same-checkpoint draft to lazy
safetensors (INSTANTTENSOR_DRAFT_LOADER = auto | safetensors | instanttensor), and replaces
``get_model``'s body by one that resolves its load config through that helper. :data:`APPLY`
(sh, run in a container of a base) makes the same change, in the same place, with the same
marker: the test-only reproduction of a base the mod was applied to.
"""

from __future__ import annotations

MARKER = "# spark-vllm mod: instanttensor-hybrid-draft-loader v1"
PATCHED = "vllm/model_executor/model_loader/__init__.py"

_PATCH = '''
import ast, importlib.util, sys
from pathlib import Path

MARKER = "@MARKER@"
HELPER = """def _instanttensor_draft_load_config(vllm_config, model_config, load_config):
    \\"\\"\\"The load config for one model: lazy safetensors for a same-checkpoint draft.\\"\\"\\"
    import dataclasses
    import os

    effective = load_config or vllm_config.load_config
    mode = os.environ.get("INSTANTTENSOR_DRAFT_LOADER", "auto").strip().lower()
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    fmt = str(getattr(effective.load_format, "value", effective.load_format)).lower()
    if mode == "instanttensor" or fmt != "instanttensor" or model_config is not draft:
        return effective
    target = getattr(spec, "target_model_config", None) or vllm_config.model_config
    if mode == "auto" and (draft.model, draft.revision) != (target.model, target.revision):
        return effective
    return dataclasses.replace(
        effective, load_format="safetensors", safetensors_load_strategy="lazy"
    )


"""
BODY = """\\
    if model_config is None:
        model_config = vllm_config.model_config
    resolved_load_config = _instanttensor_draft_load_config(
        vllm_config, model_config, load_config
    )
    loader = get_model_loader(resolved_load_config)
    return loader.load_model(
        vllm_config=vllm_config, model_config=model_config, prefix=prefix
    )
"""

(root,) = importlib.util.find_spec("vllm").submodule_search_locations
path = Path(root, "model_executor", "model_loader", "__init__.py")
lines = path.read_text().splitlines(keepends=True)
(fn,) = [n for n in ast.parse("".join(lines)).body
         if isinstance(n, ast.FunctionDef) and n.name == "get_model"]
head = lines[fn.lineno - 1 : fn.body[0].lineno - 1]
patched = (lines[: fn.lineno - 1] + [MARKER + "\\n", HELPER] + head + [BODY]
           + lines[fn.end_lineno :])
path.write_text("".join(patched))
compile(path.read_text(), str(path), "exec")
for cache in path.parent.glob("__pycache__/__init__.*"):
    cache.unlink()
print(path)
'''.replace("@MARKER@", MARKER)

#: sh: apply the mod's change to the vLLM of the container's python3.
APPLY = f"python3 - <<'PY'\n{_PATCH}\nPY\n"
