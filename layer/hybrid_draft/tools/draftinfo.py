"""Which MTP draft class vLLM builds for a checkpoint directory, and its weight rule, without
loading it: for ``hybrid-draft plan``, ``rules`` and ``doctor``.

Follows vLLM's own path: the checkpoint's config through ``get_config``, rewritten by
``SpeculativeConfig.hf_config_override`` (what ``method: mtp`` does), then the draft
architecture through the model registry. No ``ModelConfig`` is built (that inspects the
model class in a subprocess), so ``hybrid-draft plan`` stays well under a second.

Code shipped with a checkpoint (``auto_map``'s ``configuration_*.py``) runs only when the
caller passes ``trust_remote_code=True``. Without it, a ``config.json`` whose ``model_type``
neither transformers nor vLLM knows (MiMo's ``mimo``) is read as a plain
``PretrainedConfig``: its keys as attributes, which is all the MTP rewrite and the weight
rules read. Every input this module cannot plan raises :class:`PlanError`, one line that
names the file and what is wrong.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_draft import files
from hybrid_draft.adapter import draftplan, internals, rules, sharing
from hybrid_draft.adapter.draftplan import OWN_CHECKPOINT, is_mtp, mtp_layers
from hybrid_draft.core import checkpoint, objectstore
from hybrid_draft.core.planning import DraftPlan

CONFIG_NAME = "config.json"


class PlanError(ValueError):
    """A checkpoint that cannot be planned: one line naming the input and the problem."""


@dataclass(frozen=True)
class Draft:
    draft_class: str | None
    rule_source: str
    #: The draft's effective rule under hybrid-draft (None: it has none).
    is_unused: Callable[[str], bool] | None
    #: The rule stock vLLM applies (only when the class ships one).
    vllm_rule: Callable[[str], bool] | None
    #: The MTP layers the draft's config declares (vLLM's ``n_predict``), if it says.
    mtp_layers: int | None = None
    #: What reading the config found, as ``(code, detail)`` (``planning.WARNINGS``).
    notes: tuple[tuple[str, str], ...] = ()
    #: The modules vLLM replaces with the target's once the draft is loaded (``sharing``).
    shared: frozenset[str] = frozenset()


def _vllm_version() -> str:
    import vllm  # noqa: F401 - the version is the imported vLLM's

    return f"vLLM {internals.vllm_version() or '(unknown version)'}"


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Silence one vLLM logger for a call whose failure this module reports itself."""
    logger = logging.getLogger(logger_name)
    before, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = before


def _known_model_type(model_type: Any) -> bool:
    """Whether transformers or vLLM has a config class for ``model_type`` (no code to run)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return isinstance(model_type, str) and (
        model_type in CONFIG_MAPPING or model_type in internals.config_registry()
    )


def read_config(
    model_dir: str, trust_remote_code: bool = False
) -> tuple[Any, tuple[tuple[str, str], ...]]:
    """The checkpoint's config as vLLM reads it, or as a plain config (see the module doc)."""
    from transformers import PretrainedConfig
    from vllm.transformers_utils.config import get_config

    path = Path(model_dir) / CONFIG_NAME
    try:  # confined to the checkpoint, a regular file, bounded (checkpoint.read_json)
        data = checkpoint.read_json(model_dir, CONFIG_NAME, checkpoint.CONFIG_LIMIT)
    except checkpoint.CheckpointError as exc:
        raise PlanError(str(exc)) from None
    except FileNotFoundError:
        raise PlanError(
            f"{path}: no such file (a checkpoint directory holds its {CONFIG_NAME})"
        ) from None
    except OSError as exc:
        raise PlanError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except ValueError as exc:  # JSON and UTF-8 errors alike
        raise PlanError(f"{path}: not valid JSON: {files.error_line(exc)}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path}: holds a JSON {type(data).__name__}, not an object")
    model_type = data.get("model_type")
    if trust_remote_code or not isinstance(model_type, str) or _known_model_type(model_type):
        try:
            with _quiet("vllm.transformers_utils.repo_utils"):  # its retry log, not ours
                return get_config(model_dir, trust_remote_code=trust_remote_code), ()
        except Exception as exc:
            if trust_remote_code or model_type is not None:
                raise PlanError(f"{path}: vLLM cannot read it: {files.error_line(exc)}") from None
    # A model type nobody here knows: its keys are all the rewrite and the rules read.
    try:
        config = PretrainedConfig.from_dict(data)
    except Exception as exc:
        raise PlanError(f"{path}: not a model config: {files.error_line(exc)}") from None
    auto_map = data.get("auto_map")
    code = auto_map.get("AutoConfig") if isinstance(auto_map, dict) else None
    if code:
        note = (
            "needs_trust_remote_code",
            f"model_type {model_type!r} is defined by code "
            f"shipped with the checkpoint ({code}); plan read {CONFIG_NAME} as a plain "
            "config without running it. vLLM serves this checkpoint only with "
            "--trust-remote-code",
        )
    else:
        note = (
            "unknown_model_type",
            f"model_type {model_type!r} is not one transformers "
            f"or vLLM knows, and the checkpoint ships no configuration code; plan read "
            f"{CONFIG_NAME} as a plain config",
        )
    return config, (note,)


def _architectures(config: Any) -> list[str]:
    archs = getattr(config, "architectures", None)
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list | tuple) else []


def mtp_draft(model_dir: str, trust_remote_code: bool = False) -> Draft:
    """The draft ``method: mtp`` builds from this checkpoint, and whose rule prunes it."""
    from vllm.config.speculative import SpeculativeConfig
    from vllm.model_executor.models.registry import ModelRegistry

    path = Path(model_dir) / CONFIG_NAME
    config, notes = read_config(model_dir, trust_remote_code)
    before = _architectures(config)
    if not before:
        raise PlanError(f"{path}: names no architectures (vLLM needs one to pick a model)")
    target = copy.deepcopy(config)  # the override rewrites the config in place
    try:
        config = SpeculativeConfig.hf_config_override(config)
    except Exception as exc:
        raise PlanError(
            f"{path}: vLLM's MTP rewrite of {before[0]} fails: {files.error_line(exc)}"
        ) from None
    after = _architectures(config)
    if not after or after == before:
        if before[0] not in ModelRegistry.get_supported_archs():
            raise PlanError(
                f"{path}: architecture {before[0]!r} is not one {_vllm_version()} supports"
            )
        raise PlanError(
            f"{path}: {_vllm_version()} has no MTP draft for {before[0]} "
            "(speculative method 'mtp' does not apply to it)"
        )
    if before[0] not in ModelRegistry.get_supported_archs():
        notes = (
            *notes,
            (
                "unsupported_architecture",
                f"{_vllm_version()} does not register "
                f"{before[0]}: it cannot load the target this draft belongs to",
            ),
        )
    layers = mtp_layers(config)
    cls = internals.load_model_class(after[0])
    if cls is None:
        return Draft(
            after[0],
            "none",
            None,
            None,
            layers,
            (
                *notes,
                (
                    "draft_class_unavailable",
                    f"{_vllm_version()} cannot import the draft class "
                    f"of {after[0]} on this host: its rule is unknown here",
                ),
            ),
        )
    source = rules.rule_source(cls)
    shared = sharing.expected(cls, 1, "mtp", is_mtp(after[0]))
    if source == "vllm":
        rule = rules.probe(cls, config)
        return Draft(cls.__name__, source, rule, rule, layers, notes, shared)
    if source == "hybrid-draft":
        ours = rules.rule_for(cls)
        assert ours is not None
        rule = ours.bind(rules.config_for(cls, target, config))
        return Draft(cls.__name__, source, rule, None, layers, notes, shared)
    return Draft(cls.__name__, source, None, None, layers, notes, shared)


def draft_classes(mtp_only: bool = False) -> list[dict[str, str]]:
    """Every speculative draft architecture the installed vLLM registers (or only the MTP
    ones: half the imports), its class, its kind, and whose checkpoint-weight rule prunes
    it (vLLM's, ours, none), with why.

    A class that fails to import here (a CUDA-only module on a CPU host) is listed with
    the error, not raised.
    """
    import importlib

    out = []
    for arch, (module, name) in internals.speculative_architectures().items():
        kind = "mtp" if is_mtp(arch) else "standalone"
        if mtp_only and kind != "mtp":
            continue
        row = {"architecture": arch, "class": name, "kind": kind, "rule": "none"}
        try:
            cls = getattr(importlib.import_module(module), name)
        except Exception as exc:  # a CUDA-only module: say so, list the rest
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            ours = [k for k in rules.RULES if k[1] == name and k[0].startswith(module)]
            row["detail"] = (
                f"{module} does not import here ({type(exc).__name__}: "
                f"{reason[:120]})"
                + ("; hybrid-draft has a rule for it where it imports" if ours else "")
            )
            out.append(row)
            continue
        row["class"] = cls.__name__
        row["rule"] = rules.rule_source(cls)
        row["detail"] = _detail(cls, arch, kind, row["rule"])
        out.append(row)
    return out


def _detail(cls: type, arch: str, kind: str, source: str) -> str:
    where = f"{cls.__module__}.{cls.__name__}"
    if source == "vllm":
        owner = next(k for k in cls.__mro__ if "is_unused_checkpoint_weight" in vars(k))
        inherited = "" if owner is cls else f", inherited from {owner.__name__}"
        return f"vLLM's own is_unused_checkpoint_weight ({where}{inherited})"
    if source == "hybrid-draft":
        rule = rules.rule_for(cls)
        assert rule is not None
        loader = rules.loader_of(cls)
        shared = (
            f"; {loader.__name__}.load_weights, shared"
            if loader is not None and loader is not cls
            else ""
        )
        return f"{rule.doc} ({where}{shared})"
    if kind == "standalone":
        return f"{OWN_CHECKPOINT.get(arch, 'a checkpoint of its own, loaded whole')} ({where})"
    if rules.loader_of(cls) is None:
        return f"no load_weights on this platform: vLLM's stub ({where})"
    return f"no rule for its load_weights ({where})"


def rules_summary(classes: list[dict[str, str]]) -> str:
    """One line: how many of the MTP draft classes prune their checkpoint, and by whose rule."""
    mtp = [c for c in classes if c["kind"] == "mtp"]
    pruned = [c for c in mtp if c["rule"] != "none"]
    by = {source: sum(c["rule"] == source for c in pruned) for source in ("vllm", "hybrid-draft")}
    line = (
        f"{len(pruned)} of {len(mtp)} MTP draft classes prune their checkpoint "
        f"({by['vllm']} vLLM, {by['hybrid-draft']} hybrid-draft)"
    )
    rest = [c["class"] for c in mtp if c["rule"] == "none"]
    return line + (f"; not: {', '.join(rest)}" if rest else "")


def for_model_dir(
    model_dir: str, trust_remote_code: bool = False, skip_replaced: bool = True
) -> DraftPlan:
    """The plan of a same-checkpoint MTP draft of ``model_dir`` (for ``hybrid-draft plan``).

    Raises ``checkpoint.CheckpointError`` or :class:`PlanError` (one line each)."""
    shards = tuple(checkpoint.read_checkpoint(model_dir))
    return _plan(model_dir, shards, trust_remote_code, skip_replaced)


def for_object_store(
    uri: str,
    config_dir: str,
    trust_remote_code: bool = False,
    skip_replaced: bool = True,
    access: objectstore.Access | None = None,
) -> DraftPlan:
    """The plan of a same-checkpoint MTP draft of a checkpoint in object storage, as a Run:ai
    target's draft is planned: its JSON files copied into ``config_dir`` (the caller's
    temporary directory), each shard's header read by ranged requests, each bounded by
    ``access`` (``core.objectstore``), no tensor.

    Raises ``checkpoint.CheckpointError`` or :class:`PlanError` naming ``uri``."""
    try:
        objectstore.pull_configs(uri, config_dir)
        found = objectstore.list_shards(uri)
    except Exception as exc:  # the client's own error, on one line
        raise PlanError(f"{uri}: cannot be listed: {files.error_line(exc)}") from None
    if not found:
        raise PlanError(f"{uri}: holds no *.safetensors objects")
    try:
        shards = tuple(objectstore.read_shards(found, access))
    except checkpoint.CheckpointError:
        raise
    except Exception as exc:
        raise PlanError(f"{uri}: shard headers cannot be read: {files.error_line(exc)}") from None
    try:
        return _plan(config_dir, shards, trust_remote_code, skip_replaced)
    except PlanError as exc:
        raise PlanError(str(exc).replace(config_dir, uri.rstrip("/"))) from None


def _plan(
    config_dir: str,
    shards: tuple[checkpoint.Shard, ...],
    trust_remote_code: bool,
    skip_replaced: bool,
) -> DraftPlan:
    draft = mtp_draft(config_dir, trust_remote_code=trust_remote_code)
    try:  # a rule reads the config: one that lacks what it needs fails here
        plan = DraftPlan(
            shards=shards,
            draft_class=draft.draft_class,
            rule_source=draft.rule_source,
            rule=draft.is_unused,
            vllm_rule=draft.vllm_rule,
            shared=draft.shared if skip_replaced else frozenset(),
            mtp_layers=draft.mtp_layers,
            notes=draft.notes,
            host_blocker=draftplan.host_blocker(),
        )
        plan.is_unused  # noqa: B018 - evaluate the rule here, once
        plan.vllm_unused  # noqa: B018
    except Exception as exc:
        raise PlanError(
            f"{config_dir}: the {draft.draft_class} weight rule fails on this config: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return plan
