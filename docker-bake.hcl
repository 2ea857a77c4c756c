# docker buildx bake            -> the image for this host, loaded for `docker compose up`
# docker buildx bake official   -> linux/amd64 + linux/arm64 from the official vLLM image
# docker buildx bake spark      -> linux/arm64 from a DGX Spark vLLM image
# Override any variable from the environment, e.g. REPOSITORY=ghcr.io/me/vllm docker buildx bake.

variable "VLLM_VERSION" {
  default = "0.33.0"
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

# A DGX Spark (GB10, arm64) vLLM image; it must carry the vLLM version above (the build's
# `hybrid-draft doctor` step fails otherwise).
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

variable "SOURCE_URL" {
  default = "https://github.com/hybrid-draft/hybrid-draft"
}

group "default" {
  targets = ["local"]
}

group "release" {
  targets = ["official", "spark"]
}

target "_common" {
  context    = "."
  dockerfile = "Dockerfile"
  args = {
    BASE_IMAGE            = "${BASE_IMAGE}"
    PYTHON                = "python3"
    VLLM_VERSION          = "${VLLM_VERSION}"
    INSTANTTENSOR_VERSION = "${INSTANTTENSOR_VERSION}"
    HYBRID_DRAFT_VERSION  = "${HYBRID_DRAFT_VERSION}"
    SOURCE_URL            = "${SOURCE_URL}"
  }
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

target "spark" {
  inherits  = ["_common"]
  platforms = ["linux/arm64"]
  args = {
    BASE_IMAGE = "${SPARK_BASE_IMAGE}"
  }
  tags = ["${REPOSITORY}:${TAG}-spark"]
}
