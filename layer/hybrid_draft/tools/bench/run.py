"""``hybrid-draft bench``: what a draft load costs under each strategy, cold, against the
storage's physical limit, plus the layer's start-up cost. Prints a table, writes
``OUT/bench.json`` and ``OUT/bench.png``. A benchmark, not a test: it asserts nothing.

The checkpoint is a synthetic DeepSeek-V3 export in DeepSeek-V3's own proportions: 61
layers and one MTP layer (MLA attention, routed and shared experts), and an embedding, LM
head, MTP embedding and MTP shared head each as large a share of the bytes as in the real
checkpoint (its ``config.json`` and index: 17.28 of 688.6 GB are the draft's, 5.56 GB of
those the three tensors vLLM replaces with the target's). Tensors of 1 to 16 MiB, shards
of about 1 GiB. The draft's tensors are those ``DeepSeekMTP`` loads, by the rule
hybrid-draft installs; ``proportions`` in ``bench.json`` gives both sets of shares.
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

from hybrid_draft.tools.bench import pagecache

GIB = 1 << 30
LAYOUT_VERSION = 3
#: The strategies that run vLLM's own code (stock vLLM's reads, the other formats' target
#: loaders): skipped, saying so, where vLLM cannot be imported. The product's run without.
NEEDS_VLLM = (
    "lazy",
    "lazy_pruned",
    "fastsafetensors_one_pass",
    "runai_stock",
    "runai_one_pass",
    "runai_s3_stock",
    "runai_s3_one_pass",
)
#: The library each format's strategies read with (its strategies are skipped, saying so,
#: where it does not import).
NEEDS_MODULE = {
    "fastsafetensors_": "fastsafetensors",
    "runai_": "runai_model_streamer",
    "runai_s3_": "runai_model_streamer_s3",
    "it_": "instanttensor",
}
#: The bucket the checkpoint is uploaded to with --s3-endpoint.
S3_BUCKET = "hybrid-draft-bench"


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
        "--s3-endpoint",
        default=None,
        metavar="URL",
        help="an S3-compatible endpoint: the checkpoint is uploaded there once and the Run:ai "
        "strategies also run against it (runai_s3_*); credentials from the environment "
        "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...)",
    )
    p.add_argument(
        "--s3-bucket",
        default=S3_BUCKET,
        help=f"the bucket for --s3-endpoint (default {S3_BUCKET}; created if missing)",
    )
    p.add_argument(
        "--without-vllm",
        action="store_true",
        help="run as where vLLM is not installed: vLLM is made unimportable in this process "
        "and its workers, so the product's strategies run its core alone (what "
        "scripts/gpu-check.sh runs)",
    )
    p.add_argument(
        "--startup-runs",
        type=types.integer(0, 100_000),
        default=40,
        help="interpreter starts per variant for the .pth cost (0 skips)",
    )
    p.add_argument(
        "--weight-update",
        type=types.at_most(types.positive, MAX_SIZE_GIB),
        nargs="?",
        const=0.5,
        default=None,
        metavar="GIB",
        help="instead of the load strategies: one training step's weight sync, the draft "
        "updated by vLLM's own draft session or by the target's session alone, on a served "
        "model of GIB GiB (default 0.5; needs a vLLM that serves on this host); writes "
        "OUT/weight-update.json",
    )
    p.add_argument(
        "--hook-runs",
        type=types.integer(0, 10_000),
        default=3,
        help="fresh processes timing the model-loader hook (0 skips)",
    )


# --- the checkpoint ---------------------------------------------------------------------


#: The model whose proportions the checkpoint copies, and the synth preset of its layout.
MODEL = "DeepSeek-V3"


def shares(layout: Any) -> dict[str, float]:
    """A DeepSeek-V3 layout's shares of the checkpoint's bytes: the draft's own tensors
    (its MTP layer but the embedding and shared head) and each replaced one."""
    from hybrid_draft.core.planning import shared_kind

    draft = set(layout.is_mtp) | {"model.embed_tokens.weight"}
    sizes = {t.name: t.nbytes for t in layout.tensors}
    replaced = [n for n in draft if shared_kind(n)]
    return {
        "draft": sum(sizes[n] for n in draft) / layout.nbytes,
        "own": sum(sizes[n] for n in draft if n not in replaced) / layout.nbytes,
        "replaced": sum(sizes[n] for n in replaced) / layout.nbytes,
        "replaced_tensors": len(replaced),
    }


def _dims(hidden: int, moe: int, vocab: int) -> dict[str, Any]:
    """DeepSeek-V3's structure at another width: its 61 layers, 3 of them dense, MLA ranks
    and dense width in its ratios to the hidden size, 8 routed experts of width ``moe``."""
    return dict(
        hidden_size=hidden,
        vocab_size=vocab,
        intermediate_size=hidden * 18432 // 7168,
        moe_intermediate_size=moe,
        num_hidden_layers=61,
        num_attention_heads=max(1, hidden // 128),
        q_lora_rank=max(16, hidden * 1536 // 7168),
        kv_lora_rank=max(16, hidden * 512 // 7168),
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=3,
    )


def synth_full() -> Any:
    from hybrid_draft.tools import synth

    return synth.deepseek_v3("full", fp8=True)


def bench_layout(size_bytes: int) -> Any:
    """A DeepSeek-V3 layout of about ``size_bytes`` in the real checkpoint's proportions:
    the expert width sets the size, the vocabulary the replaced tensors' share."""
    from hybrid_draft.tools import synth

    real = shares(synth_full())
    per_embedding = real["replaced"] / real["replaced_tensors"]
    for hidden in (2048, 1024, 512, 256, 128):
        vocab = max(64, round(per_embedding * size_bytes / (hidden * 2)))
        small = synth.deepseek_v3("tiny", **_dims(hidden, 16, vocab)).nbytes
        large = synth.deepseek_v3("tiny", **_dims(hidden, 32, vocab)).nbytes
        moe = round(16 + 16 * (size_bytes - small) / (large - small))
        if moe >= 16 or hidden == 128:
            return synth.deepseek_v3("tiny", **_dims(hidden, max(16, moe // 16 * 16), vocab))
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
    from hybrid_draft.tools.bench.strategies import DRAFT_NAMES

    stamp = directory / "bench-layout.json"
    want = {"size_gib": size_gib, "version": LAYOUT_VERSION}
    found = _stamp(directory)
    if isinstance(found, dict) and found.items() >= want.items():
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
        stamped = {**want, "shares": shares(layout)}
        synth.write_file(stamp, lambda f: f.write(json.dumps(stamped).encode()))
    return directory


# --- the plan the strategies share -------------------------------------------------------


def draft_plan(directory: Path) -> dict[str, Any]:
    """What the strategies share of the draft's plan (``strategies.bench_plan``: the
    product's own with vLLM, else one from the names the layout recorded)."""
    from hybrid_draft.tools import modes
    from hybrid_draft.tools.bench.strategies import bench_plan

    plan = bench_plan(str(directory))
    if plan.is_unused is None:
        raise BenchError(f"{directory}: the draft class {plan.draft_class} has no rule")
    reads = modes.rows(plan)
    own = [t for t in plan.kept if t.name not in plan.replaced]
    paths = {t.name: str(s.path) for s in plan.shards for t in s.tensors}
    by_name = {s.name: str(s.path) for s in plan.shards}
    return {
        "model_dir": str(directory),
        "draft_class": plan.draft_class,
        "rule_source": plan.rule_source,
        "files_all": [str(s.path) for s in plan.shards],
        "files_pruned": [by_name[n] for n in reads["lazy_pruned"].shards],
        "files_own": [by_name[n] for n in reads["auto"].shards],
        # (path, start, end, name) of every tensor the draft reads (all it keeps but the
        # replaced ones), and the shapes of every tensor it keeps
        "tensor_ranges": [(paths[t.name], t.start, t.end, t.name) for t in own],
        "kept_ranges": [(paths[t.name], t.start, t.end, t.name) for t in plan.kept],
        "replaced": sorted(plan.replaced),
        "meta": {t.name: (t.dtype, list(t.shape)) for t in plan.kept},
        "checkpoint": {
            "shards": len(plan.shards),
            "tensors": plan.all_tensors,
            "bytes": plan.all_bytes,
            "draft_bytes": sum(t.nbytes for t in plan.kept),
            "draft_tensors": len(plan.kept),
            "draft_shards": len(reads["lazy_pruned"].shards),
            "own_bytes": sum(t.nbytes for t in own),
            "own_tensors": len(own),
            "replaced_bytes": sum(t.nbytes for t in plan.kept) - sum(t.nbytes for t in own),
            "replaced_tensors": len(plan.replaced),
        },
    }


# --- running and reporting ---------------------------------------------------------------


class StrategyFailed(RuntimeError):
    """A strategy's worker ended without its result (its own error is on stderr above)."""


def run_strategy(
    name: str,
    shared: dict[str, Any],
    runs: int,
    s3: dict[str, Any] | None = None,
    device: str = "cpu",
    without_vllm: bool = False,
) -> dict[str, Any]:
    """Run one strategy in a worker process; ``s3`` (``{"uri", "files"}``: the checkpoint's
    address and each shard's) for those that read it from object storage; ``device`` where
    the product's strategies put the draft's tensors."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            **shared,
            "strategy": name,
            "runs": runs,
            "device": device,
            "without_vllm": without_vllm,
            "result_file": os.path.join(tmp, "result.json"),
            **({"s3": s3} if s3 is not None else {}),
        }
        spec_file = os.path.join(tmp, "spec.json")
        Path(spec_file).write_text(json.dumps(spec))
        pagecache.settle()  # nothing this process started runs beside the worker
        done = subprocess.run(
            [sys.executable, "-m", "hybrid_draft.tools.bench.strategies", spec_file],
            stdout=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise StrategyFailed(f"its worker exited with status {done.returncode}")
        result: dict[str, Any] = json.loads(Path(spec["result_file"]).read_text())
        return result


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    seconds = raw["seconds"]
    median = statistics.median(seconds)
    i = min(range(len(seconds)), key=lambda k: abs(seconds[k] - median))
    out = {
        "seconds": seconds,
        "median_seconds": median,
        "min_seconds": min(seconds),
        "max_seconds": max(seconds),
        "bytes_read": raw["bytes_read"][i],
        "resident_bytes": raw["resident_bytes"][i],
        "peak_rss": raw["peak_rss"],
        **({"ran": raw["ran"]} if "ran" in raw else {}),
        # where the draft's tensors went: a CUDA device, or the CPU
        "device": raw.get("device", "cpu"),
        "rss_before": raw["rss_before"],
        "cold": all(raw["cold"]),
        # from storage; for a strategy against object storage, over the wire
        "gb_per_s": raw.get("network_bytes", raw["bytes_read"])[i] / median / 1e9
        if median > 0
        else 0.0,
        "warmup_seconds": raw.get("warmup_seconds"),
    }
    if "target_seconds" in raw:  # one pass: the target's pass and the draft's load apart
        tapped = statistics.median(raw["target_seconds"])
        untapped = statistics.median(raw["untapped_target_seconds"])
        out.update(
            draft_seconds=median,
            draft_bytes_read=raw["bytes_read"][i],
            target_seconds=raw["target_seconds"],
            untapped_target_seconds=raw["untapped_target_seconds"],
            median_target_seconds=tapped,
            median_untapped_target_seconds=untapped,
            tap_overhead=tapped / untapped - 1 if untapped > 0 else None,
            held_bytes=max(raw["held_bytes"]),
        )
    if raw.get("peak_device_bytes"):
        out["peak_device_bytes"] = max(raw["peak_device_bytes"])
    for key in _NETWORK_KEYS:  # object storage: what crossed the wire, per run
        if key in raw:
            out[key] = raw[key]
    return out


#: The per-run figures of the strategies against object storage: the draft's load (and,
#: for one pass, the target's tapped pass) as the socket reads counted it (``rchar``) and as
#: the product counted it (tensor bytes; None where the product's path did not run).
_NETWORK_KEYS = (
    "network_bytes",
    "product_network_bytes",
    "target_network_bytes",
    "target_product_network_bytes",
)


def _median_run(s: dict[str, Any]) -> int:
    seconds = s["seconds"]
    return min(range(len(seconds)), key=lambda k: abs(seconds[k] - s["median_seconds"]))


def _ratios(
    rows: dict[str, dict[str, Any]],
    strategies: dict[str, dict[str, Any]],
    reference: str,
    base: str,
) -> None:
    """Each of ``rows`` against ``strategies``' ``reference`` (the floor) and ``base``."""
    ref = strategies.get(reference, {}).get("median_seconds")
    full = strategies.get(base, {}).get("median_seconds")
    for s in rows.values():
        t = s["median_seconds"]
        s["vs_limit"] = t / ref if ref else None
        s["full_pass_speedup"] = full / t if full and t else None


def reload_costs(strategies: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What each strategy adds to the target's own reload in place (vLLM's
    ``reload_weights``, after a level-2 sleep or with a new checkpoint): a draft's reload
    reads what its first load reads, by the same code (``core/draftload`` through the same
    loader), so a strategy's draft load is also what its reload adds; a one-pass strategy
    adds its draft's load and its tap's cost on the target's pass. ``full_pass`` is what a
    reload of the draft through the target's load format (a second pass) adds. Each row:
    ``added_seconds``, ``added_bytes`` (from storage; for a strategy against object storage,
    over the wire) and their shares of ``full_pass``'s."""
    full = strategies.get("full_pass")
    out: dict[str, dict[str, Any]] = {}
    for name, s in strategies.items():
        i = _median_run(s)
        seconds = s["median_seconds"]
        if "tap_overhead" in s:
            seconds += s["median_target_seconds"] - s["median_untapped_target_seconds"]
        moved = s["network_bytes"][i] if "network_bytes" in s else s["bytes_read"]
        row: dict[str, Any] = {"added_seconds": seconds, "added_bytes": moved}
        if full is not None and name != "full_pass":
            row["vs_full_pass_seconds"] = (
                seconds / full["median_seconds"] if full["median_seconds"] else None
            )
            row["vs_full_pass_bytes"] = moved / full["bytes_read"] if full["bytes_read"] else None
        out[name] = row
    return out


def reload_table(result: dict[str, Any]) -> str:
    from hybrid_draft.tools import tables

    columns = [("strategy", "left"), ("added s", "right"), ("added bytes", "right")]
    columns += [("s / full pass", "right"), ("bytes / full pass", "right")]
    rows = []
    for name, r in result["reload"].items():
        share_s, share_b = r.get("vs_full_pass_seconds"), r.get("vs_full_pass_bytes")
        rows.append(
            [
                name,
                f"{r['added_seconds']:+.3f}",
                _fmt_bytes(r["added_bytes"]),
                f"{share_s:.1%}" if share_s is not None else "-",
                f"{share_b:.1%}" if share_b is not None else "-",
            ]
        )
    return tables.render(columns, rows)


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
    network = any("network_bytes" in s for s in result[key].values())
    if network:
        columns.insert(5, ("network", "right"))
    onto = any(s.get("device", "cpu") != "cpu" for s in result[key].values())
    if onto:  # where the draft's tensors went, and the device's peak for them
        columns[1:1] = [("onto", "left")]
        columns.append(("device peak", "right"))
    rows = []
    for name, s in result[key].items():
        row = [
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
        if network:
            row.insert(
                5,
                _fmt_bytes(s["network_bytes"][_median_run(s)]) if "network_bytes" in s else "-",
            )
        if onto:
            row.insert(1, s.get("device", "cpu"))
            peak = s.get("peak_device_bytes")
            row.append(_fmt_bytes(peak) if peak else "-")
        rows.append(row)
    notes = [
        f"({name} ran {s['ran']})"
        for name, s in result[key].items()
        if s.get("ran") and not s["ran"].startswith(_PRODUCT_FORMATS.get(name, name))
    ]
    return "\n".join([tables.render(columns, rows), *notes])


#: The load format each product strategy runs when nothing falls back.
_PRODUCT_FORMATS = {
    "auto": "safetensors_filtered",
    "selective": "instanttensor_selective",
    "fastsafetensors_filtered": "fastsafetensors_filtered",
    "runai_filtered": "runai_streamer_filtered",
    "runai_s3_filtered": "runai_streamer_filtered",
}


def _colour(name: str) -> str:
    """Grey for the full pass, light blue for stock vLLM's paths, orange against object
    storage, blue for the rest (the product's paths and the floor)."""
    if name in ("full_pass", "it_full"):
        return "#b0b0b0"
    if name.startswith("runai_s3_"):
        return "#e08a3b"
    if name in ("lazy", "lazy_pruned") or name.endswith("_stock"):
        return "#9cbce8"
    return "#3b7dd8"


def chart(result: dict[str, Any], path: Path) -> bool:
    """Draw ``bench.png``; False (and nothing drawn) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [k for k in ("strategies", "gpu_strategies") if result.get(k)]
    widths = [max(7.0, 0.8 * len(result[k]) + 2) for k in groups]
    fig, axes = plt.subplots(
        1,
        len(groups),
        figsize=(sum(widths), 5.2),
        squeeze=False,
        gridspec_kw={"width_ratios": widths},
    )
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
            color=[_colour(n) for n in names],
        )
        for bar, n in zip(bars, names, strict=True):
            s = result[key][n]
            moved = (
                f"{_fmt_bytes(s['network_bytes'][_median_run(s)])} net"
                if "network_bytes" in s
                else _fmt_bytes(s["bytes_read"])
            )
            ax.annotate(
                f"{moved}\n{s['gb_per_s']:.2f} GB/s",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_ylabel("seconds (median of cold runs; bars: min-max)")
        ax.tick_params(axis="x", labelrotation=40, labelsize=8)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
        devices = sorted({result[key][n].get("device", "cpu") for n in names} - {"cpu"})
        where = "stock InstantTensor" if key == "gpu_strategies" else "draft load"
        ax.set_title(
            f"{where} ({', '.join(devices) or 'CPU'}), "
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


def _with_s3(chosen: list[str], s3: bool) -> list[str]:
    """``chosen`` with, under ``--s3-endpoint``, each Run:ai strategy's object-storage
    variant after the last local one (``runai_stock`` -> ``runai_s3_stock``...)."""
    from hybrid_draft.tools.bench.strategies import S3_STRATEGIES

    if not s3:
        return chosen
    extra = [
        v for v in S3_STRATEGIES if v.replace("runai_s3_", "runai_") in chosen and v not in chosen
    ]
    last = max((i for i, n in enumerate(chosen) if n.startswith("runai_")), default=len(chosen) - 1)
    return chosen[: last + 1] + extra + chosen[last + 1 :]


def _missing_module(name: str) -> str | None:
    """The library strategy ``name`` reads with, where it does not import here."""
    import importlib

    for prefix, module in NEEDS_MODULE.items():
        if name.startswith(prefix):
            try:
                importlib.import_module(module)
            except Exception:  # absent, or its native part does not load here
                return module
    return None


def _main(args: argparse.Namespace) -> int:
    from hybrid_draft.tools.bench import s3 as objectstore
    from hybrid_draft.tools.bench import startup
    from hybrid_draft.tools.bench.strategies import (
        CPU_STRATEGIES,
        GPU_STRATEGIES,
        S3_STRATEGIES,
        block_vllm,
        vllm_available,
    )

    if args.weight_update is not None:
        return _weight_update(args)
    if args.without_vllm:
        block_vllm()
    # vLLM's import would start background kernel builds in this process and in every
    # worker, beside the timed runs (pagecache.settle); the workers inherit this.
    os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")

    accepted = CPU_STRATEGIES + S3_STRATEGIES + GPU_STRATEGIES
    if args.strategies is not None:
        chosen = [s.strip() for s in args.strategies.split(",") if s.strip()]
        unknown = sorted(set(chosen) - set(accepted))
        if unknown or not chosen:
            raise BenchError(
                f"--strategies {args.strategies!r}: "
                + (f"unknown {', '.join(map(repr, unknown))}; " if unknown else "names none; ")
                + f"accepted: {', '.join(accepted)}"
            )
        on_s3 = [n for n in chosen if n in S3_STRATEGIES]
        if on_s3 and args.s3_endpoint is None:
            raise BenchError(
                f"--strategies {args.strategies!r}: {', '.join(on_s3)} read from object "
                "storage: name its endpoint with --s3-endpoint URL"
            )
    try:
        endpoint = objectstore.check_endpoint(args.s3_endpoint) if args.s3_endpoint else None
    except objectstore.S3Error as exc:
        raise BenchError(str(exc)) from None
    gpu = startup.cuda_available()
    device = "cuda:0" if gpu else "cpu"  # where the product's strategies put the draft
    if args.strategies is None:
        chosen = [*CPU_STRATEGIES, *(GPU_STRATEGIES if gpu else ())]
    chosen = _with_s3(chosen, endpoint is not None)
    bucket = None
    if endpoint is not None and not any(n in S3_STRATEGIES for n in chosen):
        print("--s3-endpoint: no runai_* strategy chosen, so none runs against it", flush=True)
    if endpoint is not None and any(n in S3_STRATEGIES for n in chosen):
        try:  # reached (a bounded wait) before anything is written or run
            bucket = objectstore.Bucket(endpoint, args.s3_bucket)
        except objectstore.S3Error as exc:
            raise BenchError(str(exc)) from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    directory = Path(args.checkpoint or out / f"checkpoint-{args.size:g}GiB")
    prepare_checkpoint(directory, args.size)
    if not gpu:  # vLLM (here and in the workers, which inherit this) runs on its CPU platform
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        shared = draft_plan(directory)
    except ValueError as exc:  # CheckpointError, PlanError: one line naming the file
        raise BenchError(str(exc)) from None
    if not vllm_available():
        skipped = [s for s in chosen if s in NEEDS_VLLM]
        if skipped:
            why = "made unimportable (--without-vllm)" if args.without_vllm else "not installed"
            print(f"vLLM is {why} here: skipping {', '.join(skipped)}", flush=True)
        chosen = [s for s in chosen if s not in NEEDS_VLLM]
    if not gpu:
        skipped = [s for s in chosen if s in GPU_STRATEGIES]
        if skipped or "selective" in chosen:
            print(
                "CUDA is not available here: the GPU rows need it"
                + (
                    f"; skipping {', '.join(skipped)} (InstantTensor reads onto CUDA only)"
                    if skipped
                    else ""
                )
                + (
                    "; selective runs the path it falls back to, auto's"
                    if "selective" in chosen
                    else ""
                )
                + "; the product's rows read onto the CPU",
                flush=True,
            )
        chosen = [s for s in chosen if s not in GPU_STRATEGIES]
    missing: dict[str, list[str]] = {}
    for name in chosen:
        module = _missing_module(name)
        if module is not None:
            missing.setdefault(module, []).append(name)
    for module, names in missing.items():
        print(f"{module} is not installed here: skipping {', '.join(names)}", flush=True)
        chosen = [s for s in chosen if s not in names]
    s3_spec: dict[str, Any] | None = None
    s3_info: dict[str, Any] | None = None
    if bucket is not None and endpoint is not None and any(n in S3_STRATEGIES for n in chosen):
        stamp = json.loads((directory / "bench-layout.json").read_text())
        prefix = f"checkpoint-{stamp['size_gib']:g}GiB-v{stamp['version']}"
        print(f"uploading the checkpoint to s3://{args.s3_bucket}/{prefix} ...", flush=True)
        try:
            s3_info = bucket.upload(prefix, directory)
        except objectstore.S3Error as exc:
            raise BenchError(str(exc)) from None
        s3_spec = {
            "uri": s3_info["uri"],
            "files": {f: f"{s3_info['uri']}/{Path(f).name}" for f in shared["files_all"]},
        }
        os.environ.update(objectstore.client_environment(endpoint))  # the workers'
    result: dict[str, Any] = {
        "checkpoint": shared["checkpoint"],
        "draft_class": shared["draft_class"],
        "rule_source": shared["rule_source"],
        "proportions": {
            "model": MODEL,
            "real": shares(synth_full()),
            "synthetic": json.loads((directory / "bench-layout.json").read_text()).get("shares"),
        },
        "runs": args.runs,
        "machine": machine(),
        "strategies": {},
        "gpu_strategies": {},
    }
    if s3_info is not None:
        result["s3"] = s3_info
    failed: dict[str, str] = {}
    for name in chosen:
        key = "gpu_strategies" if name in GPU_STRATEGIES else "strategies"
        print(f"running {name} ({args.runs} cold runs) ...", flush=True)
        s3 = s3_spec if name in S3_STRATEGIES else None
        try:
            raw = run_strategy(name, shared, args.runs, s3, device, args.without_vllm)
        except StrategyFailed as exc:  # the rest still run; the status says so at the end
            print(f"{name} failed: {exc} (its error is above)", flush=True)
            failed[name] = str(exc)
            continue
        result[key][name] = summarize(raw)
    for key in ("strategies", "gpu_strategies"):
        _ratios(result[key], result["strategies"], "limit", "full_pass")
    result["reload"] = reload_costs(result["strategies"])
    if not result["gpu_strategies"]:
        del result["gpu_strategies"]
    if failed:
        result["failed"] = failed
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
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _weight_update(args: argparse.Namespace) -> int:
    """``--weight-update``: the sessions' benchmark (``tools/bench/sessions.py``)."""
    from hybrid_draft.tools.bench import sessions
    from hybrid_draft.tools.bench.strategies import vllm_available

    if args.without_vllm or not vllm_available():
        raise BenchError("--weight-update serves a model with vLLM, which is not importable here")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        return sessions.main(out, args.weight_update, args.runs)
    except sessions.Unservable as exc:
        raise BenchError(str(exc)) from None


def print_report(result: dict[str, Any]) -> None:
    ck = result["checkpoint"]
    print(
        f"\ncheckpoint: {ck['shards']} shards, {ck['tensors']} tensors, "
        f"{_fmt_bytes(ck['bytes'])}; draft ({result['draft_class']}, rule: "
        f"{result['rule_source']}): {ck['draft_tensors']} tensors in {ck['draft_shards']} "
        f"shards, {_fmt_bytes(ck['draft_bytes'])} ({ck['draft_bytes'] / ck['bytes']:.1%}), "
        f"of which vLLM replaces {ck['replaced_tensors']} ({_fmt_bytes(ck['replaced_bytes'])})"
        f" and the draft reads {_fmt_bytes(ck['own_bytes'])}"
    )
    if result["strategies"]:
        devices = sorted({s.get("device", "cpu") for s in result["strategies"].values()} - {"cpu"})
        where = f"CPU reads, the product's rows onto {', '.join(devices)}" if devices else "CPU"
        print(f"\n{where}, cold page cache, median of", result["runs"], "runs:")
        print(table(result))
    if result.get("gpu_strategies"):
        print("\nstock InstantTensor (CUDA), cold page cache, median of", result["runs"], "runs:")
        print(table(result, "gpu_strategies"))
    if result.get("reload"):
        print(
            "\na reload in place: what the draft adds to the target's own reload (its draft's "
            "load; one pass: with the tap's cost), against a second full pass:"
        )
        print(reload_table(result))
    for name, s in (result.get("strategies") or {}).items():
        if "network_bytes" in s:
            i = _median_run(s)
            product = s["product_network_bytes"][i]
            print(
                f"{name}: the draft's load received {_fmt_bytes(s['network_bytes'][i])} "
                "over the wire (socket reads, rchar; median run), "
                + (
                    "stock vLLM's path: no count of the product's"
                    if name.endswith("_stock")
                    else f"{_fmt_bytes(product or 0)} of tensors by the product's count"
                )
                + (
                    f"; the target's pass {_fmt_bytes(s['target_network_bytes'][0])}"
                    if s.get("target_network_bytes")
                    else ""
                )
            )
    for key in ("strategies", "gpu_strategies"):
        for name, s in (result.get(key) or {}).items():
            if "tap_overhead" in s:
                print(
                    f"{name}: the draft's load {s['draft_seconds']:.3f} s, "
                    f"{_fmt_bytes(s['draft_bytes_read'])} from storage, "
                    f"{_fmt_bytes(s['held_bytes'])} held; the target's pass "
                    f"{s['median_target_seconds']:.3f} s tapped, "
                    f"{s['median_untapped_target_seconds']:.3f} s untapped "
                    f"({s['tap_overhead']:+.1%})"
                    + (
                        f"; device peak {_fmt_bytes(s['peak_device_bytes'])}"
                        if "peak_device_bytes" in s
                        else ""
                    )
                )
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
        if "first_load_setup" in ml:
            first = ml["first_load_setup"]
            print(
                f"first load: what the hook leaves to it (the load path, plan and readers "
                f"imported, the parts installed, structlog) costs {first['median'] * 1e3:.1f} ms "
                f"(median of {first['runs']})"
            )
