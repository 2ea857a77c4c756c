# hybrid-draft: a derived vLLM image. The base image, its Python, its packages, its user
# and its entrypoint stay as they are; this layer adds the hybrid-draft wheel (its .pth
# activates it in the base's Python), InstantTensor where the base has none, and
# /etc/hybrid-draft.toml. Build with `docker buildx bake` (docker-bake.hcl passes exactly
# these ARGs).

ARG BASE_IMAGE=vllm/vllm-openai:v0.34.0

# Where the build's packages come from: the wheel stage's build backend (hatchling) and
# whatever the base lacks of the layer's dependencies (structlog, requests, rich).
#   PACKAGE_INDEX   an index URL (a mirror) that pip and uv use instead of their default;
#                   `none`: no index at all, only the `wheels` context
#   wheels          a named build context of wheel files, searched before any index
#                   (bake: --set '*.contexts.wheels=DIR'); empty by default
# Only the steps that install read them; the image keeps no trace of either.
ARG PACKAGE_INDEX=

# The default `wheels` context: no wheels.
FROM scratch AS wheels

# Build the wheel in a throwaway stage: no build backend or wheel reaches the final image.
# uv where the base has it (vllm/vllm-openai installs with uv and needs no pip), else pip.
FROM ${BASE_IMAGE} AS wheel
ARG PYTHON=python3
ARG PACKAGE_INDEX
# hadolint ignore=DL3002
USER 0
WORKDIR /src
COPY docker/package-sources.sh /usr/local/lib/hybrid-draft-build/package-sources.sh
COPY pyproject.toml README.md ./
COPY layer ./layer
RUN --mount=type=bind,from=wheels,target=/tmp/hybrid-draft/wheels \
    . /usr/local/lib/hybrid-draft-build/package-sources.sh \
 && if command -v uv >/dev/null 2>&1; then \
        uv build --no-cache --python "$(command -v "${PYTHON}")" --wheel --out-dir /dist /src; \
    else \
        "${PYTHON}" -m pip wheel --no-cache-dir --no-deps --wheel-dir /dist /src; \
    fi

FROM ${BASE_IMAGE}
ARG BASE_IMAGE
ARG PACKAGE_INDEX
ARG PYTHON=python3
# The user the base image runs as (vllm/vllm-openai: root; its -nonroot variant: vllm).
# The install needs root; the image then runs as this user again.
ARG BASE_USER=root
ARG VLLM_VERSION=0.34.0
ARG INSTANTTENSOR_VERSION=0.2.2
ARG HYBRID_DRAFT_VERSION=0.1.0
ARG SOURCE_URL=https://github.com/hybrid-draft/hybrid-draft
# Parts of the layer the build's `hybrid-draft doctor` step may find off without failing
# (comma-separated part names, or `all`): set it to build anyway on a base where vLLM's
# shape turns a part off. Empty: any part off on a supported release fails the build.
ARG HYBRID_DRAFT_ALLOW_PARTS_OFF=

LABEL org.opencontainers.image.title="vLLM with hybrid-draft" \
      org.opencontainers.image.description="vLLM ${VLLM_VERSION}: InstantTensor for the target, lazy or selective loading for speculative drafts" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.version="${HYBRID_DRAFT_VERSION}-vllm${VLLM_VERSION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.hybrid-draft.vllm.version="${VLLM_VERSION}" \
      io.hybrid-draft.instanttensor.version="${INSTANTTENSOR_VERSION}"

# Run as the base's own user: a BASE_USER that is not that user stops the build here,
# before the image could end up running as someone else.
RUN [ "$(id -u)" = "${BASE_USER}" ] || [ "$(id -un 2>/dev/null)" = "${BASE_USER}" ] \
    || { echo "hybrid-draft: the base image runs as $(id -un 2>/dev/null || id -u) (uid $(id -u)), not BASE_USER=${BASE_USER}: set BASE_USER to it" >&2; exit 2; }

# The same script scripts/test runs into the test environment and the mod form's run.sh
# into a running container. The wheel, the script and the pins are bind-mounted, never
# copied, so none of them stays in a layer; the script installs only what the base lacks,
# changes nothing the base has, and ends with `hybrid-draft doctor`, which fails the build
# unless the layer is active (and every part of it on, but for HYBRID_DRAFT_ALLOW_PARTS_OFF). /model and /events (compose.yaml's named volumes) belong to
# the base's user, so new volumes there are writable by it.
USER 0
RUN --mount=type=bind,from=wheel,source=/dist,target=/tmp/hybrid-draft/dist \
    --mount=type=bind,source=docker/install-layer.sh,target=/tmp/hybrid-draft/install-layer.sh \
    --mount=type=bind,source=pins.txt,target=/tmp/hybrid-draft/pins.txt \
    --mount=type=bind,source=docker/package-sources.sh,target=/tmp/hybrid-draft/package-sources.sh \
    --mount=type=bind,from=wheels,target=/tmp/hybrid-draft/wheels \
    . /tmp/hybrid-draft/package-sources.sh \
 && INSTANTTENSOR_VERSION="${INSTANTTENSOR_VERSION}" \
    HYBRID_DRAFT_ALLOW_PARTS_OFF="${HYBRID_DRAFT_ALLOW_PARTS_OFF}" \
    sh /tmp/hybrid-draft/install-layer.sh \
        "$(command -v "${PYTHON}")" /tmp/hybrid-draft/dist/hybrid_draft-*.whl \
        /tmp/hybrid-draft/pins.txt \
 && install -d -o "${BASE_USER}" /model /events

COPY config/hybrid-draft.toml /etc/hybrid-draft.toml
# hadolint ignore=DL3066
USER ${BASE_USER}
