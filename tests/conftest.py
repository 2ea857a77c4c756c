"""Shared fixtures: tiny generated checkpoints, real vLLM on the CPU, event capture.

The tests run in the environment scripts/test builds: the pinned vLLM, and the hybrid-draft
wheel installed the way the image installs it, so its ``.pth`` is active in this very
process and vLLM's ``get_model`` is the wrapped one. The only stand-ins are for
InstantTensor's reads, which need CUDA: vLLM's ``instanttensor_weights_iterator`` (and, for
the selective loader, ``instanttensor.safe_open``), replaced by recorders that read the same
tensors with safetensors.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Before anything imports vLLM: the CPU platform, and a private inspection cache.
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="hybrid-draft-tests-"))
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("VLLM_CACHE_ROOT", str(_SESSION_TMP / "vllm-cache"))
os.environ["HYBRID_DRAFT_CONFIG"] = str(_SESSION_TMP / "absent.toml")
for _var in (
    "INSTANTTENSOR_DRAFT_LOADER",
    "HYBRID_DRAFT_LOG_LEVEL",
    "HYBRID_DRAFT_EVENTS_FILE",
    "HYBRID_DRAFT_DISABLE",
):
    os.environ.pop(_var, None)

import hostcpu  # noqa: E402
import systemsetup  # noqa: E402
from hybrid_draft.tools import synth  # noqa: E402 - after the environment above

REPO = Path(__file__).resolve().parents[1]
# The image test (scripts/image-test, run after pytest by scripts/test) is a session of its
# own, with its own conftest: never collected here.
collect_ignore = ["image"]


@pytest.fixture(scope="session", autouse=True)
def _amx_when_asked() -> Iterator[None]:
    """With ``HYBRID_DRAFT_TEST_AMX=1`` the host answers AMX yes, as an AMX host does."""
    if os.environ.get(hostcpu.FORCE_ENV) != "1":
        yield
        return
    with hostcpu.force_amx():
        yield


@pytest.fixture(scope="session", autouse=True)
def _inprocess_kernels(request: pytest.FixtureRequest, _amx_when_asked: None) -> Iterator[None]:
    """Every in-process vLLM load of the session takes the kernels the library vLLM loads here
    holds, decided once (tests/hostcpu.py), whatever the host or an earlier test answered."""
    if not any(item.get_closest_marker("vllm") for item in request.session.items):
        yield  # no test of this session runs vLLM in this process
        return
    with hostcpu.inprocess_session():
        yield


#: When this session started: nothing may be installed on the host after it (tests/systemsetup.py).
SESSION_STARTED = time.time()


def pytest_report_header() -> list[str]:
    """The host's CPU, which vLLM's CPU code picks its kernels by (docs/testing.md), and the
    system packages scripts/system-setup left before the session started (and the tools it
    unpacked into build/system-tools, never installed)."""
    forced = " (AMX selection forced)" if os.environ.get(hostcpu.FORCE_ENV) == "1" else ""
    lines = [f"host CPU: {hostcpu.describe()}{forced}"]
    path = systemsetup.record_path()
    if path is not None and path.is_file():
        try:
            record = systemsetup.read_record(path)
        except ValueError as e:
            lines.append(f"system packages: {e}")
        else:
            packages = record.packages.items()
            lines.append("system packages: " + ", ".join(f"{k} {v}" for k, v in packages))
            if record.tools:
                tools = ", ".join(f"{k} {v} ({r})" for k, (v, r) in record.tools.items())
                lines.append(f"unpacked, not installed: {tools}")
    return lines


@pytest.fixture(scope="session")
def session_started() -> float:
    """The time this pytest session started (epoch seconds)."""
    return SESSION_STARTED


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)
    # The whole session, not only up to tests/test_system_setup.py: dpkg changed nothing.
    changed = systemsetup.dpkg_changes_since(SESSION_STARTED)
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for line in changed:
            if reporter is not None:
                reporter.write_line(f"installed while the tests ran: {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# --- checkpoints -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def ckpt_root() -> Path:
    root = _SESSION_TMP / "checkpoints"
    root.mkdir(exist_ok=True)
    return root


def _write(root: Path, name: str, layout: synth.Layout, **shard_kw: Any) -> Path:
    out = root / name
    if not (out / "config.json").exists():
        synth.write_checkpoint(
            out, layout, synth.shard(layout, **shard_kw), seed=zlib.crc32(name.encode()) % 1000
        )
    return out


@pytest.fixture(scope="session")
def qwen35(ckpt_root: Path) -> Path:
    """Qwen3.5 text + one MTP layer, ``mtp.*`` in a shard of its own (3 shards)."""
    return _write(ckpt_root, "qwen35", synth.qwen3_5("tiny"), num_shards=3, mtp_own_shard=True)


@pytest.fixture(scope="session")
def qwen35_step2(ckpt_root: Path) -> Path:
    """The next training step's checkpoint of ``qwen35``: every tensor another (another
    seed)."""
    return _write(
        ckpt_root, "qwen35-step2", synth.qwen3_5("tiny"), num_shards=3, mtp_own_shard=True
    )


@pytest.fixture(scope="session")
def qwen35_copy(qwen35: Path, ckpt_root: Path) -> Path:
    """The same bytes in another directory: a different checkpoint by identity."""
    out = ckpt_root / "qwen35-copy"
    if not out.exists():
        shutil.copytree(qwen35, out)
    return out


@pytest.fixture(scope="session")
def deepseek(ckpt_root: Path) -> Path:
    """DeepSeek-V3 with MLA, no MoE, one MTP layer in a shard of its own."""
    return _write(
        ckpt_root,
        "deepseek",
        synth.deepseek_v3("tiny", moe=False),
        num_shards=3,
        mtp_own_shard=True,
    )


@pytest.fixture(scope="session")
def step2(deepseek: Path, ckpt_root: Path) -> Path:
    """The next training step's checkpoint of ``deepseek``: the same model, every tensor
    different (another seed)."""
    return _write(
        ckpt_root,
        "deepseek-step2",
        synth.deepseek_v3("tiny", moe=False),
        num_shards=3,
        mtp_own_shard=True,
    )


@pytest.fixture(scope="session")
def step3(deepseek: Path, ckpt_root: Path) -> Path:
    """The training step after ``step2``: the same model again, every tensor different."""
    return _write(
        ckpt_root,
        "deepseek-step3",
        synth.deepseek_v3("tiny", moe=False),
        num_shards=3,
        mtp_own_shard=True,
    )


@pytest.fixture(scope="session")
def glm(ckpt_root: Path) -> Path:
    """GLM-4.5-style MoE with one (MoE) MTP layer in a shard of its own."""
    return _write(ckpt_root, "glm", synth.glm4_moe("tiny"), num_shards=3, mtp_own_shard=True)


@pytest.fixture(scope="session")
def qwen3_pair(ckpt_root: Path) -> tuple[Path, Path]:
    """Two dense Qwen3 checkpoints: a target and a standalone draft (``draft_model``)."""
    return (
        _write(ckpt_root, "qwen3-target", synth.qwen3("tiny"), num_shards=2),
        _write(ckpt_root, "qwen3-draft", synth.qwen3("tiny"), num_shards=2),
    )


# --- events ------------------------------------------------------------------------------


class Events:
    """The layer's events file for one test, parsed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def all(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.all() if e["event"] == event]

    def decisions(self, role: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.named("hybrid_draft.decision") if role in (None, e["role"])]


@pytest.fixture
def events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Events:
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv("HYBRID_DRAFT_EVENTS_FILE", str(path))
    return Events(path)


# --- real vLLM on the CPU ------------------------------------------------------------------


@pytest.fixture(scope="session")
def vllm_runtime() -> Any:
    """vLLM imported (the layer's hook fires here) and a one-process gloo world.

    The model-parallel groups are made under a config without a model, for which vLLM
    creates every group, the expert-parallel one included: a session loads dense and MoE
    models in any order, and the groups are made only once.
    """
    import vllm.model_executor.model_loader as loader
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.logging import LoggingConfig
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.logger import configure_logging_if_needed

    # vLLM's logging, applied once as create_engine_config applies it: applying it later
    # (dictConfig) would drop the handlers tests attach to vLLM's child loggers.
    configure_logging_if_needed(LoggingConfig())
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"file://{_SESSION_TMP / 'dist-init'}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
    # vLLM's model loading calls gc.collect() several times per load (its memory profiling):
    # with torch and vLLM imported, each one walks some 875,000 objects, 0.5 s, nearly all
    # of a tiny model's load. What the imports made lives as long as the process: out of
    # the collector's sight (gc.freeze), the same loads take 0.05 s. Objects made later are
    # collected as ever; what was garbage before the freeze is collected first, once.
    gc.collect()
    gc.freeze()
    return loader


def engine_config(
    model: str | Path,
    *,
    load_format: str = "instanttensor",
    speculative_config: dict[str, Any] | None = None,
    config_dir: Path | None = None,
    **kwargs: Any,
) -> Any:
    """The real ``EngineArgs(...).create_engine_config()`` for a tiny CPU model (``model``
    a local directory, or an object-storage address with the same checkpoint's local copy
    as ``config_dir``)."""
    from vllm.engine.arg_utils import EngineArgs

    spec = dict(speculative_config or {"method": "mtp", "num_speculative_tokens": 1})
    hf_config = json.loads((Path(config_dir or model) / "config.json").read_text())
    chosen = hostcpu.inprocess_engine_args(hf_config)  # the same on every host
    for key, value in chosen.items():
        kwargs.setdefault(key, value)
    if "attention_backend" in chosen:
        spec.setdefault("attention_backend", kwargs["attention_backend"])
    config = EngineArgs(
        model=str(model),
        load_format=load_format,
        speculative_config=spec,
        skip_tokenizer_init=True,
        max_model_len=128,
        enforce_eager=True,
        **kwargs,
    ).create_engine_config()
    if config.model_config.use_mla and "attention_backend" not in chosen:
        raise AssertionError(f"{model}: vLLM builds MLA, which tests/hostcpu.py did not see")
    return config


class Loaded:
    """The result of loading a target and its draft through real vLLM."""

    def __init__(self, config: Any, target: Any, draft: Any) -> None:
        self.config = config
        self.target = target
        self.draft = draft


def vllm_module(name: str) -> Any:
    """vLLM's module ``name``, or the calling test skipped saying this vLLM has none.

    For the routes of one line of releases only: vLLM 0.34 removed the V1 proposers
    (``vllm.v1.spec_decode.eagle``, ``llm_base_proposer``, ``draft_model``) and the V1 model
    runners (``vllm.v1.worker.gpu_model_runner``, ``cpu_model_runner``); model runner v2
    (``vllm.v1.worker.gpu``), which 0.33 has too, is the route every release has.
    """
    import importlib

    import vllm

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not name.startswith(exc.name):
            raise  # the module exists and lacks something else: a failure, not a skip
        pytest.skip(f"vLLM {vllm.__version__} has no {name}")


#: The draft route every supported release has: model runner v2's ``load_eagle_model``.
ROUTE = "mrv2_eagle"


def load_target_and_draft(config: Any, route: str = ROUTE) -> Loaded:
    """Load the target with ``get_model`` and the draft by one of vLLM's own routes
    (``eagle`` and ``draft_model``: the V1 proposers, skipped where vLLM has none)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.model_executor.model_loader import get_model

    with set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        target = get_model(vllm_config=config)
        if route == "eagle":
            eagle = vllm_module("vllm.v1.spec_decode.eagle")
            proposer = eagle.EagleProposer(config, torch.device("cpu"), runner=None)
            proposer.load_model(target)
            draft = proposer.model
        elif route == "mrv2_eagle":
            from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

            draft = load_eagle_model(target, config)
        elif route == "draft_model":
            module = vllm_module("vllm.v1.spec_decode.draft_model")
            proposer = module.DraftModelProposer(config, torch.device("cpu"), runner=None)
            proposer.load_model(target)
            draft = proposer.model
        elif route == "mrv2_standalone":
            from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import (
                StandaloneARSpeculator,
            )

            draft = StandaloneARSpeculator(config, torch.device("cpu")).load_draft_model(
                target, set()
            )
        else:
            raise ValueError(f"route={route!r}")
    return Loaded(config, target, draft)


#: vLLM's CPU model runners, by route: 0.33's V1 runner, and model runner v2's, which every
#: supported release has.
RUNNERS = {"v1": "vllm.v1.worker.cpu_model_runner", "v2": "vllm.v1.worker.cpu.model_runner"}


def model_runner(config: Any, route: str = "v2") -> Any:
    """vLLM's own CPU model runner of ``route`` for ``config``, built and loaded (the target,
    then its draft, in the runner's own ``load_model``) as vLLM's CPU worker does it: model
    runner v2's after the CPU patches that worker imports first
    (``vllm.v1.worker.cpu.shm``: CUDA streams, events and pinned memory as no-ops on the
    CPU, process-wide as in the worker). Skipped where this vLLM has no such runner."""
    import importlib

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized

    module = vllm_module(RUNNERS[route])
    if route == "v2":
        importlib.import_module("vllm.v1.worker.cpu.shm")
    with set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        runner = module.CPUModelRunner(config, torch.device("cpu"))
        runner.load_model()
    return runner


def reload_weights(runner: Any, **kwargs: Any) -> None:
    """The runner's own ``reload_weights``, as vLLM's worker calls it (``Worker
    .reload_weights``: under the runner's config)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(runner.vllm_config):
        runner.reload_weights(**kwargs)


#: What a level-2 sleep leaves in a parameter it did not keep (any value will do: one that
#: no checkpoint here holds).
GARBAGE = 7.0


def params(model: Any) -> dict[str, Any]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def own(runner: Any) -> dict[str, Any]:
    """The draft's own parameters: not those it shares with the target, which the target's
    reload restores."""
    theirs = {id(p) for p in runner.get_model().parameters()}
    draft = runner.get_draft_model()
    return {n: p.detach().clone() for n, p in draft.named_parameters() if id(p) not in theirs}


def storage(model: Any) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in model.named_parameters()}


def garble(model: Any) -> None:
    """Every parameter of ``model`` overwritten, as a level-2 sleep leaves it."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            param.fill_(GARBAGE)


def differing(model: Any, expected: dict[str, Any]) -> list[str]:
    """The parameters of ``model`` that differ from ``expected`` (by name)."""
    import torch

    found = params(model)
    assert found.keys() == expected.keys()
    return [n for n, t in found.items() if not torch.equal(t, expected[n])]


def reloads(events: Events, event: str, role: str = "draft") -> list[dict[str, Any]]:
    return [e for e in events.named(event) if e.get("trigger") == "reload" and e["role"] == role]


class Recorder:
    """Calls of a weights iterator: its files (base names) and keyword arguments.

    ``real`` sends later calls to the real function instead (for InstantTensor: proof that
    a call reached it, since on the CPU it refuses with "InstantTensor requires NVIDIA GPUs").
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.real = False

    def files(self) -> list[list[str]]:
        return [c["files"] for c in self.calls]


@pytest.fixture
def instanttensor_standin(vllm_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Replace vLLM's InstantTensor iterator (CUDA only) by a recorder reading the same
    tensors as InstantTensor does (whole, every one a copy: vLLM's eager safetensors
    iterator); nothing else in vLLM is replaced."""
    import vllm.model_executor.model_loader.default_loader as default_loader
    import vllm.model_executor.model_loader.weight_utils as weight_utils

    real_lazy = weight_utils.safetensors_weights_iterator
    real_instanttensor = default_loader.instanttensor_weights_iterator
    recorder = Recorder()

    def standin(
        hf_weights_files: list[str],
        use_tqdm_on_load: bool,
        local_expert_ids: Any = None,
        **kwargs: Any,
    ) -> Iterator[Any]:
        recorder.calls.append(
            {
                "files": sorted(Path(f).name for f in hf_weights_files),
                "local_expert_ids": local_expert_ids,
                **kwargs,
            }
        )
        if recorder.real:
            return real_instanttensor(
                hf_weights_files, use_tqdm_on_load, local_expert_ids, **kwargs
            )
        # As InstantTensor does: every byte of every shard read, every tensor a copy.
        return real_lazy(hf_weights_files, use_tqdm_on_load, "eager")

    monkeypatch.setattr(default_loader, "instanttensor_weights_iterator", standin)
    monkeypatch.setattr(weight_utils, "instanttensor_weights_iterator", standin)
    return recorder


def _fastsafetensors_read(files: list[str]) -> Iterator[tuple[str, Any]]:
    """Every tensor of ``files`` read whole by fastsafetensors' own loader on the CPU."""
    from fastsafetensors import SafeTensorsFileLoader
    from fastsafetensors.common import SingleGroup

    for path in sorted(files):
        loader = SafeTensorsFileLoader(SingleGroup(), device="cpu", nogds=True, set_numa=False)
        try:
            loader.add_filenames({0: [path]})
            buffer = loader.copy_files_to_device()
            try:
                for name in loader.get_keys():
                    yield name, buffer.get_tensor(name)
            finally:
                buffer.close()
        finally:
            loader.close()


@pytest.fixture
def fastsafetensors_standin(vllm_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """vLLM's fastsafetensors iterator (it asks for a CUDA device) replaced by fastsafetensors'
    own loader on the CPU; nothing else in vLLM is replaced."""
    import vllm.model_executor.model_loader.default_loader as default_loader

    recorder = Recorder()

    def standin(hf_weights_files: list[str], use_tqdm_on_load: bool) -> Any:
        recorder.calls.append({"files": sorted(Path(f).name for f in hf_weights_files)})
        return _fastsafetensors_read(hf_weights_files)

    monkeypatch.setattr(default_loader, "fastsafetensors_weights_iterator", standin)
    return recorder


@pytest.fixture
def runai_requests(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Every read request Run:ai's streamer sends to its backend: file and bytes (a spy on
    ``DistributedStreamer.stream_files``, which still serves them). Each shard's header is
    two requests (its 8-byte length, then the header), then its tensors' ranges."""
    from runai_model_streamer.distributed_streamer import DistributedStreamer

    real = DistributedStreamer.stream_files
    recorder = Recorder()

    def spy(self: Any, requests: list[Any], *args: Any, **kwargs: Any) -> Any:
        for r in requests:
            recorder.calls.append({"file": Path(r.path).name, "bytes": sum(r.sizes)})
        return real(self, requests, *args, **kwargs)

    monkeypatch.setattr(DistributedStreamer, "stream_files", spy)
    return recorder


@pytest.fixture
def lazy_spy(vllm_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Record calls of vLLM's real safetensors iterator (it still does the reading)."""
    import vllm.model_executor.model_loader.default_loader as default_loader

    real = default_loader.safetensors_weights_iterator
    recorder = Recorder()

    def spy(
        hf_weights_files: list[str],
        use_tqdm_on_load: bool,
        safetensors_load_strategy: str | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        recorder.calls.append(
            {
                "files": sorted(Path(f).name for f in hf_weights_files),
                "strategy": safetensors_load_strategy,
            }
        )
        return real(hf_weights_files, use_tqdm_on_load, safetensors_load_strategy, *args, **kwargs)

    monkeypatch.setattr(default_loader, "safetensors_weights_iterator", spy)
    return recorder


@pytest.fixture
def filtered_reads(vllm_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Every tensor hybrid-draft's filtered reader takes, per shard it opens, and the bytes
    it read for them (spies on ``shardread.read_shard``, ``tensor`` and ``read_into``, which
    still do the reading; vLLM's own iterators are recorded by ``lazy_spy``)."""
    from hybrid_draft.core import shardread

    real_shard, real_tensor, real_read = (
        shardread.read_shard,
        shardread.tensor,
        shardread.read_into,
    )
    recorder = Recorder()
    by_path: dict[str, dict[str, Any]] = {}

    def read_shard(path: str, *args: Any, **kwargs: Any) -> Any:
        entry = {"file": Path(path).name, "tensors": [], "bytes": 0}
        recorder.calls.append(entry)
        by_path[path] = entry
        return real_shard(path, *args, **kwargs)

    def tensor(memory: Any, base: int, path: str, t: Any) -> Any:
        by_path[path]["tensors"].append(t.name)
        return real_tensor(memory, base, path, t)

    def read_into(fd: int, view: memoryview, offset: int, path: str, run: Any) -> None:
        real_read(fd, view, offset, path, run)
        by_path[path]["bytes"] += len(view)

    monkeypatch.setattr(shardread, "read_shard", read_shard)
    monkeypatch.setattr(shardread, "tensor", tensor)
    monkeypatch.setattr(shardread, "read_into", read_into)
    return recorder


def rule_keeps(model_dir: Path, draft: Any) -> set[str]:
    """The checkpoint tensors a loaded draft's checkpoint-weight rule keeps."""
    from hybrid_draft.core import checkpoint

    names = {t.name for s in checkpoint.read_checkpoint(model_dir) for t in s.tensors}
    return {n for n in names if not draft.is_unused_checkpoint_weight(n)}


#: A DeepSeek-V3 MTP draft's tensors vLLM replaces with the target's (never read, never held).
REPLACED = ("embed_tokens.weight", "shared_head.head.weight")


def draft_tensors(model_dir: Path, draft: Any, replaced: bool = False) -> dict[str, int]:
    """The tensors a loaded DeepSeek-V3 draft's rule keeps, with sizes: those it reads itself
    (all but :data:`REPLACED`), or with ``replaced`` the ones vLLM replaces."""
    from hybrid_draft.core import checkpoint

    keeps = rule_keeps(model_dir, draft)
    return {
        t.name: t.nbytes
        for s in checkpoint.read_checkpoint(model_dir)
        for t in s.tensors
        if t.name in keeps and t.name.endswith(REPLACED) == replaced
    }


#: A Qwen3.5 MTP draft's tensors vLLM replaces with the target's (never read, never held).
QWEN35_REPLACED = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def assert_qwen35_draft_is_the_checkpoints(model_dir: Path, draft: Any) -> None:
    """Every parameter of a loaded Qwen3.5 MTP draft equals its ``mtp.*`` tensor."""
    import torch

    ckpt = checkpoint_tensors(model_dir)
    for name, param in draft.named_parameters():
        source = "mtp." + name.removeprefix("model.")
        if source in ckpt:
            assert torch.equal(param.detach(), ckpt[source].to(param.dtype)), name


def checkpoint_tensors(model_dir: Path) -> dict[str, Any]:
    """Every tensor of a checkpoint, read with safetensors (the reference values)."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def child_pytest(
    test_file: str,
    select: str,
    env: dict[str, str],
    timeout: float = 1800,
    wrap: Any = None,
) -> subprocess.CompletedProcess[str]:
    """``test_file``'s tests that ``-k select`` picks, in a pytest process of its own with
    ``env`` added (its command line passed through ``wrap``, where given): for what must not
    share the suite's process (a SIGBUS, a library that keeps one backend per process)."""
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(Path(test_file).resolve().relative_to(REPO)),
        "-k",
        select,
    ]
    return subprocess.run(
        wrap(argv) if wrap is not None else argv,
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def failing_commit(runner: Any, which: str) -> Iterator[None]:
    """vLLM failing once, part way through the commit of ``runner``'s draft: ``placing``,
    at the second of the draft's own layers placed into its storage; ``finalize``, right
    after the draft's attention layer has been processed (MLA's W_UK_T and W_UV derived from
    the new weights, in place)."""
    from hybrid_draft.adapter import internals

    draft = runner.get_draft_model()
    if which == "placing":
        import vllm.model_executor.model_loader.reload.layerwise as layerwise

        own = set(draft.modules()) - set(runner.get_model().modules())
        real = layerwise._place_kernel_tensors
        count = [0]

        @functools.wraps(real)
        def place(layer: Any, info: Any) -> None:
            count[0] += layer in own
            if count[0] == 2 and layer in own:
                raise RuntimeError("placing the draft's second layer failed")
            real(layer, info)

        layerwise._place_kernel_tensors = place
        try:
            yield
        finally:
            layerwise._place_kernel_tensors = real
        return
    (attention,) = [m for m in draft.modules() if internals.is_deferred_attention(m)]
    real_process = attention.process_weights_after_loading

    def process(*args: Any, **kwargs: Any) -> Any:
        del attention.process_weights_after_loading  # the next one is vLLM's own again
        real_process(*args, **kwargs)
        raise RuntimeError("finalize failed after the attention's processing")

    attention.process_weights_after_loading = process
    try:
        yield
    finally:
        vars(attention).pop("process_weights_after_loading", None)
