#!/usr/bin/env bash
# The GPU checks, as one prepared run on a lent GPU machine (the `device` tool: one H200,
# no network, its own Python with torch and safetensors but no vLLM). It runs the
# draft-load benchmark on a generated multi-GB checkpoint in DeepSeek-V3's proportions,
# cold, with the strategies a GPU adds: InstantTensor's full pass (it_full), selective
# (InstantTensor with tensor_filter over the draft's own tensors, it_selective), filtered
# lazy safetensors followed by a copy to the GPU (lazy_to_gpu) and one pass (it_one_pass:
# the full pass keeping the draft's tensors on the device, then the draft's buffers filled
# from them, beside the same pass untapped), next to the CPU-side reads (full_pass, limit;
# the product strategies need vLLM). It prints seconds, GB/s, bytes read and the device's
# peak memory for each and leaves bench.json and bench.png under $OUT/bench.
#
# Prepare here (InstantTensor is not on that machine; the wheel must match its Python 3.12):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl instanttensor==0.2.2
# Then run it there, carrying the wheels:
#   device run  command: "bash scripts/gpu-check.sh"  carry: [".whl"]  timeout_s: 540
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hybrid-draft-gpu}
SIZE=${SIZE:-8}
RUNS=${RUNS:-3}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hybrid-draft-site .whl/*.whl
export PYTHONPATH="$PWD/layer:/tmp/hybrid-draft-site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

python3 - <<'PY'
import torch, instanttensor, inspect
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("instanttensor tensor_filter:",
      "tensor_filter" in inspect.signature(instanttensor.safe_open).parameters)
PY

python3 -m hybrid_draft bench --size "$SIZE" --runs "$RUNS" --out "$OUT/bench" \
    --checkpoint /tmp/hybrid-draft-bench-ckpt \
    --strategies full_pass,limit,it_full,it_selective,lazy_to_gpu,it_one_pass \
    --startup-runs 0 --hook-runs 0
