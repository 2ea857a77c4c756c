"""TEST-ONLY vLLM worker extension for the end-to-end reload and weight-update tests
(``--worker-extension-cls hybrid_draft_e2e_probe.DraftProbe``, copied into a TEST
environment's site-packages with the InstantTensor stand-in): what a level-2 sleep leaves in
the draft's parameters, and whether they hold what a reload or a weight-transfer session
should have put there (the draft's own weights and what vLLM derives from them, saved from a
fresh boot of a checkpoint and compared). Each method runs on every worker, called by name
with ``collective_rpc`` (the offline ``LLM``'s, or the dev server's ``/collective_rpc``:
string arguments only). Importing it registers the tests' weight-transfer backend
(``hybrid_draft_e2e_transfer``) in the worker's process. Never in the wheel or an image.
"""

from __future__ import annotations

from typing import Any

import hybrid_draft_e2e_transfer

hybrid_draft_e2e_transfer.register()


class DraftProbe:
    """Mixed into vLLM's worker class: ``self`` is the worker."""

    def _draft_own(self) -> dict[str, Any]:
        """The draft's own parameters that hold anything: not those it shares with the
        target, nor the empty ones (vLLM's CPU build packs some linears elsewhere)."""
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        theirs = {id(p) for p in runner.get_model().parameters()}
        draft = runner.get_draft_model()
        return {n: p for n, p in draft.named_parameters() if id(p) not in theirs and p.numel() > 0}

    def remember_draft(self) -> int:
        """Keep a copy of the draft's own parameters; how many there are."""
        self._remembered = {n: p.detach().clone() for n, p in self._draft_own().items()}
        return len(self._remembered)

    def garble_draft(self) -> int:
        """Overwrite the draft's own parameters, as a level-2 sleep leaves them."""
        import torch

        own = self._draft_own()
        with torch.no_grad():
            for param in own.values():
                param.fill_(7.0)
        return len(own)

    def draft_mismatches(self, scale: str = "1") -> list[str]:
        """The draft's own parameters that differ from the remembered copy times ``scale``."""
        import torch

        factor = float(scale)
        return sorted(
            n
            for n, p in self._draft_own().items()
            if not torch.equal(p.detach(), self._remembered[n] * factor)
        )

    def _draft_state(self) -> dict[str, Any]:
        """The draft's own weights and buffers (what vLLM derives from them: MLA's W_UK_T)."""
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        out = {n: p.detach().clone() for n, p in self._draft_own().items()}
        draft = runner.get_draft_model()
        out.update({f"buffer:{n}": b.detach().clone() for n, b in draft.named_buffers()})
        return out

    def save_draft(self, path: str) -> int:
        """Save the draft's own weights and buffers to ``path``; how many tensors."""
        import torch

        state = self._draft_state()
        torch.save(state, path)
        return len(state)

    def draft_differs_from(self, path: str) -> list[str]:
        """The draft's own weights and buffers that differ from those saved at ``path``
        (another boot's: equal means this draft computes as that boot's draft does)."""
        import torch

        saved = torch.load(path)
        now = self._draft_state()
        names = sorted(set(saved) | set(now))
        return [
            n for n in names if n not in saved or n not in now or not torch.equal(now[n], saved[n])
        ]

    def reload_from_stream(self, model_dir: str) -> None:
        """``reload_weights`` with a weights iterator: every tensor of ``model_dir``, as a
        trainer streams them in checkpoint format."""
        import glob
        import os

        from safetensors.torch import load_file

        def stream() -> Any:
            for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
                yield from load_file(path).items()

        self.reload_weights(weights_iterator=stream())  # type: ignore[attr-defined]
