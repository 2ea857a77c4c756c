"""hybrid-draft: keep InstantTensor for vLLM's target model, load speculative drafts cheaply.

Importing this package must stay free: the wheel's ``.pth`` imports ``hybrid_draft._bootstrap``
in every Python process, which imports this file first.
"""

__version__ = "0.1.0"
