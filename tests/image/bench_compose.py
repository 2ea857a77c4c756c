"""What a user waits for: ``docker compose up`` to a healthy server, and to the smoke test's
verdict, from a cold page cache, per draft mode (scripts/bench-compose runs this; a
benchmark, not a test: it asserts nothing but that each run served and passed its smoke).

In an engine of its own (tests/image/engine.py's dockerd, in its own network namespace, its
data under build/bench-engine/, removed at the end): the image ``docker buildx bake local``
builds on the image test's venv base (vLLM's CPU build), and a generated DeepSeek-V3
checkpoint of a few GiB (make-checkpoint's ``cpu`` shapes, widened: ``--layers``, 64 routed
experts, hidden size 1024) served through compose's ``MODEL_DIR``. Each run: ``docker
compose down --volumes``, ``sync; echo 3 > /proc/sys/vm/drop_caches``, then ``docker compose
-f compose.yaml -f tests/image/cpu-compose.yaml up --exit-code-from smoke`` with
``INSTANTTENSOR_DRAFT_LOADER=MODE``; the times come from the engine's own events (the
server's ``health_status: healthy``, the smoke container's ``die``). The modes alternate run
by run, so whatever else the machine does falls on both alike.

On a CPU host InstantTensor's read is the image test's stand-in (cpu-compose.yaml mounts
it): ``instanttensor`` reads the draft by a second pass of that stand-in over every shard,
``auto`` switches the draft to filtered safetensors over the shards it needs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/, after tests/image/

import buildah
import localbase
from buildfiles import REPO, bake_tags
from conftest import python_info, wheels_dir
from engine import CPU_VARIABLES, Engine, Up

MODES = ("instanttensor", "auto")
#: make-checkpoint's DeepSeek-V3 ``cpu`` shapes (the MLA ranks vLLM's CPU build serves),
#: widened to a few GiB; ``layers`` is set by --layers.
SHAPES = {
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "n_routed_experts": 64,
    "vocab_size": 32768,
}
#: Run in the baked image: make-checkpoint's own steps (synth) with SHAPES.
GENERATE = """
import json, sys
from pathlib import Path
from hybrid_draft.tools import synth
shapes = json.loads(sys.argv[1])
out = Path("/model")
layout = synth.deepseek_v3("cpu", **shapes)
shards = synth.shard(layout, num_shards=int(sys.argv[2]), mtp_own_shard=True)
with synth.marked(out):
    synth.write_tokenizer(out, layout.config["vocab_size"])
    synth.write_checkpoint(out, layout, shards, fill="normal", seed=0, draft="agrees")
print(f"{len(shards)} shards, {len(layout.tensors)} tensors, {layout.nbytes / 2**30:.2f} GiB")
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench-compose", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per mode (default 3)")
    p.add_argument("--layers", type=int, default=12, help="decoder layers (default 12)")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--out", type=Path, default=REPO / "build" / "bench-compose")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint at the end")
    args = p.parse_args(argv)
    if args.runs < 1 or args.layers < 2 or args.shards < 2:
        print("bench-compose: --runs takes 1 or more, --layers and --shards 2 or more")
        return 2
    if os.geteuid() != 0:
        print("bench-compose: needs root (dockerd, buildah, drop_caches)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    engine = Engine(root=REPO / "build" / "bench-engine", netns=f"{buildah.PREFIX}bench")
    checkpoint = args.out / "checkpoint"
    try:
        return bench(engine, args, checkpoint)
    finally:
        engine.stop()
        if not args.keep:
            shutil.rmtree(checkpoint, ignore_errors=True)


def bench(engine: Engine, args: argparse.Namespace, checkpoint: Path) -> int:
    log = args.out
    base = localbase.base({}, log)
    print(f"bench-compose: base {base}", flush=True)
    engine.start()
    engine.load(base)
    variables = {"BASE_IMAGE": base, "PACKAGE_INDEX": "none", "WHEELS": str(wheels_dir())}
    baked = engine.bake("local", variables, log / "bake.log")
    if baked.returncode != 0:
        print(f"bench-compose: bake failed:\n{baked.stdout[-3000:]}", file=sys.stderr)
        return 1
    image = bake_tags("local", variables)[0]
    print(f"bench-compose: baked {image}", flush=True)

    shapes = {**SHAPES, "num_hidden_layers": args.layers}
    if not (checkpoint / "model.safetensors.index.json").exists():
        shutil.rmtree(checkpoint, ignore_errors=True)
        checkpoint.mkdir(parents=True)
        start = time.monotonic()
        made = engine.docker(
            "run", "--rm", "--network", "none", "--entrypoint", "python3",
            "--volume", f"{checkpoint}:/model", image,
            "-c", GENERATE, json.dumps(shapes), str(args.shards),
        )  # fmt: skip
        print(
            f"bench-compose: checkpoint {made.stdout.strip()} in {time.monotonic() - start:.0f} s"
        )
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))

    compose_vars = {
        **CPU_VARIABLES,
        "MODEL_DIR": str(checkpoint),
        "STANDIN_SITE_PACKAGES": python_info(base)["purelib"],
    }
    runs: list[dict[str, object]] = []
    for i in range(args.runs):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            run = one_up(engine, {**compose_vars, "INSTANTTENSOR_DRAFT_LOADER": mode}, log, i)
            run["mode"] = mode
            runs.append(run)
            print(f"bench-compose: run {i + 1} {mode}: {json.dumps(run)}", flush=True)
    engine.compose("down", "--volumes", variables=compose_vars, check=False)

    result = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine(),
        "checkpoint": {"bytes": size, "shapes": shapes, "shards": args.shards},
        "dtype": CPU_VARIABLES["CPU_DTYPE"],
        "runs": runs,
    }
    (args.out / "bench-compose.json").write_text(json.dumps(result, indent=1))
    print(table(runs, size))
    return 0 if all(r["ok"] for r in runs) else 1


def one_up(engine: Engine, variables: dict[str, str], log: Path, i: int) -> dict[str, object]:
    """One cold ``docker compose up``: seconds to the healthy server and to smoke's end."""
    engine.compose("down", "--volumes", variables=variables, check=False)
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    since = time.time()
    start = time.monotonic()
    out = engine.up(variables, log / f"up-{variables['INSTANTTENSOR_DRAFT_LOADER']}-{i}.log")
    wall = time.monotonic() - start
    seen = engine.docker(
        "events", "--since", f"{since:.3f}", "--until", f"{time.time():.3f}",
        "--filter", "type=container", "--format", "{{json .}}",
    ).stdout  # fmt: skip
    healthy = smoke_done = None
    for line in seen.splitlines():
        e = json.loads(line)
        name = e.get("Actor", {}).get("Attributes", {}).get("name", "")
        at = e["timeNano"] / 1e9 - since
        action = e.get("Action") or e.get("status")
        if name.endswith("-server-1") and action == "health_status: healthy":
            healthy = healthy or at
        if name.endswith("-smoke-1") and action == "die":
            smoke_done = smoke_done or at
    result = Up(out.returncode, out.stdout, engine.volume_path("events"))
    drafts = [
        e
        for e in result.events()
        if e.get("event") == "hybrid_draft.decision" and e.get("role") == "draft"
    ]
    return {
        "ok": out.returncode == 0,
        "healthy_s": healthy,
        "smoke_done_s": smoke_done,
        "up_returned_s": wall,
        "draft": {k: drafts[0].get(k) for k in ("mode", "action", "reason")} if drafts else None,
        "loads": loads(result),
    }


def loads(result: Up) -> dict[str, dict[str, object]]:
    """Each role's ``hybrid_draft.loaded`` event, as the server printed it: seconds and bytes."""
    out: dict[str, dict[str, object]] = {}
    for line in result.service("server").splitlines():
        if line.startswith('{"event": "hybrid_draft.loaded"'):
            e = json.loads(line)
            out[e["role"]] = {k: e.get(k) for k in ("load_format", "seconds", "bytes_read")}
    return out


def machine() -> dict[str, object]:
    model = ""
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            model = line.split(":", 1)[1].strip()
    mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "kernel": platform.release(),
    }


def table(runs: list[dict[str, object]], size: int) -> str:
    lines = [
        f"checkpoint {size / 2**30:.2f} GiB; seconds from `docker compose up`, cold page cache",
        "| mode | runs | to healthy server: median (min-max) | to smoke done: median (min-max) |",
        "|---|---|---|---|",
    ]
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode and r["ok"]]
        cells = []
        for key in ("healthy_s", "smoke_done_s"):
            vals = [float(r[key]) for r in mine if r[key] is not None]  # type: ignore[arg-type]
            cells.append(
                f"{statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f})" if vals else "-"
            )
        lines.append(f"| {mode} | {len(mine)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
