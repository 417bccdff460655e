"""Start N processes from a notebook or a test: ``notebook_launcher`` and ``debug_launcher``.

Both go through torch's elastic launcher (what ``torchbay launch`` uses via torchrun), with
forked workers, so the function and its arguments need not be picklable. The device is the
one the config selects (any installed device plugin); its launch environment is given to
the workers, and nothing of the device is initialised in the parent.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable

from torchbay.errors import LaunchError
from torchbay.launch.plan import port_in_use
from torchbay.process.state import PartialState
from torchbay.registry.manager import get_plugin_manager
from torchbay.registry.resolve import resolve_config
from torchbay.registry.selection import build_context


@contextlib.contextmanager
def patch_environment(**kwargs: Any):
    """Set environment variables (keys upper-cased) inside the block; restore them after."""
    saved = {}
    for key, value in kwargs.items():
        key = key.upper()
        saved[key] = os.environ.get(key)
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def clear_environment():
    """Run the block with an empty environment; restore it after."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _check_parent() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise LaunchError("notebook_launcher: this process already joined a process group (an Accelerator or "
                          "PartialState was created here); create the Accelerator inside the launched function "
                          "and restart the notebook's kernel")


def _worker_env(num_processes: int, device: str | None, mixed_precision: str) -> dict[str, str]:
    env = {"TORCHBAY_MIXED_PRECISION": repr(mixed_precision), "FORK_LAUNCHED": "1",  # repr: YAML reads no as false
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if device:
        env["TORCHBAY_DEVICE"] = device
    args: dict[str, Any] = {"mixed_precision": mixed_precision, "launch.num_processes": num_processes}
    if device:
        args["device"] = device
    # validate the set-up here, before any process starts
    with patch_environment(world_size=num_processes, rank=0, local_rank=0, local_world_size=num_processes):
        pm = get_plugin_manager()
        resolved = resolve_config(args=args, pm=pm)
        context = build_context(resolved, pm)
        env.update(context.device_backend_cls.worker_env(resolved.config, num_processes))
    return env


#: Accelerate's (and torchrun's) rendezvous port, as the launcher's static default
DEFAULT_PORT = "29500"


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _rendezvous_port(use_port: str | None, agreed: bool) -> str:
    """``use_port`` when given; else 29500, or, where no other machine must agree on it, a free
    port when 29500 is taken here (another notebook, a job still running)."""
    if use_port is not None:
        return str(use_port)

    if agreed or not port_in_use(int(DEFAULT_PORT)):
        return DEFAULT_PORT
    port = _free_port()
    print(f"torchbay: notebook_launcher: port {DEFAULT_PORT} is in use on this machine; rendezvous on port {port} "
          f"instead (pass use_port=... to choose one)", file=sys.stderr, flush=True)
    return port


def notebook_launcher(function: Callable, args: tuple = (), num_processes: int | None = None,
                      mixed_precision: str = "no", use_port: str | None = None, master_addr: str = "127.0.0.1",
                      node_rank: int = 0, num_nodes: int = 1, rdzv_backend: str = "static", rdzv_endpoint: str = "",
                      rdzv_conf: dict | None = None, rdzv_id: str = "none", max_restarts: int = 0,
                      monitor_interval: float = 0.1, log_line_prefix_template: str | None = None,
                      device: str | None = None) -> Any:
    """Run ``function(*args)`` in ``num_processes`` processes (or here, for one process).

    A failing process stops the others and raises torch's ``ChildFailedError`` with its error;
    ``max_restarts`` restarts the whole group that many times first. ``use_port`` left unset on
    one machine is 29500 as in Accelerate, or a free port when 29500 is taken; with several
    machines (or an ``rdzv_endpoint``) every one of them must name the same port, so it is 29500.
    """
    if not num_processes or num_processes == 1:
        with patch_environment(**({"TORCHBAY_DEVICE": device} if device else {}),
                               TORCHBAY_MIXED_PRECISION=repr(mixed_precision)):
            return function(*args)
    _check_parent()
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    env = _worker_env(num_processes, device, mixed_precision)
    endpoint = rdzv_endpoint or f"{master_addr}:{_rendezvous_port(use_port, agreed=num_nodes > 1)}"
    conf = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        conf.setdefault("rank", node_rank)
    config = LaunchConfig(min_nodes=num_nodes, max_nodes=num_nodes, nproc_per_node=num_processes, run_id=rdzv_id,
                          role="default", rdzv_endpoint=endpoint, rdzv_backend=rdzv_backend, rdzv_configs=conf,
                          max_restarts=max_restarts, monitor_interval=monitor_interval, start_method="fork",
                          **({"log_line_prefix_template": log_line_prefix_template}
                             if log_line_prefix_template else {}))
    with patch_environment(**env):
        return elastic_launch(config=config, entrypoint=_named(function))(*args)


def _named(function: Callable) -> Callable:
    """``function``, or a named function calling it: torch's elastic launcher reads the entry point's
    ``__name__``, which a ``functools.partial`` or a callable object lacks."""
    if hasattr(function, "__name__"):
        return function
    inner = getattr(function, "func", type(function))  # a partial's function, else the object's class

    def entrypoint(*args: Any) -> Any:
        return function(*args)

    entrypoint.__name__ = entrypoint.__qualname__ = getattr(inner, "__name__", "entrypoint")
    return entrypoint


def debug_launcher(function: Callable, args: tuple = (), num_processes: int = 2) -> Any:
    """Run ``function(*args)`` in ``num_processes`` CPU processes (for tests and debugging)."""
    PartialState._reset_state()
    return notebook_launcher(function, args, num_processes=num_processes, use_port=_free_port(), device="cpu")
