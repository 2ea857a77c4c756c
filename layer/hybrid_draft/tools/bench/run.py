"""``hybrid-draft bench``: what a draft load costs under each strategy, cold, against the
storage's physical limit, plus the layer's start-up cost. Prints a table, writes
``OUT/bench.json`` and ``OUT/bench.png``. A benchmark, not a test: it asserts nothing.

The checkpoint is a synthetic DeepSeek-V3-style MoE export (MLA attention, routed and
shared experts, one MTP layer at the end, the shared embedding in the first shard), with
tensors of 4 to 64 MiB, shards of about 1 GiB and the draft at about 4 % of the bytes. The
draft's tensors are those ``DeepSeekMTP`` loads, by the rule hybrid-draft installs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

GIB = 1 << 30
LAYOUT_VERSION = 2
DRAFT_NAMES = "bench-draft-tensors.json"
NEEDS_VLLM = ("lazy", "lazy_pruned", "auto", "selective")


#: The largest checkpoint bench writes (GiB): a bound on a typo, not on the storage.
MAX_SIZE_GIB = 4096.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hybrid_draft.tools import args as types

    p.add_argument(
        "--size",
        type=types.at_most(types.positive, MAX_SIZE_GIB),
        default=8.0,
        help="checkpoint size in GiB (default 8)",
    )
    p.add_argument(
        "--runs",
        type=types.integer(1, 1000),
        default=3,
        help="cold runs per strategy (default 3)",
    )
    p.add_argument("--out", default="bench-out", help="where bench.json and bench.png go")
    p.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint directory (default OUT/checkpoint-SIZEGiB; reused)",
    )
    p.add_argument(
        "--strategies",
        default=None,
        help="comma-separated subset (default: every CPU strategy, and the GPU "
        "ones when CUDA is present)",
    )
    p.add_argument(
        "--startup-runs",
        type=types.integer(0, 100_000),
        default=40,
        help="interpreter starts per variant for the .pth cost (0 skips)",
    )
    p.add_argument(
        "--hook-runs",
        type=types.integer(0, 10_000),
        default=3,
        help="fresh processes timing the model-loader hook (0 skips)",
    )


# --- the checkpoint ---------------------------------------------------------------------


def _dims(hidden: int) -> dict[str, int]:
    return dict(
        hidden_size=hidden,
        vocab_size=hidden,
        intermediate_size=hidden,
        moe_intermediate_size=hidden // 8,
        num_attention_heads=max(1, hidden // 128),
        q_lora_rank=hidden * 3 // 8,
        kv_lora_rank=hidden // 8,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    )


def bench_layout(size_bytes: int) -> Any:
    """A DeepSeek-V3-style layout of about ``size_bytes``: the widest that has 8+ layers."""
    from hybrid_draft.tools import synth

    for hidden in (4096, 2048, 1024, 512, 256):
        dims = _dims(hidden)
        two = synth.deepseek_v3("tiny", **dims, num_hidden_layers=2).nbytes
        per_layer = synth.deepseek_v3("tiny", **dims, num_hidden_layers=3).nbytes - two
        layers = round((size_bytes - two) / per_layer) + 2
        if layers >= 8 or hidden == 256:
            return synth.deepseek_v3("tiny", **dims, num_hidden_layers=max(layers, 2))
    raise AssertionError("unreachable")


class BenchError(ValueError):
    """Bad input to bench: one line naming it."""


def _stamp(directory: Path) -> Any:
    from hybrid_draft import files

    try:
        return files.read_json(directory / "bench-layout.json", 1 << 16)
    except (FileNotFoundError, files.FileProblem):
        return None


def prepare_checkpoint(directory: Path, size_gib: float) -> Path:
    """Write the checkpoint unless one of the same size and layout version is there; refuse a
    directory that holds anything but a bench checkpoint (it is never overwritten)."""
    from hybrid_draft.tools import synth

    stamp = directory / "bench-layout.json"
    want = {"size_gib": size_gib, "version": LAYOUT_VERSION}
    found = _stamp(directory)
    if found == want:
        return directory
    state = synth.target_state(directory)
    if found is None and state in ("occupied", "complete"):
        raise BenchError(
            f"{directory} holds files that are not a bench checkpoint; name a new or empty "
            "directory with --checkpoint (bench never overwrites one)"
        )
    size = int(size_gib * GIB)
    layout = bench_layout(size)
    shard_bytes = GIB if size >= 4 * GIB else max(size // 8, 1 << 20)
    shards = synth.shard(layout, shard_bytes=shard_bytes)
    print(f"writing a {size_gib:g} GiB checkpoint to {directory} ...", flush=True)
    with synth.marked(directory):
        synth.write_checkpoint(directory, layout, shards, fill="noise", seed=1)
        # What DeepSeekMTP loads, from the layout: used where vLLM is not installed.
        draft = sorted(layout.is_mtp | {"model.embed_tokens.weight"})
        synth.write_file(directory / DRAFT_NAMES, lambda f: f.write(json.dumps(draft).encode()))
        synth.write_file(stamp, lambda f: f.write(json.dumps(want).encode()))
    return directory


# --- the plan the strategies share -------------------------------------------------------


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def draft_plan(directory: Path) -> dict[str, Any]:
    """The draft's tensors by vLLM's draft class and rule (or, without vLLM, the layout's)."""
    from hybrid_draft import checkpoint, planning

    shards = checkpoint.read_checkpoint(directory)
    if vllm_available():
        from hybrid_draft.adapter import drafts

        draft = drafts.mtp_draft(str(directory))
        if draft.is_unused is None:
            raise SystemExit(f"{directory}: the draft class {draft.draft_class} has no rule")
        unused, draft_class, source = draft.is_unused, draft.draft_class, draft.rule_source
    else:  # e.g. a bare GPU machine: the names the layout recorded for DeepSeekMTP
        wanted = set(json.loads((directory / DRAFT_NAMES).read_text()))
        unused = lambda name: name not in wanted  # noqa: E731
        draft_class, source = "DeepSeekMTP", "layout"
    reads = planning.modes(shards, unused, None)
    kept = [(s, t) for s in shards for t in s.tensors if not unused(t.name)]
    ranges = [(str(s.path), t.start, t.end, t.name) for s, t in kept]
    meta = {t.name: (t.dtype, list(t.shape)) for _, t in kept}
    by_name = {s.name: str(s.path) for s in shards}
    return {
        "model_dir": str(directory),
        "draft_class": draft_class,
        "rule_source": source,
        "files_all": [str(s.path) for s in shards],
        "files_pruned": [by_name[n] for n in reads["lazy_pruned"].shards],
        "tensor_ranges": ranges,
        "meta": meta,
        "checkpoint": {
            "shards": len(shards),
            "tensors": sum(len(s.tensors) for s in shards),
            "bytes": sum(s.nbytes for s in shards),
            "draft_bytes": reads["selective"].nbytes,
            "draft_tensors": reads["selective"].tensors,
            "draft_shards": len(reads["selective"].shards),
        },
    }


# --- running and reporting ---------------------------------------------------------------


def run_strategy(name: str, shared: dict[str, Any], runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            **shared,
            "strategy": name,
            "runs": runs,
            "device": "cuda:0",
            "result_file": os.path.join(tmp, "result.json"),
        }
        spec_file = os.path.join(tmp, "spec.json")
        Path(spec_file).write_text(json.dumps(spec))
        subprocess.run(
            [sys.executable, "-m", "hybrid_draft.tools.bench.strategies", spec_file],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(Path(spec["result_file"]).read_text())


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    seconds = raw["seconds"]
    median = statistics.median(seconds)
    i = min(range(len(seconds)), key=lambda k: abs(seconds[k] - median))
    return {
        "seconds": seconds,
        "median_seconds": median,
        "min_seconds": min(seconds),
        "max_seconds": max(seconds),
        "bytes_read": raw["bytes_read"][i],
        "resident_bytes": raw["resident_bytes"][i],
        "peak_rss": raw["peak_rss"],
        **({"ran": raw["ran"]} if "ran" in raw else {}),
        "rss_before": raw["rss_before"],
        "cold": all(raw["cold"]),
        "gb_per_s": raw["bytes_read"][i] / median / 1e9 if median > 0 else 0.0,
    }


def _ratios(strategies: dict[str, dict[str, Any]], reference: str, base: str) -> None:
    ref = strategies.get(reference, {}).get("median_seconds")
    full = strategies.get(base, {}).get("median_seconds")
    for s in strategies.values():
        t = s["median_seconds"]
        s["vs_limit"] = t / ref if ref else None
        s["full_pass_speedup"] = full / t if full and t else None


def _fmt_bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 4 else f"{n / (1 << 20):.1f} MiB"


def table(result: dict[str, Any], key: str = "strategies") -> str:
    from hybrid_draft.tools import tables

    columns = [("strategy", "left")] + [
        (h, "right")
        for h in (
            "median s",
            "spread s",
            "GB/s",
            "bytes read",
            "resident",
            "peak RSS",
            "/ limit",
            "full /",
        )
    ]
    rows = []
    for name, s in result[key].items():
        rows.append(
            [
                name,
                f"{s['median_seconds']:.3f}",
                f"{s['min_seconds']:.3f}-{s['max_seconds']:.3f}",
                f"{s['gb_per_s']:.2f}",
                _fmt_bytes(s["bytes_read"]),
                _fmt_bytes(s["resident_bytes"]),
                _fmt_bytes(s["peak_rss"]),
                f"{s['vs_limit']:.2f}x" if s.get("vs_limit") else "-",
                f"{s['full_pass_speedup']:.1f}x" if s.get("full_pass_speedup") else "-",
            ]
        )
    notes = [
        f"({name} ran {s['ran']})"
        for name, s in result[key].items()
        if s.get("ran") and not s["ran"].startswith(_PRODUCT_FORMATS.get(name, name))
    ]
    return "\n".join([tables.render(columns, rows), *notes])


#: The load format each product strategy runs when nothing falls back.
_PRODUCT_FORMATS = {"auto": "safetensors_filtered", "selective": "instanttensor_selective"}


def chart(result: dict[str, Any], path: Path) -> bool:
    """Draw ``bench.png``; False (and nothing drawn) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [k for k in ("strategies", "gpu_strategies") if result.get(k)]
    fig, axes = plt.subplots(1, len(groups), figsize=(7 * len(groups), 4.2), squeeze=False)
    ck = result["checkpoint"]
    for ax, key in zip(axes[0], groups, strict=True):
        names = list(result[key])
        med = [result[key][n]["median_seconds"] for n in names]
        lo = [m - result[key][n]["min_seconds"] for n, m in zip(names, med, strict=True)]
        hi = [result[key][n]["max_seconds"] - m for n, m in zip(names, med, strict=True)]
        bars = ax.bar(
            names,
            med,
            yerr=[lo, hi],
            capsize=4,
            color=["#b0b0b0" if n in ("full_pass", "it_full") else "#3b7dd8" for n in names],
        )
        for bar, n in zip(bars, names, strict=True):
            s = result[key][n]
            ax.annotate(
                f"{_fmt_bytes(s['bytes_read'])}\n{s['gb_per_s']:.2f} GB/s",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_ylabel("seconds (median of cold runs; bars: min-max)")
        ax.set_title(
            f"{'GPU' if key == 'gpu_strategies' else 'CPU'} draft load, "
            f"{_fmt_bytes(ck['bytes'])} checkpoint, draft {_fmt_bytes(ck['draft_bytes'])}",
            fontsize=10,
        )
        ax.margins(y=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None
            )
        with open("/proc/meminfo") as f:
            info["memory_bytes"] = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return info


def main(args: argparse.Namespace) -> int:
    from hybrid_draft.tools import synth

    try:
        return _main(args)
    except (OSError, BenchError, synth.TargetError) as exc:
        from hybrid_draft import files

        if isinstance(exc, OSError) and exc.filename is not None:
            detail = f"{files.show_path(exc.filename)}: {exc.strerror or exc}"
        else:
            detail = files.one_line(str(exc))
        print(f"hybrid-draft bench: {detail}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    from hybrid_draft import checkpoint
    from hybrid_draft.tools.bench import startup
    from hybrid_draft.tools.bench.strategies import CPU_STRATEGIES, GPU_STRATEGIES

    if args.strategies is not None:
        chosen = [s.strip() for s in args.strategies.split(",") if s.strip()]
        unknown = sorted(set(chosen) - set(CPU_STRATEGIES) - set(GPU_STRATEGIES))
        if unknown or not chosen:
            raise BenchError(
                f"--strategies {args.strategies!r}: "
                + (f"unknown {', '.join(map(repr, unknown))}; " if unknown else "names none; ")
                + f"accepted: {', '.join(CPU_STRATEGIES + GPU_STRATEGIES)}"
            )
    gpu = startup.cuda_available()
    if args.strategies is None:
        chosen = [*CPU_STRATEGIES, *(GPU_STRATEGIES if gpu else ())]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    directory = Path(args.checkpoint or out / f"checkpoint-{args.size:g}GiB")
    prepare_checkpoint(directory, args.size)
    if not gpu:  # vLLM (here and in the workers, which inherit this) runs on its CPU platform
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        shared = draft_plan(directory)
    except checkpoint.CheckpointError as exc:
        raise BenchError(str(exc)) from None
    if not vllm_available():
        skipped = [s for s in chosen if s in NEEDS_VLLM]
        if skipped:
            print(f"vLLM is not installed here: skipping {', '.join(skipped)}", flush=True)
        chosen = [s for s in chosen if s not in NEEDS_VLLM]
    result: dict[str, Any] = {
        "checkpoint": shared["checkpoint"],
        "draft_class": shared["draft_class"],
        "rule_source": shared["rule_source"],
        "runs": args.runs,
        "machine": machine(),
        "strategies": {},
        "gpu_strategies": {},
    }
    for name in chosen:
        key = "gpu_strategies" if name in GPU_STRATEGIES else "strategies"
        print(f"running {name} ({args.runs} cold runs) ...", flush=True)
        result[key][name] = summarize(run_strategy(name, shared, args.runs))
    _ratios(result["strategies"], "limit", "full_pass")
    _ratios(result["gpu_strategies"], "it_selective", "it_full")
    if not result["gpu_strategies"]:
        del result["gpu_strategies"]
    if args.startup_runs:
        result["startup"] = startup.pth_cost(args.startup_runs)
    if args.hook_runs and vllm_available():
        result.setdefault("startup", {})["model_loader"] = startup.hook_cost(args.hook_runs)
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    drawn = chart(result, out / "bench.png")
    print_report(result)
    if drawn:
        print(f"\nwrote {out / 'bench.json'} and {out / 'bench.png'}")
    else:
        print(f"\nwrote {out / 'bench.json'}")
        print("the chart (bench.png) needs the `bench` extra: pip install 'hybrid-draft[bench]'")
    return 0


def print_report(result: dict[str, Any]) -> None:
    ck = result["checkpoint"]
    print(
        f"\ncheckpoint: {ck['shards']} shards, {ck['tensors']} tensors, "
        f"{_fmt_bytes(ck['bytes'])}; draft ({result['draft_class']}, rule: "
        f"{result['rule_source']}): {ck['draft_tensors']} tensors in {ck['draft_shards']} "
        f"shards, {_fmt_bytes(ck['draft_bytes'])} ({ck['draft_bytes'] / ck['bytes']:.1%})"
    )
    if result["strategies"]:
        print("\nCPU, cold page cache, median of", result["runs"], "runs:")
        print(table(result))
    if result.get("gpu_strategies"):
        print("\nGPU (CUDA), cold page cache:")
        print(table(result, "gpu_strategies"))
    st = result.get("startup", {})
    if "added_median" in st:
        print(
            f"\n.pth cost: python -c pass {st['python_c_pass']['median'] * 1e3:.1f} ms; "
            f"site with the layer {st['site_with_layer']['median'] * 1e3:.2f} ms, without "
            f"{st['site_without_layer']['median'] * 1e3:.2f} ms: "
            f"{st['added_median'] * 1e3:+.2f} ms (median of {st['python_c_pass']['runs']})"
        )
    if "model_loader" in st:
        ml = st["model_loader"]
        print(
            f"hook cost: importing vllm.model_executor.model_loader takes "
            f"{ml['model_loader_import']['median']:.2f} s; the hook adds "
            f"{ml['hook']['median'] * 1e3:.1f} ms (median of {ml['hook']['runs']}, "
            f"{ml['hook']['min'] * 1e3:.1f}-{ml['hook']['max'] * 1e3:.1f} ms)"
        )
