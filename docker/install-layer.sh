#!/bin/sh
# Install the hybrid-draft layer into an existing Python that already has vLLM.
#
#   docker/install-layer.sh PYTHON WHEEL [PINS]
#
# The Dockerfile runs this with the base image's Python; scripts/test runs it, unchanged,
# into the test virtual environment. It installs the wheel and the pinned InstantTensor
# with that Python's own installer (uv when the image has it, else pip), constrained to the
# packages already installed so the base's vLLM and torch never change, leaves no cache
# behind, and fails unless `hybrid-draft doctor` passes in that Python afterwards.
set -eu

PYTHON=${1:?usage: install-layer.sh PYTHON WHEEL [PINS]}
WHEEL=${2:?usage: install-layer.sh PYTHON WHEEL [PINS]}
PINS=${3:-$(dirname "$0")/../pins.txt}

pin() { sed -n "s/^$1==\([^ ;#]*\).*/\1/p" "$PINS" | head -n 1; }
INSTANTTENSOR_VERSION=${INSTANTTENSOR_VERSION:-$(pin instanttensor)}
[ -n "$INSTANTTENSOR_VERSION" ] || { echo "install-layer: no instanttensor pin in $PINS" >&2; exit 2; }

# An image's Python may be marked externally managed (PEP 668); installing into it is
# exactly what a derived image layer is for.
BREAK=""
if "$PYTHON" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; then
    BREAK=--break-system-packages
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Everything already installed is a constraint, so the layer adds and never upgrades;
# only the packages this script installs itself are left free.
constraints() {
    grep -E '^[A-Za-z0-9_.-]+==' | grep -v -i -E '^(hybrid[-_]draft|instanttensor)==' \
        > "$work/base.txt" || true
}
"$PYTHON" -m pip --version >/dev/null 2>&1 && HAVE_PIP=1 || HAVE_PIP=0
if command -v uv >/dev/null 2>&1; then
    uv pip freeze --python "$PYTHON" | constraints
    # shellcheck disable=SC2086
    uv pip install --python "$PYTHON" --no-cache $BREAK --constraint "$work/base.txt" \
        --reinstall-package hybrid-draft "instanttensor==$INSTANTTENSOR_VERSION" "$WHEEL"
elif [ "$HAVE_PIP" = 1 ]; then
    "$PYTHON" -m pip freeze --exclude-editable | constraints
    # shellcheck disable=SC2086
    pip_install() { "$PYTHON" -m pip install --quiet --no-cache-dir --disable-pip-version-check $BREAK "$@"; }
    pip_install --constraint "$work/base.txt" "instanttensor==$INSTANTTENSOR_VERSION" "$WHEEL"
    # A wheel of the same version as one already installed is skipped above: replace it.
    pip_install --no-deps --force-reinstall "$WHEEL"
else
    echo "install-layer: $PYTHON has neither uv nor pip" >&2
    exit 2
fi

# The layer must be active in this Python, in a fresh interpreter.
"$PYTHON" -m hybrid_draft doctor
