"""The vLLM adapter: the only part of hybrid-draft that touches vLLM's internals.

The bootstrap's post-import hook calls ``hybrid_draft.adapter.patch:on_model_loader`` right
after vLLM's model loader executes. ``patch`` (and this file) import nothing from vLLM at
module level: another module here may import vLLM first, and vLLM's own imports then fire
the hook, which must find ``patch`` importable rather than half-initialised.
"""
