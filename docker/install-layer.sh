#!/bin/sh
# Install the hybrid-draft layer into an existing Python that already has vLLM.
#
#   docker/install-layer.sh [--offline WHEELS_DIR] PYTHON WHEEL [PINS]
#
# The one installer of the layer: the Dockerfile runs it with the base image's Python,
# scripts/test into the test environment, and the mod form's run.sh (scripts/make-mod)
# inside a running container, from the wheels it carries (--offline: no index at all).
#
# What it does, in this order:
#   1. refuses, with one line, a vLLM whose get_model the spark-vllm mod
#      instanttensor-hybrid-draft-loader has text-patched (the layer replaces that mod and
#      never stacks a second wrapper on it), and a site-packages this user cannot write;
#   2. installs the wheel, and InstantTensor only where the Python has none, with that
#      Python's installer (uv when there is one, else pip), constrained to EVERY
#      distribution the Python already has, at the version it has (read with
#      importlib.metadata, so packages installed from local wheels or URLs are held too),
#      and, for names the base lacks, to PINS (pins.txt): a base's InstantTensor, vLLM and
#      torch are kept whatever their version; only what is missing is added;
#   3. fails if any distribution the base had changed version or went away after all;
#   4. fails unless `hybrid-draft doctor` passes in that Python, in a fresh interpreter.
# It leaves no installer cache behind, and no bytecode in the base's own packages.
set -eu

usage="usage: install-layer.sh [--offline WHEELS_DIR] PYTHON WHEEL [PINS]"
OFFLINE=""
if [ "${1:-}" = "--offline" ]; then
    OFFLINE=${2:?$usage}
    shift 2
fi
PYTHON=${1:?$usage}
WHEEL=${2:?$usage}
PINS=${3:-$(dirname "$0")/../pins.txt}
[ -f "$WHEEL" ] || { echo "install-layer: the wheel $WHEEL does not exist" >&2; exit 2; }
[ -f "$PINS" ] || { echo "install-layer: the pins file $PINS does not exist" >&2; exit 2; }
[ -z "$OFFLINE" ] || [ -d "$OFFLINE" ] || {
    echo "install-layer: --offline $OFFLINE is not a directory of wheels" >&2
    exit 2
}
"$PYTHON" -c '' 2>/dev/null || { echo "install-layer: $PYTHON is not a Python" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The checks below import the base's packages (the doctor imports vLLM): they must not
# leave bytecode in the base's package folders.
export PYTHONDONTWRITEBYTECODE=1

# The helper runs in the target Python (stdlib only). Subcommands:
#   preflight            the refusals of step 1 (one line on stderr, exit 2)
#   snapshot FILE        name==version of every installed distribution, the first of each
#                        name on sys.path (the one that imports)
#   constraints BEFORE PINS OUT REQS
#                        OUT: BEFORE (minus hybrid-draft) + the pins of names BEFORE lacks
#                        (INSTANTTENSOR_VERSION, when set, replaces the instanttensor pin);
#                        REQS: what to install besides the wheel (InstantTensor, if absent)
#   compare BEFORE AFTER every distribution of BEFORE unchanged in AFTER, and what was added
cat > "$work/helper.py" <<'PY'
import importlib.metadata as md
import importlib.util
import os
import re
import sys
import sysconfig

# The original mod's marker line (its v1 writes "... v1") in the file it rewrites.
MARKER = "# spark-vllm mod: instanttensor-hybrid-draft-loader"
SELF = "hybrid-draft"
# PEP 440, as pip parses versions; a distribution whose version is not one is left out of
# the constraints (pip would refuse the file) but still checked by `compare`.
PEP440 = re.compile(
    r"v?(\d+!)?\d+(\.\d+)*([-_.]?(a|b|c|rc|alpha|beta|pre|preview)[-_.]?\d*)?"
    r"(-\d+|[-_.]?(post|rev|r)[-_.]?\d*)?([-_.]?dev[-_.]?\d*)?(\+[a-z0-9]+([-_.][a-z0-9]+)*)?",
    re.I,
)


def refuse(message, status=2):
    print(message, file=sys.stderr)
    sys.exit(status)


def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def installed():
    found = {}
    for dist in md.distributions():
        name, version = dist.metadata["Name"], dist.version
        if name and version and canon(name) not in found:
            found[canon(name)] = (name, version)
    return found


def read(path):
    out = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if "==" in line:
                name, version = line.split("==", 1)
                out[canon(name)] = (name.strip(), version.split(";")[0].strip())
    return out


def preflight():
    spec = importlib.util.find_spec("vllm")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "model_executor", "model_loader", "__init__.py")
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                patched = MARKER in f.read()
        except OSError:
            continue
        if patched:
            refuse(
                f"install-layer: {path} carries the spark-vllm mod "
                "instanttensor-hybrid-draft-loader (a text patch of get_model), which "
                "hybrid-draft replaces and never stacks on: reinstall vLLM in this Python "
                "(or start from a container without that mod: drop it from --apply-mod), "
                "then install again"
            )
    target = sysconfig.get_path("purelib")
    if not os.access(target, os.W_OK):
        uid = os.getuid()
        refuse(
            f"install-layer: {target} is not writable by uid {uid}: install as root "
            "(in a Dockerfile, USER root for this step; in a running container, "
            "docker exec -u 0)"
        )


def main():
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # the helper's own directory is no site of this Python
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "preflight":
        preflight()
    elif cmd == "snapshot":
        with open(args[0], "w") as f:
            f.writelines(f"{n}=={v}\n" for n, v in sorted(installed().values()))
    elif cmd == "constraints":
        before, pins = read(args[0]), read(args[1])
        pinned = os.environ.get("INSTANTTENSOR_VERSION")
        if pinned:
            pins["instanttensor"] = ("instanttensor", pinned)
        if "instanttensor" not in before and "instanttensor" not in pins:
            refuse(f"install-layer: the base has no InstantTensor and {args[1]} pins none")
        keep = {k: v for k, v in before.items() if k != SELF and PEP440.fullmatch(v[1])}
        merged = {**{k: v for k, v in pins.items() if k != SELF}, **keep}
        with open(args[2], "w") as f:
            f.writelines(f"{n}=={v}\n" for n, v in sorted(merged.values()))
        with open(args[3], "w") as f:  # InstantTensor only where the base has none
            f.write("" if "instanttensor" in before else "instanttensor\n")
        held = f"install-layer: {len(keep)} installed distributions held at their versions"
        if "instanttensor" in before:
            held += f", InstantTensor {before['instanttensor'][1]} among them"
        print(held)
    elif cmd == "compare":
        before, after = read(args[0]), read(args[1])
        changed = [
            f"{name} {version} -> {after[key][1] if key in after else 'removed'}"
            for key, (name, version) in sorted(before.items())
            if key != SELF and after.get(key, (None, None))[1] != version
        ]
        if changed:
            refuse("install-layer: the install changed what the base had: " + ", ".join(changed), 1)
        added = [f"{n} {v}" for k, (n, v) in sorted(after.items()) if k not in before]
        print(f"install-layer: added {', '.join(added) or 'nothing'}; nothing the base had changed")


main()
PY
helper() { "$PYTHON" "$work/helper.py" "$@"; }

helper preflight

# An image's Python may be marked externally managed (PEP 668); installing into it is
# exactly what a derived image layer is for.
BREAK=""
if "$PYTHON" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; then
    BREAK=--break-system-packages
fi

helper snapshot "$work/before.txt"
helper constraints "$work/before.txt" "$PINS" "$work/constraints.txt" "$work/requirements.txt"

if command -v uv >/dev/null 2>&1; then
    set -- --constraint "$work/constraints.txt"
    [ -z "$OFFLINE" ] || set -- "$@" --no-index --find-links "$OFFLINE"
    # shellcheck disable=SC2086
    uv pip install --python "$PYTHON" --no-cache $BREAK "$@" \
        --reinstall-package hybrid-draft -r "$work/requirements.txt" "$WHEEL"
elif "$PYTHON" -m pip --version >/dev/null 2>&1; then
    set -- --quiet --no-cache-dir --disable-pip-version-check
    [ -z "$OFFLINE" ] || set -- "$@" --no-index --find-links "$OFFLINE"
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install "$@" $BREAK --constraint "$work/constraints.txt" \
        -r "$work/requirements.txt" "$WHEEL"
    # A wheel of the same version as one already installed is skipped above: replace it.
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install "$@" $BREAK --no-deps --force-reinstall "$WHEEL"
else
    echo "install-layer: $PYTHON has no pip and there is no uv on PATH" >&2
    exit 2
fi

helper snapshot "$work/after.txt"
helper compare "$work/before.txt" "$work/after.txt"

# The layer must be active in this Python, in a fresh interpreter.
"$PYTHON" -m hybrid_draft doctor
