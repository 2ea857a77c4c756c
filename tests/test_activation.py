"""Activation through the installed ``.pth``, in fresh interpreters (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

import hybrid_draft

#: The site-packages the wheel is installed in: this Python's own, or, in an environment
#: scripts/vllm-release layers on it for another vLLM release, the one it adds after its own.
SITE = Path(hybrid_draft.__file__).parents[1]


def python(
    code: str, *, env: dict[str, str] | None = None, check: bool = True, args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", **(env or {})}
    return subprocess.run(
        [sys.executable, *args, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        check=check,
    )


def events_in(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith('{"event"')]


def test_wheel_installs_pth_and_start_at_the_site_root() -> None:
    assert (SITE / "hybrid_draft.pth").read_text().strip() == "import hybrid_draft._bootstrap"
    entry = (SITE / "hybrid_draft.start").read_text().strip()
    import pkgutil

    from hybrid_draft import _bootstrap

    assert pkgutil.resolve_name(entry) is _bootstrap.install  # PEP 829 entry point


def test_plain_interpreter_start_imports_nothing_heavy() -> None:
    out = python("""
        import sys
        heavy = sorted(m for m in ('vllm', 'torch', 'structlog', 'hybrid_draft.adapter',
                                   'hybrid_draft.events', 'tomllib') if m in sys.modules)
        ours = sorted(m for m in sys.modules if m.startswith('hybrid_draft'))
        finders = [type(f).__name__ for f in sys.meta_path]
        print(heavy, ours, finders.count('PostImportFinder'))
    """)
    assert out.stdout.strip() == "[] ['hybrid_draft', 'hybrid_draft._bootstrap'] 1"
    assert out.stderr == ""


def test_vllm_model_loader_import_wraps_get_model_even_with_a_bad_config() -> None:
    out = python(
        """
        import inspect
        import vllm.model_executor.model_loader as loader
        from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle
        from vllm.v1.worker.gpu.spec_decode.standalone_ar import speculator as standalone
        gm = loader.get_model
        original = gm.__wrapped__
        print(gm.__hybrid_draft_wrapped__, gm.__name__, gm.__module__,
              inspect.signature(gm) == inspect.signature(original),
              eagle.get_model is gm, standalone.get_model is gm,
              getattr(original, '__hybrid_draft_wrapped__', False))
    """,
        env={"INSTANTTENSOR_DRAFT_LOADER": "bogus"},
    )  # an invalid config breaks no import
    assert out.stdout.split() == [
        "True",
        "get_model",
        "vllm.model_executor.model_loader",
        "True",
        "True",
        "True",
        "False",
    ]
    kinds = [e["event"] for e in events_in(out.stderr)]
    assert kinds == ["hybrid_draft.activated", "hybrid_draft.patched"]
    patched = events_in(out.stderr)[1]
    assert patched["target"] == "vllm.model_executor.model_loader.get_model"
    assert patched["vllm_version"] == version("vllm")


def test_importing_vllms_model_loader_imports_nothing_a_load_needs() -> None:
    """The hook runs inside vLLM's import, in every process that imports its model loader:
    it wraps and registers, and leaves structlog, the settings file's parser, the load path,
    the plan and the readers to the first load."""
    out = python(
        """
        import sys
        import vllm.model_executor.model_loader as loader
        wrapped = loader.get_model.__hybrid_draft_wrapped__
        heavy = ["structlog", "tomllib", "hybrid_draft.settings", "hybrid_draft.adapter.load",
                 "hybrid_draft.adapter.parts", "hybrid_draft.core.planning",
                 "hybrid_draft.core.readers", "hybrid_draft.core.hold",
                 "hybrid_draft.adapter.model_loader"]
        print(wrapped, [m for m in heavy if m in sys.modules])
        from vllm.config import LoadConfig
        from vllm.model_executor.model_loader import get_model_loader
        built = type(get_model_loader(LoadConfig(load_format="safetensors_filtered")))
        print(built.__name__)
    """
    )
    lines = out.stdout.splitlines()
    assert lines[0] == "True []"
    assert lines[1] == "FilteredSafetensorsLoader"  # the real loader, built when asked
    kinds = [e["event"] for e in events_in(out.stderr)]
    assert kinds == ["hybrid_draft.activated", "hybrid_draft.patched"]  # written at exit


def test_spawned_and_forked_children_are_patched(tmp_path: Path) -> None:
    script = tmp_path / "children.py"
    script.write_text(
        textwrap.dedent("""
        import multiprocessing as mp
        import sys

        def child():
            import vllm.model_executor.model_loader as loader
            sys.exit(0 if getattr(loader.get_model, "__hybrid_draft_wrapped__", False) else 3)

        if __name__ == "__main__":
            for method in ("spawn", "fork"):
                p = mp.get_context(method).Process(target=child)
                p.start()
                p.join()  # no deadline of its own: a loaded host imports vLLM slowly
                print(method, p.exitcode, flush=True)
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    # Exit status 0: that child's get_model was wrapped; 3: it was not; else it failed.
    assert out.stdout.split() == ["spawn", "0", "fork", "0"], out.stdout + out.stderr[-3000:]


def test_running_twice_is_harmless() -> None:
    out = python(f"""
        import importlib, site, sys
        import hybrid_draft._bootstrap as b
        site.addsitedir({str(SITE)!r})      # the .pth processed a second time
        b.install(); b.install()
        importlib.reload(b); b.install()    # a re-executed bootstrap finds the first finder
        import vllm.model_executor.model_loader as loader
        from hybrid_draft.adapter.patch import on_model_loader
        on_model_loader(loader)             # the hook run again
        finders = [f for f in sys.meta_path if getattr(f, '_hybrid_draft_finder', False)]
        print(len(finders), hasattr(loader.get_model.__wrapped__, '__wrapped__'))
    """)
    assert out.stdout.split() == ["1", "False"]
    kinds = [e["event"] for e in events_in(out.stderr)]
    assert kinds == ["hybrid_draft.activated", "hybrid_draft.patched"]


def test_a_failing_layer_leaves_vllm_working(tmp_path: Path) -> None:
    """structlog broken in this environment: importing vLLM still works and costs the layer
    nothing; the first load finds the layer cannot work, says so in one plain line naming
    why, and the load is vLLM's own (no decision of the layer's)."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "structlog.py").write_text("raise ImportError('structlog is broken here')\n")
    out = python(
        """
        import vllm.model_executor.model_loader as loader
        print(callable(loader.get_model))
        try:
            loader.get_model(vllm_config="not a VllmConfig")
        except AttributeError as exc:  # vLLM's own get_model, reading its config
            print(type(exc).__name__, "has no attribute 'load_config'" in str(exc))
    """,
        env={"PYTHONPATH": str(broken)},
    )
    assert out.stdout.split() == ["True", "AttributeError", "True"]
    lines = events_in(out.stderr)
    assert [e["event"] for e in lines] == [
        "hybrid_draft.activated",
        "hybrid_draft.patched",
        "hybrid_draft.patch_skipped",
    ]
    skipped = lines[-1]
    assert "structlog is broken here" in skipped["reason"]
    assert skipped["reason"].endswith("its loads are vLLM's own")
    assert skipped["vllm_version"] == version("vllm")
    # Each line is plain JSON saying why structlog could not write it, with its own fields.
    assert all("structlog is broken here" in e["event_error"] for e in lines)
    assert lines[1]["target"] == "vllm.model_executor.model_loader.get_model"


def test_disable_variable_and_late_install() -> None:
    out = python(
        """
        import os
        import vllm.model_executor.model_loader as loader
        before = getattr(loader.get_model, '__hybrid_draft_wrapped__', False)
        del os.environ['HYBRID_DRAFT_DISABLE']
        import hybrid_draft._bootstrap as b
        b.install()                          # vLLM already imported: patched on the spot
        print(before, loader.get_model.__hybrid_draft_wrapped__)
    """,
        env={"HYBRID_DRAFT_DISABLE": "1"},
    )
    assert out.stdout.split() == ["False", "True"]


def test_without_site_processing_nothing_happens() -> None:
    out = python("import sys; print('hybrid_draft' in sys.modules)", args=("-S",))
    assert out.stdout.strip() == "False"


def test_unknown_get_model_shape_is_left_untouched(events) -> None:
    from hybrid_draft.adapter import patch

    def get_model(*, vllm_config: object) -> None:  # a vLLM without model/load_config
        return None

    module = types.ModuleType("vllm.model_executor.model_loader")
    module.get_model = get_model
    patch.on_model_loader(module)
    assert module.get_model is get_model
    skipped = events.named("hybrid_draft.patch_skipped")
    assert len(skipped) == 1
    assert skipped[0]["reason"] == "get_model has no parameter model_config, load_config"
    assert [e["event"] for e in events.all()] == [
        "hybrid_draft.activated",
        "hybrid_draft.patch_skipped",
    ]


@pytest.mark.parametrize("module_text", ["", "get_model = 42\n"])
def test_missing_get_model_is_skipped(module_text: str, events) -> None:
    from hybrid_draft.adapter import patch

    module = types.ModuleType("m")
    exec(module_text, module.__dict__)
    patch.on_model_loader(module)
    assert events.named("hybrid_draft.patch_skipped")[0]["reason"].endswith(
        "has no callable get_model"
    )


def test_a_fault_in_the_layer_lets_vllm_load_as_asked(events) -> None:
    from hybrid_draft.adapter import patch

    calls = []

    def get_model(
        *,
        vllm_config: object,
        model_config: object = None,
        prefix: str = "",
        load_config: object = None,
    ) -> str:
        calls.append((vllm_config, model_config, load_config))
        return "model"

    assert patch.wrap(get_model)(vllm_config="not a VllmConfig") == "model"
    assert calls == [("not a VllmConfig", None, None)]
    (decision,) = events.named("hybrid_draft.decision")
    assert (decision["action"], decision["reason"], decision["level"]) == (
        "kept",
        "layer_error",
        "error",
    )
    every = {"role", "mode", "mode_source", "method", "requested_format", "chosen_format"}
    every |= {"action", "reason", "model", "revision", "node", "rank", "settings_fingerprint"}
    assert every <= decision.keys() and decision["role"] is None
    assert decision["detail"].startswith("AttributeError:")


@pytest.mark.vllm
def test_a_vllm_without_a_private_name_keeps_the_draft_on_its_own_path(
    qwen35: Path,
    events: Any,
    instanttensor_standin: Any,
    lazy_spy: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every private vLLM name a part of the layer relies on is checked where get_model
    is wrapped: one missing switches that part off with an event naming it, and a draft
    that part would have loaded loads on vLLM's own lazy path instead."""
    import vllm.model_executor.model_loader.ep_weight_filter as ep_weight_filter

    from conftest import engine_config, load_target_and_draft
    from hybrid_draft.adapter import parts

    monkeypatch.delattr(ep_weight_filter, "should_skip_weight")
    try:
        parts.check_parts()
        skipped = events.named("hybrid_draft.part_skipped")
        # The two parts that read it: the draft loaders and the pipeline guard's read.
        assert {e["part"] for e in skipped} == {"draft_loaders", "ungrouped_draft"}
        for event in skipped:
            assert event["missing"] == [
                "vllm.model_executor.model_loader.ep_weight_filter:should_skip_weight"
            ]
        load_target_and_draft(engine_config(qwen35))
    finally:
        monkeypatch.undo()
        parts.check_parts()
    assert not parts.installed().capabilities.off
    (draft,) = [e for e in events.decisions() if e["role"] == "draft"]
    assert (draft["action"], draft["chosen_format"], draft["tensor_filter"]) == (
        "switched",
        "safetensors",
        False,
    )
    assert [c["strategy"] for c in lazy_spy.calls] == ["lazy"]


def test_the_layers_load_formats_can_be_named_as_soon_as_vllm_can_load() -> None:
    """A user's own ``draft_load_config`` may name the layer's formats: vLLM resolves them
    from the moment its model loader is imported, before any model is decided."""
    out = python("""
        from vllm.config import LoadConfig
        from vllm.model_executor.model_loader import get_model_loader
        for fmt in ("safetensors_filtered", "instanttensor_selective", "instanttensor_ungrouped"):
            print(fmt, type(get_model_loader(LoadConfig(load_format=fmt))).__name__)
    """)
    assert out.stdout.split() == [
        "safetensors_filtered",
        "FilteredSafetensorsLoader",
        "instanttensor_selective",
        "SelectiveInstantTensorLoader",
        "instanttensor_ungrouped",
        "UngroupedInstantTensorLoader",
    ]
    # Switched off, the layer is not there to name.
    off = python(
        """
        from vllm.config import LoadConfig
        from vllm.model_executor.model_loader import get_model_loader
        get_model_loader(LoadConfig(load_format="safetensors_filtered"))
        """,
        env={"HYBRID_DRAFT_DISABLE": "1"},
        check=False,
    )
    assert off.returncode != 0 and "safetensors_filtered" in off.stderr
