"""TEST-ONLY vLLM worker extension for the end-to-end servers (``--worker-extension-cls
hybrid_draft_e2e_garble.DraftGarbler``, copied into a TEST environment's site-packages with the
InstantTensor stand-in): a draft loaded wrong, on demand. ``garble_draft`` shuffles the values
of each of the draft's own parameters, as a loader that mixed up its tensors leaves them (the
same values, in the wrong places), and ``restore_draft`` puts them back. Called by name on
every worker with ``collective_rpc`` (the dev server's ``POST /collective_rpc``). Never in the
wheel or an image.
"""

from __future__ import annotations

from typing import Any


class DraftGarbler:
    """Mixed into vLLM's worker class: ``self`` is the worker."""

    def _draft_own(self) -> dict[str, Any]:
        """The draft's own parameters that hold anything: not those it shares with the
        target (the embedding, the head), nor the empty ones (vLLM's CPU build packs some
        linears elsewhere)."""
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        theirs = {id(p) for p in runner.get_model().parameters()}
        draft = runner.get_draft_model()
        return {n: p for n, p in draft.named_parameters() if id(p) not in theirs and p.numel() > 0}

    def garble_draft(self) -> int:
        """Shuffle each of the draft's own parameters (seeded); how many were shuffled."""
        import torch

        own = self._draft_own()
        self._garbled = {n: p.detach().clone() for n, p in own.items()}
        generator = torch.Generator().manual_seed(45)
        with torch.no_grad():
            for param in own.values():
                flat = param.detach().reshape(-1).clone()
                order = torch.randperm(flat.numel(), generator=generator)
                param.copy_(flat[order].reshape(param.shape))
        return len(own)

    def restore_draft(self) -> int:
        """Put back what :meth:`garble_draft` shuffled; how many parameters."""
        import torch

        own = self._draft_own()
        with torch.no_grad():
            for name, value in self._garbled.items():
                own[name].copy_(value)
        return len(self._garbled)
