# docker buildx bake            -> the image for this host, loaded for `docker compose up`
# docker buildx bake official   -> linux/amd64 + linux/arm64 from the official vLLM image.
#                                  Two platforms need a builder of the docker-container
#                                  driver (Docker's own `docker` driver builds one platform
#                                  only) and somewhere to put the result:
#                                    docker buildx create --name hybrid-draft --driver docker-container --bootstrap
#                                    REPOSITORY=ghcr.io/me/vllm docker buildx bake --builder hybrid-draft --push official
#                                  or one platform with the default builder, loaded locally:
#                                    PLATFORMS=linux/amd64 docker buildx bake official
# docker buildx bake official-nonroot
#                               -> the same from the official image's non-root variant; the
#                                  image keeps running as its user (vllm, uid 2000)
# docker buildx bake spark      -> linux/arm64 from a DGX Spark vLLM image
# A base that runs as another user than root: set BASE_USER to it (the build stops, saying
# so, when it is not the base's user), e.g. BASE_IMAGE=my/vllm BASE_USER=vllm docker buildx bake.
# Override any variable from the environment, e.g. REPOSITORY=ghcr.io/me/vllm docker buildx bake.
# Without the public package index (the build fetches hatchling, and what the base lacks of
# the layer's dependencies): PACKAGE_INDEX=https://mirror/simple docker buildx bake, or the
# wheels as files and no index at all: WHEELS=./wheels PACKAGE_INDEX=none docker buildx bake
# (fill ./wheels with `pip download --only-binary :all: -d wheels hatchling structlog requests rich`).

# The vLLM release to build on (the official image's tag): the newest supported one
# (pins.txt's `# vllm-releases:` line); VLLM_VERSION=0.33.0 docker buildx bake builds on the
# previous one.
variable "VLLM_VERSION" {
  default = "0.34.0"
}

variable "INSTANTTENSOR_VERSION" {
  default = "0.2.2"
}

variable "HYBRID_DRAFT_VERSION" {
  default = "0.1.0"
}

variable "BASE_IMAGE" {
  default = "vllm/vllm-openai:v${VLLM_VERSION}"
}

# The user BASE_IMAGE runs as: the install step runs as root, then the image switches back.
variable "BASE_USER" {
  default = "root"
}

# The official image's non-root variant (its Dockerfile's target vllm-openai-nonroot:
# USER vllm, uid 2000, gid 0).
variable "NONROOT_BASE_IMAGE" {
  default = "vllm/vllm-openai:v${VLLM_VERSION}-nonroot"
}

# A DGX Spark (GB10, arm64) vLLM image. NGC and source builds report local versions
# (0.11.1+9114fd76, 0.33.1.dev7+g...): the build's `hybrid-draft doctor` step judges vLLM by
# the shape of its get_model, never by its version string, and fails, saying why, on a
# shape the layer does not know.
variable "SPARK_BASE_IMAGE" {
  default = "nvcr.io/nvidia/vllm:26.11-py3"
}

variable "REPOSITORY" {
  default = "hybrid-draft/vllm-openai"
}

variable "TAG" {
  default = "v${VLLM_VERSION}"
}

variable "PLATFORMS" {
  default = "linux/amd64,linux/arm64"
}

# An index URL (a mirror) for pip and uv in the build, `none` for no index; empty: theirs.
variable "PACKAGE_INDEX" {
  default = ""
}

# A folder of wheel files the build searches first (the Dockerfile's `wheels` context).
variable "WHEELS" {
  default = ""
}

# Parts of the layer the build's doctor step may find off (comma-separated, or `all`):
# HYBRID_DRAFT_ALLOW_PARTS_OFF=all docker buildx bake builds anyway. Empty: none.
variable "HYBRID_DRAFT_ALLOW_PARTS_OFF" {
  default = ""
}

variable "SOURCE_URL" {
  default = "https://github.com/hybrid-draft/hybrid-draft"
}

group "default" {
  targets = ["local"]
}

group "release" {
  targets = ["official", "official-nonroot", "spark"]
}

target "_common" {
  context    = "."
  dockerfile = "Dockerfile"
  args = {
    BASE_IMAGE                   = "${BASE_IMAGE}"
    PYTHON                       = "python3"
    BASE_USER                    = "${BASE_USER}"
    VLLM_VERSION                 = "${VLLM_VERSION}"
    INSTANTTENSOR_VERSION        = "${INSTANTTENSOR_VERSION}"
    HYBRID_DRAFT_VERSION         = "${HYBRID_DRAFT_VERSION}"
    SOURCE_URL                   = "${SOURCE_URL}"
    PACKAGE_INDEX                = "${PACKAGE_INDEX}"
    HYBRID_DRAFT_ALLOW_PARTS_OFF = "${HYBRID_DRAFT_ALLOW_PARTS_OFF}"
  }
  contexts = notequal(WHEELS, "") ? { wheels = WHEELS } : {}
}

# This host's platform, loaded into the local image store under the tag compose.yaml uses.
target "local" {
  inherits = ["_common"]
  tags     = ["${REPOSITORY}:${TAG}"]
  output   = ["type=docker"]
}

target "official" {
  inherits  = ["_common"]
  platforms = split(",", PLATFORMS)
  tags      = ["${REPOSITORY}:${TAG}", "${REPOSITORY}:${TAG}-hybrid-draft${HYBRID_DRAFT_VERSION}"]
}

target "official-nonroot" {
  inherits  = ["official"]
  args = {
    BASE_IMAGE = "${NONROOT_BASE_IMAGE}"
    BASE_USER  = "vllm"
  }
  tags = ["${REPOSITORY}:${TAG}-nonroot"]
}

target "spark" {
  inherits  = ["_common"]
  platforms = ["linux/arm64"]
  args = {
    BASE_IMAGE = "${SPARK_BASE_IMAGE}"
  }
  tags = ["${REPOSITORY}:${TAG}-spark"]
}
