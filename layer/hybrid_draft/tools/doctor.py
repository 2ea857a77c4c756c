"""``hybrid-draft doctor``: is the layer installed and active here, and will it work?

One line per check, ``ok`` or ``FAIL``; any failure makes the command exit non-zero. The
image runs it at build time, so a layer that is not active fails the build. Each check runs
on its own: one that raises (importing vLLM can raise anything, e.g. next to a torchvision
built for another torch) is a ``FAIL`` line naming the exception, never a traceback, and
the checks after it still run.

One line per part of the layer (``internals.PARTS``) says whether vLLM's shape lets it
run here, and why not: a part off on a supported release (``internals.SUPPORTED_RELEASES``)
fails, unless ``HYBRID_DRAFT_ALLOW_PARTS_OFF`` names it (or is ``all``), so an image does
not build with a saving silently off.
"""

from __future__ import annotations

import os
import site
import sys
from collections.abc import Callable
from pathlib import Path

from hybrid_draft import __version__, settings
from hybrid_draft.adapter import internals

Check = tuple[bool, str]
PTH = "hybrid_draft.pth"
#: Parts a build may have off on a supported release: comma-separated names, or ``all``.
ALLOW_ENV = "HYBRID_DRAFT_ALLOW_PARTS_OFF"


class AllowError(ValueError):
    """``HYBRID_DRAFT_ALLOW_PARTS_OFF`` names something that is not a part."""


def allowed_off() -> frozenset[str]:
    """The parts ``HYBRID_DRAFT_ALLOW_PARTS_OFF`` lets be off (empty when unset)."""
    raw = os.environ.get(ALLOW_ENV, "").strip()
    if not raw:
        return frozenset()
    names = {n.strip().lower() for n in raw.split(",") if n.strip()}
    if names == {"all"}:
        return frozenset(internals.PARTS)
    unknown = sorted(names - set(internals.PARTS))
    if unknown or not names:
        raise AllowError(
            f"{ALLOW_ENV}={raw!r}: {', '.join(unknown) or 'no part'} is not a part; "
            f"accepted: all, or comma-separated names of {', '.join(internals.PARTS)}"
        )
    return frozenset(names)


class PartCheck:
    """The doctor's line for one part: on, or off and why (failing on a supported release
    unless allowed)."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.__name__ = f"check_part_{part}"

    def __call__(self) -> Check:
        import vllm.model_executor.model_loader  # noqa: F401  (the hook probes as it loads)

        from hybrid_draft.adapter import parts

        (state,) = [s for s in parts.states() if s.part == self.part]
        label = f"part {self.part}"
        if state.on:
            return True, f"{label}: on ({state.detail})"
        version = internals.vllm_version()
        if self.part in allowed_off():
            return True, f"{label}: off, allowed by {ALLOW_ENV}: {state.detail}"
        if version not in internals.SUPPORTED_RELEASES:
            supported = ", ".join(internals.SUPPORTED_RELEASES)
            return True, (
                f"{label}: off on vLLM {version}, not a supported release ({supported}): "
                f"{state.detail}"
            )
        return False, (
            f"{label}: off on vLLM {version}, a supported release: {state.detail} "
            f"(set {ALLOW_ENV}={self.part} to accept it)"
        )


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    return [*dirs, *([user] if user else []), *sys.path]


def check_installed() -> Check:
    from hybrid_draft import _bootstrap

    pth = next((Path(d) / PTH for d in _site_dirs() if (Path(d) / PTH).is_file()), None)
    if pth is None:
        return False, f"layer: {PTH} is not in any site-packages directory of {sys.executable}"
    if "hybrid_draft._bootstrap" not in pth.read_text():
        return False, f"layer: {pth} does not import hybrid_draft._bootstrap"
    if not _bootstrap.installed():
        reason = (
            f"{_bootstrap.DISABLE_ENV} is set"
            if _bootstrap.DISABLE_ENV in __import__("os").environ
            else "the .pth did not run (python -S?)"
        )
        return False, f"layer: {pth} is installed but its hook is not active ({reason})"
    return True, f"layer: hybrid-draft {__version__} active in {sys.executable} via {pth}"


def check_vllm() -> Check:
    try:
        import vllm.model_executor.model_loader as loader
    except Exception as exc:  # report it as a failed check; the doctor itself never crashes
        return False, f"vllm: cannot import vllm.model_executor.model_loader: {exc!r}"
    from hybrid_draft.adapter import internals

    version = internals.vllm_version()
    if getattr(loader.get_model, "__hybrid_draft_wrapped__", False):
        return True, f"vllm: {version}, {internals.TARGET} is wrapped"
    problem = internals.shape_problem(loader)
    return False, f"vllm: {version}, get_model not wrapped: {problem or 'the hook did not run'}"


def check_instanttensor() -> Check:
    try:
        import instanttensor
    except Exception as exc:  # its CUDA extension may fail to load, not only be missing
        return False, f"instanttensor: does not import: {exc!r}"
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("instanttensor")
    except PackageNotFoundError:
        ver = getattr(instanttensor, "__version__", "unknown version")
    return True, f"instanttensor: {ver} imports"


def check_selective() -> Check:
    """Whether mode ``selective`` streams here, by the very checks its loads make.

    Without CUDA it falls back to lazy safetensors by design (any CPU host, an image build):
    that passes. An InstantTensor without ``tensor_filter`` is a broken install: that fails.
    """
    from hybrid_draft.adapter import draftplan

    no_cuda = draftplan.cuda_unavailable()
    no_filter = draftplan.tensor_filter_supported()
    if no_cuda is None and no_filter is None:
        return True, "selective: available (CUDA and InstantTensor's tensor_filter)"
    why = "; ".join(p for p in (no_cuda, no_filter) if p)
    return no_filter is None, f"selective: falls back to lazy safetensors here: {why}"


def check_formats() -> Check:
    """Which target formats' drafts the layer reads filtered here, and which it leaves to
    vLLM (a library missing, too old, or kept by ``keep_formats``): informational, it passes
    (a format left to vLLM loads as it would without the layer)."""
    from hybrid_draft.adapter import loaders
    from hybrid_draft.core import policy

    try:
        keep = tuple(settings.load().keep_formats.value)
    except settings.ConfigError:
        keep = ()  # the config check reports it
    handled = policy.handled_formats(keep, loaders.available_formats())
    unfiltered = loaders.unfiltered_formats()

    def why(fmt: str) -> str:
        if fmt in keep:
            return "keep_formats"
        if fmt in unfiltered:
            return "no_tensor_filter: its library cannot filter by tensor name"
        return "not handled here"

    left = [f"{fmt} ({why(fmt)})" for fmt in policy.TARGET_FORMATS if fmt not in handled]
    line = f"formats: drafts read filtered for {', '.join(handled) or 'no target format'}"
    return True, line + (f"; left to vLLM: {', '.join(left)}" if left else "")


def check_config() -> Check:
    try:
        current = settings.load()
    except settings.ConfigError as exc:
        return False, f"config: {exc}"
    where = current.config_path if current.config_exists else f"{current.config_path} (absent)"
    return True, (
        f"config: mode={current.mode.value} ({current.mode.source}), "
        f"level={current.level.value}, file {where}"
    )


def check_watch() -> Check:
    """How a long or stuck load is watched (``[load]``): said here, where an operator looks
    first for why a load said nothing, or stopped."""
    try:
        current = settings.load()
    except settings.ConfigError:
        return True, "watch: the config check says why the settings cannot be read"
    progress = current.progress_seconds.value
    timeout = current.load_timeout.value
    said = f"every {progress:g} s" if progress else "off"
    bound = f"after {timeout:g} s without a byte" if timeout is not None else "off"
    return True, (
        f"watch: progress events {said} ({current.progress_seconds.source}), a stall named "
        f"after {current.stall_seconds.value:g} s ({current.stall_seconds.source}), a first "
        f"load stopped {bound} ({current.load_timeout.source})"
    )


def check_rules() -> Check:
    try:
        from hybrid_draft.tools import draftinfo

        classes = draftinfo.draft_classes(mtp_only=True)
        return True, f"rules: {draftinfo.rules_summary(classes)}"
    except Exception as exc:  # the registry's shape changed: report it, never crash
        return False, f"rules: cannot list vLLM's draft classes: {exc!r}"


CHECKS: list[Callable[[], Check]] = [
    check_installed,
    check_config,
    check_watch,
    check_vllm,
    check_instanttensor,
    check_selective,
    check_formats,
    check_rules,
    *(PartCheck(part) for part in internals.PARTS),
]


def isolated(check: Callable[[], Check]) -> Check:
    """Run one check; whatever it raises becomes its ``FAIL`` line (one line, no traceback)."""
    name = getattr(check, "__name__", "check").removeprefix("check_")
    try:
        ok, line = check()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit from an import included: report, carry on
        ok, line = False, f"{name}: the check raised {type(exc).__name__}: {exc}"
    return bool(ok), " ".join(str(line).split())


def run() -> int:
    try:
        allowed_off()
    except AllowError as exc:
        print(f"hybrid-draft doctor: {exc}", file=sys.stderr, flush=True)
        return 2
    failed = 0
    for check in CHECKS:
        ok, line = isolated(check)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {line}", flush=True)
    return 1 if failed else 0
