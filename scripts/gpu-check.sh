#!/usr/bin/env bash
# The GPU check: the product's own draft loads timed on a GPU, as one prepared run on a lent
# machine (the `device` tool: one H200, 16 cores, Python 3.12 with torch, no vLLM, no
# network). It runs `hybrid-draft bench --without-vllm` on a generated checkpoint in
# DeepSeek-V3's proportions (SIZE GiB), every run cold, with the product's code alone (its
# core: the draft's plan from the shard headers and the names the layout recorded, read by
# core.draftload with the format's reader of core.readers):
#   auto                      filtered safetensors (core.readers.lazy_filtered_iterator),
#                             each tensor copied into a CUDA tensor as vLLM's load_weights does
#   selective                 InstantTensor with tensor_filter, its buffer and I/O depth sized
#                             to the draft (core.readers.instanttensor_selective_iterator)
#   one_pass                  the target's full InstantTensor pass onto CUDA, each tensor
#                             offered to the product's Hold, then the draft from the hold;
#                             beside the same pass untapped
#   fastsafetensors_filtered, runai_filtered   where fastsafetensors / runai-model-streamer
#                             import there (skipped, saying so, where not)
#   it_full, it_selective     stock InstantTensor: the full pass a draft load makes without the
#                             layer, and tensor_filter with InstantTensor's own sizing
#   full_pass, limit          every byte of the checkpoint, and exactly the draft's byte
#                             ranges, read on the CPU: the storage's figures
# It prints seconds, GB/s, bytes read and the device's peak memory for each, and leaves
# bench.json and bench.png under $OUT/bench. At SIZE=8 RUNS=3 on the H200, about 3 minutes
# by the figures of 2026-12-04 (the passes: 4 of full_pass, 7 of one_pass, 4 of it_full; the
# rest small), the checkpoint's writing and a Python start per strategy included.
#
# Without CUDA (CI runs it so on the CPU: tests/test_gpu_check.py) it says the GPU rows need
# CUDA and runs the same code with CPU tensors, one_pass tapping a stream that reads each
# shard whole in InstantTensor's stead.
#
# Prepare here, once: the wheels the machine may lack, for its Python 3.12, in the git-ignored
# .whl/ (53,283,327 bytes, 50.8 MiB, of the 64 MiB a run may carry). The core needs structlog,
# tqdm and numpy; InstantTensor runs selective, one_pass and it_*; fastsafetensors and
# runai-model-streamer (with humanize) their rows; rich draws the table, matplotlib (with its
# dependencies) the chart. There, only the distributions its Python lacks are installed.
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl \
#       instanttensor==0.2.2 structlog==26.1.0 tqdm==4.70.1 numpy==2.3.5 \
#       fastsafetensors==0.5.0 runai-model-streamer==0.17.1 humanize==4.17.0 \
#       rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 \
#       matplotlib==3.11.2 contourpy==1.4.0 cycler==0.12.1 fonttools==4.68.0 \
#       kiwisolver==1.5.1 packaging==26.4 pillow==13.0.0 pyparsing==3.3.3 \
#       python-dateutil==4.0.0 six==1.17.0
#   du -cb .whl/*.whl | tail -1      # at most 67,108,864
# Then run it there, carrying the wheels:
#   device run  command: "bash scripts/gpu-check.sh"  carry: [".whl"]  timeout_s: 420
#
# Settings (environment): OUT (/tmp/hybrid-draft-gpu), SIZE (8, GiB), RUNS (3), CHECKPOINT
# (/tmp/hybrid-draft-bench-ckpt, reused), PYTHON (python3), WHEELS (.whl; empty: install
# nothing), SITE (/tmp/hybrid-draft-site, where the missing wheels are installed).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hybrid-draft-gpu}
SIZE=${SIZE:-8}
RUNS=${RUNS:-3}
CHECKPOINT=${CHECKPOINT:-/tmp/hybrid-draft-bench-ckpt}
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS-.whl}
SITE=${SITE:-/tmp/hybrid-draft-site}

if [ -n "$WHEELS" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
    # Only what this Python lacks: a distribution it has (numpy, say) is left as it is.
    mapfile -t missing < <("$PYTHON" - "$WHEELS"/*.whl <<'PY'
import importlib.metadata
import os
import sys

for path in sys.argv[1:]:
    try:
        importlib.metadata.version(os.path.basename(path).split("-")[0])
    except importlib.metadata.PackageNotFoundError:
        print(path)
PY
    )
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "installing into $SITE what this Python lacks: ${missing[*]##*/}"
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" "${missing[@]}"
    fi
fi
export PYTHONPATH="$PWD/layer:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

"$PYTHON" - <<'PY'
import importlib
import importlib.metadata
import importlib.util
import platform

import torch

print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name(0)}")
else:
    print("CUDA is not available here: the GPU rows (selective's InstantTensor read, it_full, "
          "it_selective) need it; the product's rows run with CPU tensors")
for name in ("instanttensor", "fastsafetensors", "runai_model_streamer", "numpy", "tqdm",
             "structlog", "rich", "matplotlib"):
    try:
        importlib.import_module(name)
        print(f"{name} {importlib.metadata.version(name.replace('_', '-'))}")
    except Exception as exc:  # absent, or its native part does not load here
        print(f"{name}: does not import ({type(exc).__name__}: {exc})")
print("vllm:", "installed, made unimportable for the run" if importlib.util.find_spec("vllm")
      else "not installed")
try:
    import instanttensor

    from hybrid_draft.core import readers

    print("selective passes safe_open:",
          sorted(readers.selective_sizing([1 << 20], instanttensor.safe_open)) or "no sizing")
except Exception as exc:
    print(f"selective's sizing: {type(exc).__name__}: {exc}")
PY

"$PYTHON" -m hybrid_draft bench --without-vllm --size "$SIZE" --runs "$RUNS" \
    --out "$OUT/bench" --checkpoint "$CHECKPOINT" \
    --strategies full_pass,limit,auto,selective,one_pass,fastsafetensors_filtered,runai_filtered,it_full,it_selective \
    --startup-runs 0 --hook-runs 0
