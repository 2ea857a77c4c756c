"""The suite's own marks hold what they claim: a file a further vLLM release skips as the same
on every release (``once``, docs/testing.md) reaches no vLLM code, unless it also says it
loads vLLM (``vllm``: a program's run, a store client's set, each said in the file)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.once

TESTS = Path(__file__).resolve().parent
#: What reaches vLLM from a test file: its import, the suite's vLLM fixtures and helpers, the
#: layer's adapter, and the commands that import vLLM in a process of their own.
REACHES_VLLM = ("vllm", "vllm_runtime", "engine_config", "hybrid_draft.adapter", "doctor")


def _marks(tree: ast.Module) -> set[str]:
    """The marks of a module's ``pytestmark`` (one, or a list)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)} - {"mark"}
    return set()


def _names(tree: ast.Module) -> set[str]:
    """Every module imported, name used and string constant of a test file."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.add(node.value)
    return out


#: Files whose names match but reach no vLLM, and why.
NOT_VLLM = {
    "test_gpu_check.py": "its vllm is a stand-in package that records an import: none may come",
}
ONCE = sorted(
    path
    for path in TESTS.glob("test_*.py")
    if path.name != Path(__file__).name
    and "once" in (marks := _marks(ast.parse(path.read_text())))
    and "vllm" not in marks
)


def test_some_files_are_once() -> None:
    assert len(ONCE) >= 10, ONCE


@pytest.mark.parametrize("path", ONCE, ids=lambda p: p.name)
def test_a_once_file_reaches_no_vllm(path: Path) -> None:
    if path.name in NOT_VLLM:
        pytest.skip(NOT_VLLM[path.name])
    names = _names(ast.parse(path.read_text()))
    reached = sorted(n for n in names if any(n == r or n.startswith(r + ".") for r in REACHES_VLLM))
    assert reached == [], f"{path.name} is marked once but reaches vLLM through {reached}"
