"""The package's layout is its architecture: imports flow one way.

Layers, lowest first: the package root and its file reader; settings; events; the core
(``core/``: policy, checkpoint headers, planning, the draft's readers, the hold and the load
figures, no vLLM import); the vLLM adapter and the bootstrap that hooks it in; the tools. A
module imports only from its own layer or below (anywhere in it, at module level or inside a
function), so the runtime never imports a tool, the core never imports the adapter, and
nothing imports the bootstrap. Within a layer (``adapter/`` and ``core/`` included) no
module imports another that imports it back, by any chain.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "layer" / "hybrid_draft"

#: Layer of each module (by dotted name prefix; the longest prefix wins).
LAYERS = {
    "hybrid_draft": 0,
    "hybrid_draft.files": 0,
    "hybrid_draft.records": 0,
    "hybrid_draft.settings": 1,
    "hybrid_draft.events": 2,
    "hybrid_draft.core": 3,
    "hybrid_draft.adapter": 4,
    "hybrid_draft._bootstrap": 4,
    "hybrid_draft.tools": 5,
    "hybrid_draft.__main__": 5,
}


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append((name, path))
    return out


def imports(name: str, path: Path) -> set[str]:
    """Every hybrid_draft module ``path`` imports (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    known = {m for m, _ in modules()}
    return {m for m in found if m in known}


@pytest.mark.parametrize(("name", "path"), modules(), ids=lambda v: str(v))
def test_imports_flow_one_way(name: str, path: Path) -> None:
    upward = sorted(m for m in imports(name, path) if layer(m) > layer(name))
    assert not upward, f"{name} (layer {layer(name)}) imports {upward}"
    assert "hybrid_draft._bootstrap" not in imports(name, path) or name.startswith(
        "hybrid_draft.tools"
    ), f"{name} imports the bootstrap"


def test_every_module_has_a_layer() -> None:
    assert {layer(m) for m, _ in modules()} == set(range(6))


def test_no_module_imports_itself_back() -> None:
    """No import cycle anywhere in the package, ``adapter/`` included, counting the
    imports inside functions: each module can be read knowing only what is below it."""
    graph = {name: imports(name, path) - {name} for name, path in modules()}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        cycle = " -> ".join(reversed(exc.args[1]))
        raise AssertionError(f"an import cycle: {cycle}") from None


def test_the_design_map_names_every_runtime_module() -> None:
    """docs/design.md's map of the package lists every module of the runtime (all but
    ``tools/`` and ``__main__``), each under its folder: a module added to the runtime is
    added to the map."""
    text = (PACKAGE.parents[1] / "docs" / "design.md").read_text()
    block = text.split("## Architecture", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    named: set[str] = set()
    folders: list[tuple[int, str]] = []  # the folders enclosing the current line, by indent
    for line in block.splitlines():
        entry = line.strip().split(" ", 1)[0]
        if line.startswith("layer/") or not entry.endswith(("/", ".py")):
            continue
        indent = len(line) - len(line.lstrip(" "))
        while folders and folders[-1][0] >= indent:
            folders.pop()
        if entry.endswith("/"):
            folders.append((indent, entry))
        else:
            named.add("".join(f for _, f in folders) + entry)
    relative = [path.relative_to(PACKAGE) for _, path in modules()]
    runtime = {
        str(rel)
        for rel in relative
        if rel.parts[0] != "tools" and rel.name not in ("__init__.py", "__main__.py")
    }
    assert runtime - named == set()
