"""TEST-ONLY vLLM worker extension for the end-to-end reload tests (``--worker-extension-cls
hybrid_draft_e2e_probe.DraftProbe``, copied into a TEST environment's site-packages with the
InstantTensor stand-in): what a level-2 sleep leaves in the draft's parameters, and whether
they hold what a reload should have put there. Each method runs on every worker, called by
name with ``collective_rpc`` (the offline ``LLM``'s, or the dev server's ``/collective_rpc``:
string arguments only). Never in the wheel or an image.
"""

from __future__ import annotations

from typing import Any


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
