"""The core: what a draft load computes and reads, with no vLLM import.

Policy (one load's inputs to a decision), checkpoint headers, the draft plan, the
draft's readers (one per format, torch and the format's own library alone), the one-pass
hold and the load figures. The adapter feeds it what vLLM decided; the tools and
``scripts/gpu-check.sh`` drive it directly. Importing this package imports nothing.
"""
