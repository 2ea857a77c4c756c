# syntax=docker/dockerfile:1.7
# hybrid-draft: a derived vLLM image. The base image, its Python and its entrypoint stay as
# they are; this layer adds the hybrid-draft wheel (its .pth activates it in the base's
# Python), the pinned InstantTensor, and /etc/hybrid-draft.toml. Build with
# `docker buildx bake` (docker-bake.hcl passes exactly these ARGs).

ARG BASE_IMAGE=vllm/vllm-openai:v0.33.0

# Build the wheel in a throwaway stage: no build backend or wheel reaches the final image.
FROM ${BASE_IMAGE} AS wheel
ARG PYTHON=python3
WORKDIR /src
COPY pyproject.toml README.md ./
COPY layer ./layer
RUN "${PYTHON}" -m pip wheel --no-cache-dir --no-deps --wheel-dir /dist /src

FROM ${BASE_IMAGE}
ARG BASE_IMAGE
ARG PYTHON=python3
ARG VLLM_VERSION=0.33.0
ARG INSTANTTENSOR_VERSION=0.2.2
ARG HYBRID_DRAFT_VERSION=0.1.0
ARG SOURCE_URL=https://github.com/hybrid-draft/hybrid-draft

LABEL org.opencontainers.image.title="vLLM with hybrid-draft" \
      org.opencontainers.image.description="vLLM ${VLLM_VERSION}: InstantTensor for the target, lazy or selective loading for speculative drafts" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.version="${HYBRID_DRAFT_VERSION}-vllm${VLLM_VERSION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.hybrid-draft.vllm.version="${VLLM_VERSION}" \
      io.hybrid-draft.instanttensor.version="${INSTANTTENSOR_VERSION}"

# The same script scripts/test runs into the test environment. The wheel, the script and
# the pins are bind-mounted, never copied, so none of them stays in a layer; the script
# ends with `hybrid-draft doctor`, which fails the build unless the layer is active.
RUN --mount=type=bind,from=wheel,source=/dist,target=/tmp/hybrid-draft/dist \
    --mount=type=bind,source=docker/install-layer.sh,target=/tmp/hybrid-draft/install-layer.sh \
    --mount=type=bind,source=pins.txt,target=/tmp/hybrid-draft/pins.txt \
    INSTANTTENSOR_VERSION="${INSTANTTENSOR_VERSION}" sh /tmp/hybrid-draft/install-layer.sh \
        "$(command -v "${PYTHON}")" /tmp/hybrid-draft/dist/hybrid_draft-*.whl \
        /tmp/hybrid-draft/pins.txt

COPY config/hybrid-draft.toml /etc/hybrid-draft.toml
