"""Every private vLLM name the layer relies on, probed by shape once per process.

vLLM's private names change without notice between releases. A name that still exists
but takes other arguments or returns another tuple would pass a check by name and then
fail mid-load; so each name here is described by the shape the layer uses it by
(:class:`Name`: the parameters it passes, by name and position; the keywords it passes;
how many values it unpacks from the result, read from the function's own ``return``
statements; the dataclass fields it reads), and :func:`capabilities` checks every one of
them against this vLLM once per process. A part of the layer (:data:`PARTS`) with a name
missing or of another shape is off, with the name and the shape found; its loads stay on
vLLM's own path (``patch`` says so with a ``hybrid_draft.part_skipped`` event).

The rest of the adapter calls private vLLM code through the wrappers below, so what is
probed is what is called; the two places that cannot (the draft loaders, subclasses of
``DefaultModelLoader`` that use its private members; the load figures, which wrap its
methods) use only names probed here, and only while their part is on. The wrappers that
planning, the one pass and the load formats' registration call raise :class:`Unsupported`
rather than call a name of another shape (the per-tensor ones do not: only loads of a part
that is on call them). Public vLLM API (``LoadConfig``, ``get_model``, ``init_logger``) is
used where it is needed. This module imports no other module of the layer's adapter and
nothing from vLLM at module level.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import re

    from vllm.config import VllmConfig
    from vllm.config.load import LoadConfig
    from vllm.config.model import ModelConfig
    from vllm.distributed.parallel_state import GroupCoordinator
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

#: The package vLLM's ``get_model`` lives in, and what the layer wraps.
MODULE = "vllm.model_executor.model_loader"
TARGET = f"{MODULE}.get_model"
#: The parameters of ``get_model`` the wrapper reads.
REQUIRED = ("vllm_config", "model_config", "load_config")
#: The vLLM releases every part of the layer is on for, and tested on (``hybrid-draft
#: doctor`` fails where a part is off on one of them). 0.32.0 is vLLM's CPU build.
SUPPORTED_RELEASES = ("0.32.0", "0.33.0", "0.34.0")
#: The original instanttensor-hybrid-draft-loader mod's marker in the file it rewrites.
TEXT_PATCH_MARKER = "# spark-vllm mod: instanttensor-hybrid-draft-loader"


@dataclasses.dataclass(frozen=True)
class Name:
    """One private vLLM name and the shape the layer uses it by.

    ``path`` is ``module:attr`` or ``module:Class.attr``, or ``loader.attr`` for an
    instance attribute of a fresh ``DefaultModelLoader``. ``params``: the positional
    parameters the layer passes, in order (``self`` included for a method); the callable
    must take exactly these by position and require nothing else. ``keywords``: the
    keyword arguments the layer passes. ``returns``: the length of the tuple the layer
    unpacks. ``fields``: the dataclass fields the layer reads.
    """

    path: str
    params: tuple[str, ...] | None = None
    keywords: tuple[str, ...] = ()
    returns: int | None = None
    fields: tuple[str, ...] = ()
    #: Further parameter lists a release may have instead of ``params``, each accepted as
    #: well; the wrapper passes the arguments of the one found (:func:`params_found`).
    also: tuple[tuple[str, ...], ...] = ()

    def accepted(self) -> tuple[tuple[str, ...], ...]:
        """Every parameter list the layer can call this name by, ``params`` first."""
        return (self.params, *self.also) if self.params is not None else ()

    def expected(self) -> str:
        """The shape the layer uses, as :func:`found` writes shapes."""
        if self.fields:
            return f"fields {', '.join(self.fields)}"
        if self.params is None:
            return "present"
        kws = [f"*, {k}" if i == 0 else k for i, k in enumerate(self.keywords)]
        texts = [f"({', '.join([*params, *kws])})" for params in self.accepted()]
        text = " or ".join(texts)
        return text + (f" -> {self.returns} values" if self.returns is not None else "")


_DL = "vllm.model_executor.model_loader.default_loader:DefaultModelLoader"
_D = "vllm.model_executor.model_loader.default_loader"
_PREPARE_ARGS = ("model_name_or_path", "subfolder", "revision", "fall_back_to_pt")
PREPARE_WEIGHTS = Name(
    f"{_DL}._prepare_weights", ("self", *_PREPARE_ARGS, "allow_patterns_overrides"), returns=4
)
GET_WEIGHTS_ITERATOR = Name(f"{_DL}._get_weights_iterator", ("self", "source"))
GET_ALL_WEIGHTS = Name(f"{_DL}.get_all_weights", ("self", "model_config", "model"))
LOAD_WEIGHTS = Name(f"{_DL}.load_weights", ("self", "model", "model_config"))
TRACK_WEIGHTS_LOADING = Name(
    f"{_DL}.track_weights_loading", ("self", "model", "loaded_weights"), ("quantized",)
)
COUNTER = Name(f"{_DL}.counter_before_loading_weights")
SOURCE = Name(
    f"{_DL}.Source",
    fields=(
        "model_or_path",
        "revision",
        "subfolder",
        "prefix",
        "fall_back_to_pt",
        "allow_patterns_overrides",
        "is_unused_weight",
    ),
)
#: 0.33: ``(self, model_config)``; 0.34 also passes the model (read under EPLB only).
INIT_EP_WEIGHT_FILTER = Name(
    f"{_DL}._init_ep_weight_filter",
    ("self", "model_config"),
    also=(("self", "model", "model_config"),),
)
LOCAL_EXPERT_IDS = Name("loader.local_expert_ids")
ENCODER_ONLY_PREFIXES = Name("loader._encoder_only_lm_prefixes")
ENCODER_ONLY_MAPPER = Name("loader._encoder_only_weights_mapper")
SHOULD_SKIP_WEIGHT = Name(
    "vllm.model_executor.model_loader.ep_weight_filter:should_skip_weight",
    ("weight_name", "local_expert_ids"),
)
REGISTER_MODEL_LOADER = Name(f"{MODULE}:register_model_loader", ("load_format",))
GET_MODEL_ARCHITECTURE = Name(
    "vllm.model_executor.model_loader.utils:get_model_architecture", ("model_config",)
)
ENABLE_TQDM = Name(
    "vllm.model_executor.model_loader.weight_utils:enable_tqdm", ("use_tqdm_on_load",)
)
LOAD_MODEL = Name(
    "vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",
    ("self", "vllm_config", "model_config"),
)
GET_DRAFT_LOAD_CONFIG = Name(
    "vllm.model_executor.model_loader.utils:get_draft_load_config", ("vllm_config",)
)
GET_PP_GROUP = Name("vllm.distributed.parallel_state:get_pp_group", ())
FILTER_ENCODER_ONLY = Name(
    f"{_D}:filter_mm_encoder_only_safetensors_files",
    ("hf_weights_files", "hf_folder", "index_file", "language_model_prefixes"),
    ("weights_mapper",),
)
FILTER_BY_WEIGHT_NAME = Name(
    f"{_D}:filter_safetensors_files_by_weight_name", ("hf_weights_files", "is_unused_weight")
)
CURRENT_CONFIG_OR_NONE = Name("vllm.config:get_current_vllm_config_or_none", ())
#: 0.34's merged linear layers record the shards a load filled; ``track_weights_loading``
#: pops that record. Not part of any part: where present, a question to that check keeps it.
LOADED_SHARD_IDS = "loaded_shard_ids"

# vLLM's Run:ai Model Streamer loader (not a DefaultModelLoader): its stream and its files.
_RUNAI = "vllm.model_executor.model_loader.runai_streamer_loader"
RUNAI_GET_ALL_WEIGHTS = Name(
    f"{_RUNAI}:RunaiModelStreamerLoader.get_all_weights", ("self", "model_config", "model")
)
RUNAI_PREPARE_WEIGHTS = Name(
    f"{_RUNAI}:RunaiModelStreamerLoader._prepare_weights",
    ("self", "model_name_or_path", "revision"),
)
RUNAI_ITERATOR = Name(
    f"{_RUNAI}:runai_safetensors_weights_iterator",
    ("hf_weights_files", "use_tqdm_on_load", "is_distributed"),
)

# The proposers' replacement of an MTP draft's embedding and head (the skip relies on it).
_V1 = "vllm.v1.spec_decode.eagle:EagleProposer"
_MRV2 = "vllm.v1.worker.gpu.spec_decode.eagle.utils"
SHARE_EMBEDDINGS_V1 = Name(f"{_V1}._maybe_share_embeddings")
SHARE_LM_HEAD_V1 = Name(f"{_V1}._maybe_share_lm_head")
SHARE_TARGET_EMBED = Name(
    f"{_MRV2}:maybe_share_target_embed", ("draft_model", "draft_inner", "target_inner")
)
SHARE_TARGET_LM_HEAD = Name(
    f"{_MRV2}:share_target_lm_head", ("draft_model", "target_lm_head", "quantization")
)
LOAD_EAGLE_MODEL = Name(f"{_MRV2}:load_eagle_model", ("target_model", "vllm_config"))

# A reload in place: the model runners' ``reload_weights`` (which reloads the target only),
# their draft, and the steps vLLM's reload takes around a model's ``load_weights`` (0.34's
# lifecycle, 0.33's layerwise helpers), which the draft's reload takes too.
RUNNER_V1 = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
RUNNER_V2 = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
_RELOAD_PARAMS = ("self", "weights_iterator", "weights_path", "is_checkpoint_format")
RELOAD_WEIGHTS_V1 = Name(f"{RUNNER_V1}.reload_weights", _RELOAD_PARAMS)
GET_DRAFT_MODEL_V1 = Name(f"{RUNNER_V1}.get_draft_model", ("self",))
RELOAD_WEIGHTS_V2 = Name(f"{RUNNER_V2}.reload_weights", _RELOAD_PARAMS)
GET_DRAFT_MODEL_V2 = Name(f"{RUNNER_V2}.get_draft_model", ("self",))
_RELOAD = "vllm.model_executor.model_loader.reload"
START_RELOAD = Name(f"{_RELOAD}.lifecycle:start_reload", ("model",))
FINISH_RELOAD = Name(f"{_RELOAD}.lifecycle:finish_reload", ("model", "model_config", "device"))
_LAYERWISE = f"{_RELOAD}.layerwise"
INITIALIZE_LAYERWISE_RELOAD = Name(f"{_LAYERWISE}:initialize_layerwise_reload", ("model",))
FINALIZE_LAYERWISE_PROCESSING = Name(
    f"{_LAYERWISE}:finalize_layerwise_processing", ("model", "model_config")
)


# A trainer's weight-transfer session: vLLM's worker methods that run one (the target's, or
# vLLM's own draft session), and the steps of vLLM's layerwise reload the draft's update
# takes, one layer at a time, with the copy of each processed layer into its original
# storage held back until the session's end (all or nothing).
WORKER = "vllm.v1.worker.gpu_worker:Worker"
START_WEIGHT_UPDATE = Name(f"{WORKER}.start_weight_update", ("self",))
START_DRAFT_WEIGHT_UPDATE = Name(f"{WORKER}.start_draft_weight_update", ("self",))
UPDATE_WEIGHTS = Name(f"{WORKER}.update_weights", ("self", "update_info"))
FINISH_WEIGHT_UPDATE = Name(f"{WORKER}.finish_weight_update", ("self",))
LAYERWISE_INFO = Name(f"{_LAYERWISE}:LAYERWISE_INFO")
COPY_AND_RESTORE_KERNEL_TENSORS = Name(
    f"{_LAYERWISE}:_copy_and_restore_kernel_tensors", ("layer", "info")
)
PLACE_KERNEL_TENSORS = Name(f"{_LAYERWISE}:_place_kernel_tensors", ("layer", "info"))
LAYER_RELOADING_INFO = Name(
    f"{_RELOAD}.types:LayerReloadingInfo",
    fields=(
        "kernel_tensors",
        "kernel_non_persistent_buffers",
        "loaded_weights",
        "load_numel",
        "load_numel_total",
    ),
)
FINALIZE_LAYERWISE_RELOAD = Name(
    f"{_LAYERWISE}:finalize_layerwise_reload", ("model", "model_config")
)
#: The attention-like layers vLLM's layerwise reload processes last (MLA's ``W_UK_T`` and
#: ``W_UV``, derived from ``kv_b_proj``): processed again when a staged update is undone.
IS_DEFERRED_ATTENTION = Name(
    "vllm.model_executor.layers.attention:is_deferred_attention_layer", ("layer",)
)
#: The staging of the draft's own layers that a session's or a direct update's draft takes.
_STAGING = (
    INITIALIZE_LAYERWISE_RELOAD,
    LAYERWISE_INFO,
    COPY_AND_RESTORE_KERNEL_TENSORS,
    PLACE_KERNEL_TENSORS,
    LAYER_RELOADING_INFO,
    IS_DEFERRED_ATTENTION,
)
_SESSION_NAMES = (
    START_WEIGHT_UPDATE,
    START_DRAFT_WEIGHT_UPDATE,
    UPDATE_WEIGHTS,
    FINISH_WEIGHT_UPDATE,
    *_STAGING,
)

# A trainer's direct ``load_weights`` calls on the served target (``adapter/direct.py``): the
# caller's own end of an update (vLLM's post-load processing, which verl and NeMo RL call on
# each model they fed), and a model loader's ``load_weights`` on the served model (AReaL's
# sync from a new checkpoint on disk).
PROCESS_WEIGHTS_AFTER_LOADING = Name(
    "vllm.model_executor.model_loader.utils:process_weights_after_loading",
    ("model", "model_config", "target_device"),
)
#: The model runner's methods that run the draft's forward, each with what it ends of a
#: direct update when called: its step (``execute_model``: the target's forward, then the
#: draft's proposal) and the dummy batch an idle data-parallel rank runs
#: (``Worker.execute_dummy_batch`` calls ``_dummy_run``, the drafter's ``dummy_run`` in
#: it), on the V1 runner and model runner v2 alike. Wrapped on the runner instance, taking
#: whatever arguments vLLM passes.
RUNNER_STEPS: Mapping[str, str] = MappingProxyType(
    {"execute_model": "next_step", "_dummy_run": "dummy_batch"}
)
#: vLLM's re-derivation of a draft's quantized copy of the target's head
#: (``draft_lm_head_quantization``), which its own weight updates run: optional (a vLLM
#: without it makes no such copy).
REFRESH_QUANTIZED_LM_HEADS = (
    "vllm.model_executor.layers.quantization.online.lm_head:refresh_quantized_lm_heads"
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One set of private names a part works with, as one line of vLLM releases has them
    (``label`` says which, for ``hybrid-draft doctor``)."""

    label: str
    names: tuple[Name, ...]


def _one(*names: Name) -> tuple[Layout, ...]:
    return (Layout("", names),)


#: The private vLLM names each part of the layer relies on, as the layouts it accepts: a
#: part is on where every name of one of its layouts is present in the shape the layer uses.
PARTS: Mapping[str, tuple[Layout, ...]] = MappingProxyType(
    {
        "draft_loaders": _one(
            PREPARE_WEIGHTS,
            GET_WEIGHTS_ITERATOR,
            GET_ALL_WEIGHTS,
            LOAD_WEIGHTS,
            TRACK_WEIGHTS_LOADING,
            COUNTER,
            SOURCE,
            LOCAL_EXPERT_IDS,
            ENCODER_ONLY_PREFIXES,
            SHOULD_SKIP_WEIGHT,
            REGISTER_MODEL_LOADER,
            GET_MODEL_ARCHITECTURE,
            ENABLE_TQDM,
        ),
        "one_pass": _one(
            GET_ALL_WEIGHTS,
            INIT_EP_WEIGHT_FILTER,
            LOAD_MODEL,
            GET_DRAFT_LOAD_CONFIG,
            GET_PP_GROUP,
        ),
        "direct_loads": _one(LOAD_MODEL),
        # A Run:ai target's stream seen (its one pass, its load figures) and its draft's
        # shards resolved as vLLM's Run:ai loader resolves them (local or object storage).
        "runai_stream": _one(RUNAI_GET_ALL_WEIGHTS, RUNAI_PREPARE_WEIGHTS, RUNAI_ITERATOR),
        # The pipeline-parallel guard's InstantTensor read without vLLM's world group.
        "ungrouped_draft": _one(
            PREPARE_WEIGHTS,
            GET_WEIGHTS_ITERATOR,
            COUNTER,
            LOCAL_EXPERT_IDS,
            ENCODER_ONLY_PREFIXES,
            ENCODER_ONLY_MAPPER,
            FILTER_ENCODER_ONLY,
            FILTER_BY_WEIGHT_NAME,
            SHOULD_SKIP_WEIGHT,
            CURRENT_CONFIG_OR_NONE,
        ),
        # The skip of what vLLM replaces: vLLM must replace the draft's embedding and head.
        "skip_replaced": (
            Layout("V1 proposers", (SHARE_EMBEDDINGS_V1, SHARE_LM_HEAD_V1, SHARE_TARGET_EMBED)),
            Layout(
                "model runner v2",
                (SHARE_TARGET_EMBED, SHARE_TARGET_LM_HEAD, LOAD_EAGLE_MODEL),
            ),
        ),
        # The draft reloaded with its target: a model runner's reload_weights and its draft,
        # and vLLM's steps of a reload in place (the first layout of the runner at hand that
        # is complete is the one a reload takes).
        "reload": (
            Layout(
                "model runner v2, lifecycle",
                (RELOAD_WEIGHTS_V2, GET_DRAFT_MODEL_V2, START_RELOAD, FINISH_RELOAD),
            ),
            Layout(
                "model runner v2, layerwise",
                (
                    RELOAD_WEIGHTS_V2,
                    GET_DRAFT_MODEL_V2,
                    INITIALIZE_LAYERWISE_RELOAD,
                    FINALIZE_LAYERWISE_PROCESSING,
                ),
            ),
            Layout(
                "V1 model runner, layerwise",
                (
                    RELOAD_WEIGHTS_V1,
                    GET_DRAFT_MODEL_V1,
                    INITIALIZE_LAYERWISE_RELOAD,
                    FINALIZE_LAYERWISE_PROCESSING,
                ),
            ),
        ),
        # The draft updated with its target by a trainer's weight-transfer session: the
        # worker's session methods and vLLM's layerwise reload, finished by its own
        # ``finalize_layerwise_reload`` (0.34: the post-load hooks run there) or, where that
        # takes any arguments (0.33), by ``finalize_layerwise_processing``.
        "weight_update": (
            Layout(
                "worker sessions, layerwise reload", (*_SESSION_NAMES, FINALIZE_LAYERWISE_RELOAD)
            ),
            Layout(
                "worker sessions, layerwise processing",
                (*_SESSION_NAMES, FINALIZE_LAYERWISE_PROCESSING),
            ),
        ),
        # The draft updated with its target by a trainer's direct ``load_weights`` calls: the
        # same staging, the caller's post-load processing and a loader's ``load_weights``.
        "direct_update": (
            Layout(
                "layerwise reload",
                (*_STAGING, FINALIZE_LAYERWISE_RELOAD, PROCESS_WEIGHTS_AFTER_LOADING, LOAD_WEIGHTS),
            ),
            Layout(
                "layerwise processing",
                (
                    *_STAGING,
                    FINALIZE_LAYERWISE_PROCESSING,
                    PROCESS_WEIGHTS_AFTER_LOADING,
                    LOAD_WEIGHTS,
                ),
            ),
        ),
    }
)
#: Parts probed at each use rather than once per process: their modules import vLLM's
#: model loader themselves, so at the hook (inside that import) they may be half-imported.
#: ``reload`` is probed for the model runner at hand only (:func:`reload_layout`).
LATE = frozenset({"skip_replaced", "reload", "weight_update", "direct_update"})


def vllm_version() -> str | None:
    """The version of the vLLM this process imported (None before it is imported)."""
    return getattr(sys.modules.get("vllm"), "__version__", None)


# --- the probe ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Off:
    """Why one part is off: its names this vLLM lacks, and those of another shape (name ->
    the shape found)."""

    missing: tuple[str, ...] = ()
    shapes: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    #: Set instead when the part failed to install (its names were all as expected).
    failure: str | None = None
    #: For a part of several layouts: why each is off, by its label.
    layouts: Mapping[str, Off] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    @property
    def reason(self) -> str:
        if self.failure is not None:
            return self.failure
        if self.layouts:
            return "; ".join(f"{label}: {off.reason}" for label, off in self.layouts.items())
        parts = []
        if self.missing:
            parts.append(f"this vLLM has no {', '.join(self.missing)}")
        for path, shape in self.shapes.items():
            parts.append(f"this vLLM's {path} is {shape}, not {_BY_PATH[path].expected()}")
        return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What this vLLM lets the layer do: the parts that are off, and why."""

    vllm_version: str | None
    off: Mapping[str, Off]
    #: Every probed name this vLLM lacks.
    missing: frozenset[str]
    #: Every probed name of another shape than the layer's, with the shape found.
    shapes: Mapping[str, str]
    #: The parameter list found of each probed name that accepts several.
    params: Mapping[str, tuple[str, ...]] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )
    #: The label of the layout each part of several is on by.
    layouts: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def reason(self, part: str) -> str | None:
        """Why ``part`` is off (None: it is on)."""
        off = self.off.get(part)
        return off.reason if off is not None else None

    def usable(self, name: Name) -> bool:
        """Whether ``name`` exists here with the shape the layer uses it by."""
        return name.path not in self.shapes and name.path not in self.missing

    def without(self, part: str, failure: str) -> Capabilities:
        """These capabilities with ``part`` off for ``failure`` (it failed to install)."""
        if part in self.off:
            return self
        off = MappingProxyType({**self.off, part: Off(failure=failure)})
        return dataclasses.replace(self, off=off)


_BY_PATH = {
    name.path: name for layouts in PARTS.values() for layout in layouts for name in layout.names
}
_ABSENT = object()


def _lookup(path: str, loader: object) -> object:
    if path.startswith("loader."):
        return getattr(loader, path.partition(".")[2], _ABSENT) if loader is not None else _ABSENT
    module, _, attrs = path.partition(":")
    try:
        obj: object = __import__(module, fromlist=["_"])
        for attr in attrs.split("."):
            obj = getattr(obj, attr)
    except Exception:  # missing or failing: either way not a shape we know
        return _ABSENT
    return obj


def _returned(function: Callable[..., object]) -> set[int]:
    """The lengths of the tuples ``function``'s own ``return`` statements build, read from
    its source (empty when it cannot be read or returns no tuple literal: unknown)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function))))
    except (OSError, TypeError, SyntaxError):
        return set()
    node = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return set()
    out: set[int] = set()
    stack: list[ast.AST] = list(node.body)
    while stack:
        item = stack.pop()
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue  # a nested function's returns are not this one's
        if isinstance(item, ast.Return) and isinstance(item.value, ast.Tuple):
            out.add(len(item.value.elts))
        stack.extend(ast.iter_child_nodes(item))
    return out


def _takes(expected: tuple[str, ...], keywords: tuple[str, ...], signature: Any) -> bool:
    """Whether a callable of ``signature`` takes exactly ``expected`` by position, requires
    nothing else and takes ``keywords``."""
    params = list(signature.parameters.values())
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    names = tuple(p.name for p in positional[: len(expected)])
    kinds_ok = all(p.kind != p.VAR_POSITIONAL for p in positional[: len(expected)])
    extra_required = [
        p
        for p in params[len(expected) :]
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return (
        names == expected and kinds_ok and not extra_required and all(k in named for k in keywords)
    )


def params_found(name: Name, obj: object) -> tuple[str, ...] | None:
    """Which of ``name``'s accepted parameter lists ``obj`` takes (None: none of them)."""
    try:
        signature = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return next((p for p in name.accepted() if _takes(p, name.keywords, signature)), None)


def found(name: Name, obj: object) -> str | None:
    """The shape ``obj`` has if it is not one ``name`` is used by (None: it is)."""
    if name.fields:
        try:
            have = {f.name for f in dataclasses.fields(obj)}  # type: ignore[arg-type]
        except TypeError:
            return "not a dataclass"
        lacking = [f for f in name.fields if f not in have]
        return f"a dataclass without {', '.join(lacking)}" if lacking else None
    if name.params is None:
        return None
    if not callable(obj):
        return "not callable"
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "a callable without a readable signature"
    signature = signature.replace(  # the shape, without annotations
        parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
        return_annotation=signature.empty,
    )
    if params_found(name, obj) is None:
        return f"{signature}"
    if name.returns is not None:
        lengths = _returned(obj)
        if lengths and lengths != {name.returns}:
            return f"{signature} -> {', '.join(map(str, sorted(lengths)))} values"
    return None


def _fresh_loader() -> object:
    try:
        from vllm.config.load import LoadConfig
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        return DefaultModelLoader(LoadConfig(load_format="safetensors"))
    except Exception:  # reported as the missing instance attributes
        return None


@dataclasses.dataclass(frozen=True)
class _Probe:
    missing: dict[str, str]
    shapes: dict[str, str]
    params: dict[str, tuple[str, ...]]


def _probe(names: Mapping[str, Name]) -> _Probe:
    loader = _fresh_loader() if any(p.startswith("loader.") for p in names) else None
    out = _Probe({}, {}, {})
    for path, name in names.items():
        obj = _lookup(path, loader)
        if obj is _ABSENT:
            out.missing[path] = path
            continue
        shape = found(name, obj)
        if shape is not None:
            out.shapes[path] = shape
        elif name.also:
            out.params[path] = params_found(name, obj) or ()
    return out


def _part_off(layouts: tuple[Layout, ...], probe: _Probe) -> tuple[Off | None, str]:
    """Whether a part of ``layouts`` is off by ``probe`` (None: on), and the label of the
    layout it is on by."""
    offs: dict[str, Off] = {}
    for layout in layouts:
        lacking = tuple(n.path for n in layout.names if n.path in probe.missing)
        other = {n.path: probe.shapes[n.path] for n in layout.names if n.path in probe.shapes}
        if not lacking and not other:
            return None, layout.label
        offs[layout.label] = Off(missing=lacking, shapes=MappingProxyType(other))
    if len(offs) == 1:
        return next(iter(offs.values())), ""
    return Off(
        missing=tuple(dict.fromkeys(p for o in offs.values() for p in o.missing)),
        shapes=MappingProxyType({k: v for o in offs.values() for k, v in o.shapes.items()}),
        layouts=MappingProxyType(offs),
    ), ""


@functools.cache
def capabilities() -> Capabilities:
    """Probe every name of :data:`PARTS` but the :data:`LATE` ones against this vLLM, once
    per process."""
    early = {part: layouts for part, layouts in PARTS.items() if part not in LATE}
    names = {n.path: n for layouts in early.values() for lay in layouts for n in lay.names}
    probe = _probe(names)
    off: dict[str, Off] = {}
    labels: dict[str, str] = {}
    for part, layouts in early.items():
        why, label = _part_off(layouts, probe)
        if why is not None:
            off[part] = why
        elif label:
            labels[part] = label
    return Capabilities(
        vllm_version=vllm_version(),
        off=MappingProxyType(off),
        missing=frozenset(probe.missing),
        shapes=MappingProxyType(probe.shapes),
        params=MappingProxyType(probe.params),
        layouts=MappingProxyType(labels),
    )


def late_part(part: str) -> tuple[Off | None, str]:
    """Probe one :data:`LATE` part now: why it is off (None: on), and the label of the
    layout it is on by. Asked at each use: the answer is vLLM's as it is now."""
    layouts = PARTS[part]
    probe = _probe({n.path: n for lay in layouts for n in lay.names})
    return _part_off(layouts, probe)


def reload_layout(runner: str) -> tuple[Off | None, str]:
    """Probe the ``reload`` part for the model runner class ``runner`` (``module:Class``,
    the one whose ``reload_weights`` was called) now: why it is off (None: on), and the
    label of the layout a reload takes. Only that runner's layouts are probed: the other
    runner's module is not imported for it."""
    layouts = tuple(
        layout
        for layout in PARTS["reload"]
        if any(n.path.startswith(f"{runner}.") for n in layout.names)
    )
    if not layouts:
        return Off(failure=f"{runner} is not a model runner the layer reloads a draft for"), ""
    return _part_off(layouts, _probe({n.path: n for lay in layouts for n in lay.names}))


class Unsupported(Exception):
    """A private vLLM name the layer needs here has another shape on this vLLM."""


def problem(name: Name, alone: bool = False) -> str | None:
    """Why ``name`` cannot be used as the layer uses it on this vLLM (None: it can); with
    ``alone``, by probing that one name now rather than every name (the hook's own use)."""
    found: Capabilities | _Probe = _probe({name.path: name}) if alone else capabilities()
    shape = found.shapes.get(name.path)
    if shape is not None:
        return f"this vLLM's {name.path} is {shape}, not {name.expected()}"
    return f"this vLLM has no {name.path}" if name.path in found.missing else None


def _require(name: Name, alone: bool = False) -> None:
    why = problem(name, alone)
    if why is not None:
        raise Unsupported(why)


# --- get_model's own shape ---------------------------------------------------------------


def shape_problem(module: ModuleType) -> str | None:
    """Why this vLLM's ``get_model`` cannot be wrapped safely (None when it can)."""
    get_model = getattr(module, "get_model", None)
    if not callable(get_model):
        return f"{MODULE} has no callable get_model"
    try:
        params = inspect.signature(get_model).parameters
    except (TypeError, ValueError) as exc:
        return f"get_model has no readable signature: {exc}"
    missing = [p for p in REQUIRED if p not in params]
    if missing:
        return f"get_model has no parameter {', '.join(missing)}"
    try:
        from vllm.config.load import LoadConfig

        fields = {f.name for f in dataclasses.fields(LoadConfig)}
    except Exception as exc:  # any failure means "not a shape we know"
        return f"vllm.config.load.LoadConfig is not a dataclass: {exc!r}"
    if "load_format" not in fields:
        return "LoadConfig has no load_format field"
    return text_patch(module)


def text_patch(module: ModuleType) -> str | None:
    """The original text-patch mod rewrote this vLLM's loader: say so (None if not)."""
    path = getattr(module, "__file__", None)
    try:
        with open(path or "", encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return None
    if TEXT_PATCH_MARKER not in text:
        return None
    return (
        f"the instanttensor-hybrid-draft-loader mod has rewritten {path}; hybrid-draft does "
        "its job and will not stack a second wrapper on it: reinstall vLLM (or recreate the "
        "container without that mod), then hybrid-draft wraps get_model"
    )


# --- the wrappers ------------------------------------------------------------------------


def prepare_weights(
    loader: DefaultModelLoader,
    model_name_or_path: str,
    subfolder: str | None,
    revision: str | None,
    fall_back_to_pt: bool,
    allow_patterns_overrides: list[str] | None,
) -> tuple[str, list[str], bool, str]:
    """``DefaultModelLoader._prepare_weights``: folder, files, whether safetensors, index
    file. Raises :class:`Unsupported` on a vLLM where it has another shape."""
    _require(PREPARE_WEIGHTS)
    folder, files, use_safetensors, index_file = loader._prepare_weights(
        model_name_or_path, subfolder, revision, fall_back_to_pt, allow_patterns_overrides
    )
    return folder, files, use_safetensors, index_file


def runai_weight_files(
    load_config: LoadConfig, model_or_path: str, revision: str | None
) -> list[str]:
    """The shards vLLM's Run:ai loader resolves for ``model_or_path`` (a local directory,
    an object-storage address or a hub id): ``RunaiModelStreamerLoader._prepare_weights``.
    Raises :class:`Unsupported` on a vLLM where it has another shape."""
    from vllm.model_executor.model_loader.runai_streamer_loader import RunaiModelStreamerLoader

    _require(RUNAI_PREPARE_WEIGHTS)
    files: list[str] = RunaiModelStreamerLoader(load_config)._prepare_weights(
        model_or_path, revision
    )
    return files


def should_skip_weight(weight_name: str, local_expert_ids: set[int] | None) -> bool:
    """Whether vLLM's expert-parallel filter skips ``weight_name`` on this rank."""
    from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight as skip

    return bool(skip(weight_name, local_expert_ids))


def init_ep_weight_filter(
    loader: DefaultModelLoader, model: Any, model_config: ModelConfig
) -> None:
    """``DefaultModelLoader._init_ep_weight_filter``, as its ``load_weights`` calls it before
    reading (by the shape found: 0.34 passes the model too, read under EPLB only)."""
    _require(INIT_EP_WEIGHT_FILTER)
    takes = capabilities().params.get(INIT_EP_WEIGHT_FILTER.path, INIT_EP_WEIGHT_FILTER.params)
    init: Callable[..., None] = loader._init_ep_weight_filter
    if takes == ("self", "model_config"):
        init(model_config)
    else:
        init(model, model_config)


def local_expert_filter(
    load_config: LoadConfig, model_config: ModelConfig
) -> Callable[[str], bool]:
    """Whether a load of ``model_config`` on this rank skips a name (another rank's
    expert), by the very vLLM code its loader will run."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    _require(INIT_EP_WEIGHT_FILTER)
    _require(LOCAL_EXPERT_IDS)
    probe = DefaultModelLoader(load_config)
    takes = capabilities().params.get(INIT_EP_WEIGHT_FILTER.path, INIT_EP_WEIGHT_FILTER.params)
    if takes != ("self", "model_config"):
        from vllm.config import get_current_vllm_config_or_none

        current = get_current_vllm_config_or_none()
        if current is not None and current.parallel_config.enable_eplb:
            # Under EPLB vLLM filters by the layout of the draft it has built, which does
            # not exist yet: keep every expert (the draft's own load still filters).
            return lambda name: False
    # Without EPLB the model is not read: the draft's is not built yet.
    init_ep_weight_filter(probe, None, model_config)
    local = probe.local_expert_ids
    return lambda name: should_skip_weight(name, local)


def enable_tqdm(use_tqdm_on_load: bool) -> bool:
    """vLLM's answer to whether this rank shows a load progress bar."""
    from vllm.model_executor.model_loader.weight_utils import enable_tqdm as enabled

    return bool(enabled(use_tqdm_on_load))


def register_model_loader(load_format: str, cls: type) -> None:
    """Register ``cls`` with vLLM as the loader of ``load_format``."""
    from vllm.model_executor.model_loader import register_model_loader as register

    _require(REGISTER_MODEL_LOADER, alone=True)
    register(load_format)(cls)


def model_class(model_config: ModelConfig) -> type:
    """The class vLLM builds for ``model_config`` (its registry's resolution)."""
    from vllm.model_executor.model_loader.utils import get_model_architecture

    cls: type = get_model_architecture(model_config)[0]
    return cls


def draft_load_config(vllm_config: VllmConfig) -> LoadConfig:
    """The load config vLLM's proposers load the draft with."""
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    _require(GET_DRAFT_LOAD_CONFIG)
    return get_draft_load_config(vllm_config)


def pp_group() -> GroupCoordinator:
    """vLLM's pipeline-parallel group."""
    from vllm.distributed.parallel_state import get_pp_group

    _require(GET_PP_GROUP)
    return get_pp_group()


def pp_world_size() -> int | None:
    """The size of vLLM's pipeline-parallel group once initialised (None before)."""
    state = sys.modules.get("vllm.distributed.parallel_state")
    size = getattr(getattr(state, "_PP", None), "world_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def world_rank() -> int | None:
    """This process's rank in vLLM's world group once initialised (None before)."""
    state = sys.modules.get("vllm.distributed.parallel_state")
    rank = getattr(getattr(state, "_WORLD", None), "rank", None)
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def layout_names(part: str, layout: str) -> tuple[Name, ...]:
    """The names of ``part``'s layout labelled ``layout`` (as :func:`late_part` found it)."""
    return next(lay.names for lay in PARTS[part] if lay.label == layout)


@contextlib.contextmanager
def reloading(model: Any, model_config: ModelConfig, device: Any, layout: str) -> Iterator[None]:
    """vLLM's steps of a reload in place around ``model``'s ``load_weights``, by the
    ``reload`` part's ``layout`` (:func:`reload_layout`): 0.34's ``start_reload`` and
    ``finish_reload`` (its layerwise reload, or the direct one ``VLLM_RELOAD_MODE``
    selects), 0.33's layerwise helpers. Each layer is processed again (quantized layers
    repacked) and copied into its original storage, which CUDA graphs were captured on.
    The finish runs whatever the load did: the model is never left on the meta device."""
    names = layout_names("reload", layout)
    if START_RELOAD in names:
        from vllm.model_executor.model_loader.reload.lifecycle import (
            finish_reload,
            start_reload,
        )

        start_reload(model)
        try:
            yield
        finally:
            finish_reload(model, model_config, device)
        return
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_processing,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    try:
        yield
    finally:
        finalize_layerwise_processing(model, model_config)


def engram_pattern() -> re.Pattern[str] | None:
    """vLLM's pattern of the Engram tables it maps on the CPU (None: this vLLM has none)."""
    from vllm.model_executor.model_loader import weight_utils

    pattern: re.Pattern[str] | None = getattr(weight_utils, "_ENGRAM_WEIGHT_RE", None)
    return pattern


def config_registry() -> Mapping[str, object]:
    """vLLM's own config classes by model type (``vllm.transformers_utils.config``)."""
    try:
        from vllm.transformers_utils.config import _CONFIG_REGISTRY
    except ImportError:  # a vLLM without one knows only transformers' model types
        return MappingProxyType({})
    registry: Mapping[str, object] = _CONFIG_REGISTRY
    return registry


def load_model_class(architecture: str) -> type | None:
    """The class vLLM's registry imports for ``architecture`` (None: it cannot)."""
    from vllm.model_executor.models.registry import ModelRegistry

    cls: type | None = ModelRegistry._try_load_model_cls(architecture)
    return cls


def speculative_architectures() -> dict[str, tuple[str, str]]:
    """vLLM's speculative-decoding architectures: module and class name of each (``"?"``
    where its registry does not say)."""
    from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS, ModelRegistry

    out = {}
    for arch in _SPECULATIVE_DECODING_MODELS:
        registered = ModelRegistry.models.get(arch)
        out[arch] = (
            str(getattr(registered, "module_name", "?")),
            str(getattr(registered, "class_name", "?")),
        )
    return out


def share_mechanism_problem() -> str | None:
    """Why this vLLM's proposers will not replace an MTP draft's embedding and head with
    the target's (None: they will): the ``skip_replaced`` part, probed now."""
    off, _ = late_part("skip_replaced")
    return off.reason if off is not None else None


def weights_complete(check: Callable[[set[str]], None], model: Any, loaded: set[str]) -> bool:
    """vLLM's "weights were not initialized" check (``check``) as a question: whether it
    passes with ``loaded``. Where merged linear layers record the shards a load filled and
    the check pops that record (0.34), the record is kept for vLLM's own check after."""
    kept = [
        (module, dict(getattr(module, LOADED_SHARD_IDS)))
        for module in model.modules()
        if isinstance(getattr(module, LOADED_SHARD_IDS, None), dict)
    ]
    try:
        check(set(loaded))
    except ValueError:
        return False
    finally:
        for module, record in kept:
            setattr(module, LOADED_SHARD_IDS, record)
    return True


def draft_weights_complete(
    model: Any, load_config: LoadConfig, loaded: set[str], quantized: bool
) -> bool:
    """Whether vLLM's loader would find every parameter of ``model`` loaded with
    ``loaded`` (``DefaultModelLoader.track_weights_loading``, asked without raising)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    _require(TRACK_WEIGHTS_LOADING)
    loader = DefaultModelLoader(load_config)

    def check(names: set[str]) -> None:
        loader.track_weights_loading(model, names, quantized=quantized)

    return weights_complete(check, model, loaded)


#: vLLM's switches that tell an MTP class's ``load_weights`` it holds only part of the
#: checkpoint: 0.33's context manager, or 0.34's process-wide "weight update" flag.
MTP_COMPLETENESS_SWITCH = (
    "vllm.model_executor.model_loader.mtp_validation:disable_mtp_completeness_check"
)
WEIGHT_UPDATE_FLAG = "vllm.model_executor.model_loader.reload.lifecycle:_weight_update_active"


@contextlib.contextmanager
def _weight_update(module: ModuleType, attr: str) -> Iterator[None]:
    saved = getattr(module, attr)
    setattr(module, attr, True)
    try:
        yield
    finally:
        setattr(module, attr, saved)


def mtp_partial_load() -> contextlib.AbstractContextManager[Any]:
    """vLLM's switch that turns off the MTP classes' "every MTP layer loaded" check for
    one ``load_weights`` call (a no-op on a vLLM without one)."""
    switch = _lookup(MTP_COMPLETENESS_SWITCH, None)
    if switch is not _ABSENT and callable(switch):
        manager: contextlib.AbstractContextManager[Any] = switch()
        return manager
    module_name, _, attr = WEIGHT_UPDATE_FLAG.partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module = __import__(module_name, fromlist=["_"])
        except Exception:  # a vLLM without it checks nothing to turn off
            return contextlib.nullcontext()
    if not isinstance(getattr(module, attr, None), bool):
        return contextlib.nullcontext()
    return _weight_update(module, attr)


# --- a weight-transfer session's draft update ------------------------------------------


def _layerwise() -> ModuleType:
    return __import__(_LAYERWISE, fromlist=["_"])


def layerwise_info(layer: Any) -> Any:
    """vLLM's layerwise-reload record of ``layer`` (None: it has none; none is made)."""
    info: Any = _layerwise().LAYERWISE_INFO.get(layer)
    return info


def in_reload(model: Any) -> bool:
    """Whether ``model`` is in a checkpoint-format reload now: a layer of it waits for its
    weights in vLLM's layerwise reload, or 0.34's direct reload has begun on it."""
    if getattr(model, "_direct_reload_begun", False):
        return True
    for layer in model.modules():
        info = layerwise_info(layer)
        if info is not None and info.can_load():
            return True
    return False


@contextlib.contextmanager
def outside_reload(modules: Iterable[Any]) -> Iterator[None]:
    """While open, each of ``modules`` that waits in vLLM's layerwise reload now (a module of
    the target's in the target's own session) is out of its sight: a reload step on a model
    holding it (the draft's finalize) passes it by, and its record is as it was after."""
    table = _layerwise().LAYERWISE_INFO
    hidden = {}
    for module in modules:
        info = table.get(module)
        if info is not None and info.can_load():
            hidden[module] = table.pop(module)
    try:
        yield
    finally:
        for module, info in hidden.items():
            table[module] = info


def in_layerwise_reload(module: Any) -> bool:
    """Whether ``module`` waits in vLLM's layerwise reload now."""
    info = layerwise_info(module)
    return info is not None and bool(info.can_load())


def waits_for_tensors(module: Any) -> bool:
    """Whether ``module``, in vLLM's layerwise reload, has been given fewer elements than
    it loads (``load_numel`` below ``load_numel_total``; a layer processed once whole has
    left the reload's record)."""
    info = layerwise_info(module)
    if info is None or not info.can_load():
        return False
    return bool(info.load_numel < (info.load_numel_total or 0))


def initialize_layerwise(module: Any) -> None:
    """vLLM's ``initialize_layerwise_reload`` of ``module`` (its layers on the meta device,
    their weight loaders buffering until each layer is whole)."""
    _layerwise().initialize_layerwise_reload(module)


@contextlib.contextmanager
def holding_back(hold_back: Callable[[Any, Any], bool]) -> Iterator[None]:
    """While open, each layer vLLM's layerwise reload has processed is offered to
    ``hold_back(layer, info)`` before its copy into the layer's original storage; a layer
    held back keeps its processed tensors until :func:`exchange_kernel_tensors` or
    :func:`place_kernel_tensors` is called for it with what ``info`` held."""
    module = _layerwise()
    name = COPY_AND_RESTORE_KERNEL_TENSORS.path.partition(":")[2]
    original = getattr(module, name)

    def copy_or_hold(layer: Any, info: Any) -> None:
        if not hold_back(layer, info):
            original(layer, info)

    setattr(module, name, copy_or_hold)
    try:
        yield
    finally:
        setattr(module, name, original)


#: The most bytes one step of :func:`exchange_kernel_tensors` copies through a buffer of its
#: own: the exchange of a layer's processed and original values holds no more beside them.
EXCHANGE_CHUNK = 64 << 20


def _kernel_pairs(layer: Any, info: Any) -> list[tuple[Any, Any]]:
    """Each (original tensor, processed one) that vLLM's ``_copy_and_restore_kernel_tensors``
    copies for ``layer``: its parameters, and the buffers it has still that are persistent
    or were loaded."""
    parameters, buffers = info.kernel_tensors
    loaded = {name for name, _ in info.loaded_weights}
    pairs = [(param, getattr(layer, name)) for name, param in parameters.items()]
    pairs += [
        (buffer, getattr(layer, name))
        for name, buffer in buffers.items()
        if name in layer._buffers
        and not (name in info.kernel_non_persistent_buffers and name not in loaded)
    ]
    return pairs


def _exchange(original: Any, processed: Any) -> Any:
    """``processed``'s values into ``original`` (vLLM's copy), and the tensor that holds
    ``original``'s previous values after it: ``processed`` itself where both are alike (the
    values exchanged, at most :data:`EXCHANGE_CHUNK` bytes at a time), else a copy."""
    import torch

    with torch.no_grad():
        if original.data_ptr() == processed.data_ptr():
            return processed
        alike = (
            original.shape == processed.shape
            and original.dtype == processed.dtype
            and original.dim() > 0
        )
        if not alike:
            previous = original.detach().clone()
            original.copy_(processed)
            return previous
        rows = original.shape[0]
        row_bytes = max(1, original[0].numel() * original.element_size())
        step = max(1, EXCHANGE_CHUNK // row_bytes)
        for start in range(0, rows, step):
            part = slice(start, start + step)
            kept = original[part].clone()
            original[part].copy_(processed[part])
            processed[part].copy_(kept)
        return processed


def exchange_kernel_tensors(layer: Any, info: Any) -> list[tuple[Any, Any]]:
    """vLLM's last step of processing a reloaded layer (``_copy_and_restore_kernel_tensors``:
    its processed values copied into its original storage, which CUDA graphs were captured
    on, and its original tensors put back), undoably: returns each original tensor with the
    tensor holding its previous values (:func:`undo_exchange` puts them back). A failure part
    way undoes this layer's own copies before it is raised."""
    done: list[tuple[Any, Any]] = []
    try:
        for original, processed in _kernel_pairs(layer, info):
            done.append((original, _exchange(original, processed)))
        _layerwise()._place_kernel_tensors(layer, info)
    except BaseException:
        undo_exchange(done)
        raise
    return done


def undo_exchange(done: list[tuple[Any, Any]]) -> None:
    """Each original tensor of :func:`exchange_kernel_tensors` back to its previous values."""
    import torch

    with torch.no_grad():
        for original, previous in reversed(done):
            if original.data_ptr() != previous.data_ptr():
                original.copy_(previous)


def place_kernel_tensors(layer: Any, info: Any) -> None:
    """Put ``layer``'s original tensors back as they are (its processed ones dropped)."""
    _layerwise()._place_kernel_tensors(layer, info)


def is_deferred_attention(layer: Any) -> bool:
    """Whether vLLM processes ``layer`` at the end of a layerwise reload (an attention-like
    layer, whose derived tensors are computed from other layers' weights)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return bool(is_deferred_attention_layer(layer))


def process_attention(layer: Any, dtype: Any) -> None:
    """vLLM's post-load processing of an attention-like ``layer`` (its tensors derived from
    other layers' weights), as this release's layerwise reload calls it: with the
    activation ``dtype`` where the hook takes one (0.33), else alone (0.34)."""
    hook = layer.process_weights_after_loading
    if inspect.signature(hook).parameters:
        hook(dtype)
    else:
        hook()


def refresh_quantized_heads(model: Any) -> None:
    """vLLM's re-derivation of ``model``'s quantized copies of its target's head, which its
    own weight updates run when the target's head changed (a no-op on a vLLM without it)."""
    refresh = _lookup(REFRESH_QUANTIZED_LM_HEADS, None)
    if refresh is not _ABSENT and callable(refresh):
        refresh(model)


def finalize_layerwise(model: Any, model_config: ModelConfig, part: str, layout: str) -> None:
    """vLLM's end of a layerwise reload of ``model`` by ``part``'s ``layout`` (the
    ``weight_update`` or ``direct_update`` part): the layers not processed yet (attention,
    padded ones) processed and every post-load step run."""
    names = layout_names(part, layout)
    if FINALIZE_LAYERWISE_RELOAD in names:
        _layerwise().finalize_layerwise_reload(model, model_config)
    else:
        _layerwise().finalize_layerwise_processing(model, model_config)
