"""Accelerate's helpers around process environment variables (``accelerate.utils.environment``)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

#: the prefix of the variables Accelerate (and libraries configuring it, e.g. transformers' TrainingArguments) set
ACCELERATE_PREFIX = "ACCELERATE_"
_WRAPPED = "_accelerate_is_purged_environment_wrapped"  # Accelerate's marker, which its own tests read


@contextlib.contextmanager
def _restored_accelerate_variables() -> Iterator[None]:
    before = {key: value for key, value in os.environ.items() if key.startswith(ACCELERATE_PREFIX)}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(ACCELERATE_PREFIX)]:
            if key not in before:
                del os.environ[key]
        os.environ.update(before)


def _purging(function: Callable) -> Callable:
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _restored_accelerate_variables():
            return function(*args, **kwargs)

    setattr(run, _WRAPPED, True)
    return run


def _purge_test_methods(cls: type) -> type:
    for name in dir(cls):
        method = getattr(cls, name)
        if name.startswith("test") and callable(method) and not hasattr(method, _WRAPPED):
            setattr(cls, name, _purging(method))
    return cls


def purge_accelerate_environment(function_or_class: Any) -> Any:
    """Undo, after each call (or each ``test*`` method of a class and of its subclasses), the ``ACCELERATE_*``
    variables that the call set or changed."""
    if not isinstance(function_or_class, type):
        return _purging(function_or_class)
    _purge_test_methods(function_or_class)
    inherited = function_or_class.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if inherited is not None:
            inherited.__func__(cls, **kwargs)
        _purge_test_methods(cls)

    function_or_class.__init_subclass__ = classmethod(__init_subclass__)
    return function_or_class


def are_libraries_initialized(*library_names: str) -> list[str]:
    """Those of ``library_names`` already imported in this process (a launcher checks none is before it forks)."""
    return [name for name in library_names if name in sys.modules]


@dataclass
class CPUInformation:
    """This process's place in a job: global rank and size, rank and size on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1


def get_cpu_distributed_information() -> CPUInformation:
    """This process's place in the job, read from the cluster environment torchbay detects (torchrun's variables,
    SLURM, Open MPI, MPICH / Intel MPI, or a plugin's); one process when none is detected."""
    from torchbay.axes.cluster import detect_cluster_environment
    from torchbay.registry.manager import get_plugin_manager

    cluster = detect_cluster_environment(get_plugin_manager().registries()["cluster_environments"])
    return CPUInformation(rank=cluster.rank(), world_size=cluster.world_size(), local_rank=cluster.local_rank(),
                          local_world_size=cluster.local_world_size())

