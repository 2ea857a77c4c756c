"""The Ray driver of tests/e2e/test_ray.py, run by the CPU environment's Python (the layer
installed, ``ray`` on ``PYTHONPATH``) against a running two-node Ray cluster.

It computes the workers' environment with vLLM's own env-copy functions, as vLLM's Ray code
does, and hands it to one actor per node (resources ``node_a`` and ``node_b``): the two
ranks of one tensor-parallel world (gloo), each loading the target and its MTP draft with
vLLM's ``get_model`` and ``EagleProposer``, as a worker does, then saying how much of the
vocabulary its loaded draft predicts as its target does (``draft_agreement``: 1.0 on
make-checkpoint's checkpoint, loaded right). Three routes, in this order:

- ``vllm_alone``: vLLM's ``get_env_vars_to_copy`` as vLLM ships it (the layer's wrapper's
  ``__wrapped__``), as the actors' Ray ``runtime_env``, the way vLLM 0.33's Ray
  data-parallel engine actors get it (``CoreEngineActorManager``);
- ``setdefault``: the same actors then apply ``get_driver_env_vars`` (through the layer's
  wrapper) with ``os.environ.setdefault``, as vLLM 0.33's ``RayWorkerProc.initialize_worker``
  does on top of the node's own environment (that class itself cannot run here: vLLM's CPU
  platform does not support Ray), and load again;
- ``runtime_env``: new actors, with the layer's ``get_env_vars_to_copy`` as their
  ``runtime_env``.

Prints one JSON object: the driver's settings, and per route the variables copied, what
each rank reported (host, pid, rank, settings) and the byte range of the events file
(``HYBRID_DRAFT_EVENTS_FILE``) its loads wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any

import ray

#: Variables worth showing from a copied environment (the rest is PATH, HOME...).
SHOWN = ("HYBRID_DRAFT_", "INSTANTTENSOR_", "VLLM_RAY_", "MY_EXTRA")


def dist_ident(init_method: str) -> str:
    """``VLLM_DIST_IDENT`` for a rank joining ``init_method``, computed by vLLM's own code.

    vLLM's CPU worker sets it in ``CPUWorker.init_device`` from its init method before it
    joins the world; the shared-memory communicator (``_CPUSHMDistributed``, used for TP
    and PP groups wherever the CPU extension has ``init_shm_manager``) names its segment
    after it, and every rank must compute the same name. The expression is taken from that
    method's source and evaluated here, so the actors follow vLLM's scheme as it is.
    """
    import ast
    import inspect
    import textwrap

    from vllm.v1.worker.cpu_worker import CPUWorker

    source = textwrap.dedent(inspect.getsource(CPUWorker.init_device))
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Assign)
            and isinstance(target := node.targets[0], ast.Subscript)
            and ast.unparse(target) == "os.environ['VLLM_DIST_IDENT']"
        ):
            expr = compile(ast.Expression(node.value), "CPUWorker.init_device", "eval")
            return str(eval(expr, {"os": os, "init_method": init_method}))
    sys.exit("raydriver: CPUWorker.init_device no longer sets VLLM_DIST_IDENT")


@ray.remote(num_cpus=0)
class Rank:
    """One rank of the world, on the node its resource names."""

    def load(
        self,
        rank: int,
        init_method: str,
        checkpoint: str,
        dtype: str,
        driver_env: dict[str, str] | None,
    ) -> dict[str, Any]:
        if driver_env is not None:  # RayWorkerProc.initialize_worker: node-local values win
            for key, value in driver_env.items():
                os.environ.setdefault(key, value)
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed import (
            ensure_model_parallel_initialized,
            init_distributed_environment,
        )
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader import get_model
        from vllm.v1.spec_decode.eagle import EagleProposer
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

        from hybrid_draft import settings
        from hybrid_draft.adapter import load

        # A second load in this process joins the world it is already in.
        config = EngineArgs(
            model=checkpoint,
            load_format="instanttensor",
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
            tensor_parallel_size=2,
            dtype=dtype,
            max_model_len=128,
            enforce_eager=True,
            skip_tokenizer_init=True,
        ).create_engine_config()
        _set_torch_accelerator_to_noop()  # what vLLM's CPU model runner does first
        os.environ["VLLM_DIST_IDENT"] = dist_ident(init_method)  # as CPUWorker.init_device
        with set_current_vllm_config(config):
            init_distributed_environment(2, rank, init_method, 0, "gloo")
            ensure_model_parallel_initialized(2, 1)
            target = get_model(vllm_config=config)
            proposer = EagleProposer(config, torch.device("cpu"), runner=None)
            proposer.load_model(target)
            agreement = draft_agreement(target, proposer.model)
        return {
            "node": socket.gethostname(),
            "pid": os.getpid(),
            "rank": load.rank(),
            "settings": settings.load().as_dict(),
            "agreement": agreement,
        }


def draft_agreement(target: Any, draft: Any) -> float:
    """The share of tokens whose next token the loaded draft predicts as its target does,
    by vLLM's own modules of both (make-checkpoint's checkpoint: every block passes its input
    through, so the target's next token is its embedding's, normed, through its head, and the
    draft's the next token's embedding through its norms, projection, shared head). 1.0 where
    the draft was loaded right (the draft agrees by construction). Every rank calls it in the
    same order: the sharded embedding and head gather across the tensor-parallel world. The
    actors serve nothing: this is what stands for acceptance here."""
    import torch

    vocab = target.config.vocab_size
    ids = torch.arange(vocab)
    with torch.no_grad():
        hidden = target.model.norm(target.model.embed_tokens(ids))
        expected = target.compute_logits(hidden)[:, :vocab].argmax(-1)
        (layer,) = draft.model.layers.values()
        other = hidden.roll(1, 0)  # another token's hidden state: the draft must not need it
        joined = torch.cat([layer.enorm(draft.embed_input_ids(ids)), layer.hnorm(other)], -1)
        predicted = draft.compute_logits(layer.eh_proj(joined))[:, :vocab].argmax(-1)
    return float((predicted == expected).float().mean())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_nodes(count: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while sum(n["Alive"] for n in ray.nodes()) < count:
        if time.monotonic() > deadline:
            sys.exit(f"raydriver: fewer than {count} Ray nodes alive after {seconds:g} s")
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    import vllm.ray.ray_env as ray_env
    from ray.runtime_env import RuntimeEnv
    from vllm.v1.executor import ray_env_utils
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

    from hybrid_draft import settings

    def copied(get_env_vars_to_copy: Any) -> dict[str, str]:
        # vLLM's CoreEngineActorManager, line for line.
        names = get_env_vars_to_copy(
            destination="EngineCoreActor", exclude_vars=WORKER_SPECIFIC_ENV_VARS
        )
        return {name: os.environ[name] for name in names if name in os.environ}

    stock = getattr(ray_env.get_env_vars_to_copy, "__wrapped__", None)
    if stock is None:
        sys.exit("raydriver: the layer did not wrap vllm.ray.ray_env.get_env_vars_to_copy")
    routes = {
        "vllm_alone": ("runtime_env", copied(stock)),
        "setdefault": (
            "setdefault",
            ray_env_utils.get_driver_env_vars(worker_specific_vars=WORKER_SPECIFIC_ENV_VARS),
        ),
        "runtime_env": ("runtime_env", copied(ray_env.get_env_vars_to_copy)),
    }
    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    _wait_for_nodes(2, 300)
    out: dict[str, Any] = {
        "driver": {"node": socket.gethostname(), "settings": settings.load().as_dict()},
        "routes": {},
    }
    events_file = os.environ["HYBRID_DRAFT_EVENTS_FILE"]

    def size() -> int:
        return os.path.getsize(events_file) if os.path.exists(events_file) else 0

    actors: list[Any] = []
    init = ""
    for name, (how, env) in routes.items():
        if how == "runtime_env":  # new actors, their environment given by Ray
            for actor in actors:
                ray.kill(actor)
            init = f"tcp://127.0.0.1:{_free_port()}"
            actors = [
                Rank.options(
                    resources={f"node_{node}": 1}, runtime_env=RuntimeEnv(env_vars=env)
                ).remote()
                for node in ("a", "b")
            ]
        driver_env = env if how == "setdefault" else None
        start = size()
        ranks = ray.get(
            [
                a.load.remote(r, init, args.checkpoint, args.dtype, driver_env)
                for r, a in enumerate(actors)
            ],
            timeout=args.timeout,
        )
        out["routes"][name] = {
            "how": how,
            "copied": {k: v for k, v in sorted(env.items()) if k.startswith(SHOWN)},
            "ranks": ranks,
            "events": [start, size()],
        }
    for actor in actors:
        ray.kill(actor)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
