"""Accelerate's launcher helpers (``accelerate.utils`` / ``accelerate.utils.launch``), answered by torchbay.

They take what ``accelerate launch`` parsed (an ``argparse.Namespace`` with Accelerate's attribute names) and give
what Accelerate gives: a worker environment and a command line. The environment is torchbay's own, from the same
plan ``torchbay launch`` makes (``torchbay.launch.plan.prepare``): the resolved config every worker reads, and each
device plugin's variables. ``write_basic_config`` writes Accelerate's basic config file, which ``accelerate launch``
and ``torchbay launch --config-file`` both read. A config with ``mpirun_config`` (``mpirun_hostfile``) gives the
``mpirun`` command line of the MPI installed here; ``--cpu`` gives the Intel OpenMP variables Accelerate gives.

This module is ``accelerate.utils.launch`` under the switch (a test patching ``accelerate.utils.launch.which``
patches the ``which`` used here); its other names are ``accelerate.utils``'s (module ``__getattr__``).
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import socket
import subprocess
import sys
from shutil import which
from typing import Any

from torchbay.errors import ConfigError, LaunchError

logger = logging.getLogger(__name__)

#: characters that may not appear in a variable written to an environment file (as Accelerate refuses them)
FORBIDDEN_IN_ENV = (";", "\n", "<", ">", " ")
#: the port torch's static rendezvous uses when none is given
DEFAULT_PORT = 29500
#: the Intel OpenMP variables a ``--cpu`` launch gives its processes (a value already set is kept)
CPU_OPENMP_ENV = {"KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_BLOCKTIME": "1"}
#: how each MPI spells (hostfile, processes per machine, total processes) and what it adds; the key is what its
#: ``--version`` says (None: any other, Intel MPI and MVAPICH spelling them alike)
MPIRUN_SPELLINGS = {b"Open MPI": ("--hostfile", "--npernode", "-n", ["--bind-to", "socket"]),
                    None: ("-f", "-ppn", "-n", [])}


def convert_dict_to_env_variables(current_env: dict[str, str]) -> list[str]:
    """``["KEY=value\\n", ...]`` for the variables safe to write to an environment file; each other one is skipped
    with a warning naming it."""
    lines = []
    for key, value in current_env.items():
        if key and value and not any(char in key + value for char in FORBIDDEN_IN_ENV):
            lines.append(f"{key}={value}\n")
        else:
            logger.warning("skipping the environment variable %s=%s: it is empty or holds one of %s",
                           key, value, " ".join(repr(c) for c in FORBIDDEN_IN_ENV))
    return lines


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _settings(args: argparse.Namespace, num_processes: int | None) -> dict[str, Any]:
    """The torchbay settings (``{dotted: value}``) that ``args``' launch fields name."""
    given = {"launch.num_processes": num_processes, "launch.num_machines": getattr(args, "num_machines", None),
             "launch.machine_rank": getattr(args, "machine_rank", None),
             "launch.main_process_ip": getattr(args, "main_process_ip", None),
             "launch.cpu_threads_per_process": getattr(args, "num_cpu_threads_per_process", None),
             "mixed_precision": getattr(args, "mixed_precision", None)}
    port = getattr(args, "main_process_port", None)
    if port:
        given["launch.main_process_port"] = int(port)
    if getattr(args, "cpu", False) or getattr(args, "use_cpu", False):
        given["device"] = "cpu"
    gpu_ids = getattr(args, "gpu_ids", None)
    if gpu_ids and gpu_ids != "all":
        given["visible_devices"] = gpu_ids
    return {key: value for key, value in given.items() if value is not None}


def _worker_env(args: argparse.Namespace, num_processes: int | None) -> dict[str, str]:
    """The environment ``torchbay launch`` would give each worker for ``args`` (the current environment, then
    torchbay's variables); an Accelerate config file is read as ``torchbay launch`` reads it."""
    from torchbay.compat.accelerate_config_file import remove_imported_config, with_torchbay_config
    from torchbay.launch.plan import prepare
    from torchbay.registry.manager import get_plugin_manager
    from torchbay.registry.resolve import resolve_config

    pm = get_plugin_manager()
    environ = {k: v for k, v in os.environ.items() if k != "TORCHBAY_RESOLVED_CONFIG"}
    config_file = getattr(args, "config_file", None)
    imported = with_torchbay_config(["--config_file", config_file])[1] if config_file else None
    try:
        resolved = resolve_config(file=imported or config_file, environ=environ, cli=_settings(args, num_processes),
                                  pm=pm)
    finally:
        remove_imported_config(imported)
    _, _, env = prepare(resolved, pm, environ=environ)
    return {**os.environ, **env}


def prepare_multi_gpu_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' environment for a multi-process launch of ``args``; as Accelerate does, a
    ``main_process_port`` of 0 becomes a free port, None the default port, and ``args`` gains torchrun's
    spellings of the layout (``nproc_per_node``, ``nnodes``, ``node_rank``, ``master_addr``, ``master_port``)."""
    if args.main_process_port == 0:
        args.main_process_port = _free_port()
    elif args.main_process_port is None:
        args.main_process_port = DEFAULT_PORT
    machines = int(getattr(args, "num_machines", 1) or 1)
    total = int(args.num_processes or 1)
    args.nproc_per_node = str(total // machines)
    args.nnodes = str(machines)
    args.node_rank = int(getattr(args, "machine_rank", 0) or 0)
    args.master_addr = str(getattr(args, "main_process_ip", None) or "127.0.0.1")
    args.master_port = str(args.main_process_port)
    return _worker_env(args, total)


def prepare_simple_launcher_cmd_env(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """``(command, environment)`` for a single-process launch of ``args.training_script``, or for the ``mpirun``
    of ``args.mpirun_hostfile`` (every process of the job)."""
    script = getattr(args, "training_script", None)
    if not script:
        raise ConfigError("nothing to launch: args.training_script is empty (accelerate launch SCRIPT)")
    mpirun = _mpirun_command(args)
    cmd = [*mpirun, *([] if getattr(args, "no_python", False) else
                      [sys.executable, *(["-m"] if getattr(args, "module", False) else [])])]
    cmd += [script, *getattr(args, "training_script_args", [])]
    env = _worker_env(args, int(getattr(args, "num_processes", None) or 1) if mpirun else 1)
    if getattr(args, "cpu", False) or getattr(args, "use_cpu", False):
        env = {**CPU_OPENMP_ENV, **env}
    return cmd, env


def _mpirun_command(args: argparse.Namespace) -> list[str]:
    """``mpirun HOSTFILE-FLAG FILE PER-MACHINE-FLAG N [TOTAL-FLAG M]...`` for ``args.mpirun_hostfile``, in the
    spelling of the MPI installed here; [] without a hostfile."""
    hostfile = getattr(args, "mpirun_hostfile", None)
    if not hostfile:
        return []
    program = next((name for name in ("mpirun", "mpiexec") if which(name)), None)
    if program is None:
        raise LaunchError(f"mpirun_hostfile {hostfile} asks for an mpirun launch, and neither mpirun nor mpiexec is "
                          "on PATH: install Open MPI, Intel MPI or MVAPICH, or remove mpirun_config from the config "
                          "to launch with torchrun")
    said = subprocess.check_output([program, "--version"])
    hostfile_flag, per_machine_flag, total_flag, extra = next(
        spelling for family, spelling in MPIRUN_SPELLINGS.items() if family is None or family in said)
    total = int(getattr(args, "num_processes", None) or 0)
    machines = int(getattr(args, "num_machines", None) or 0)
    cmd = [program, hostfile_flag, str(hostfile), per_machine_flag, str(total // machines if total and machines else 1)]
    return cmd + ([total_flag, str(total)] if total else []) + extra


def write_basic_config(mixed_precision: str = "no", save_location: str | None = None) -> str | bool:
    """Write Accelerate's basic config file (this machine's devices, one process each) to ``save_location``
    (default: Accelerate's default config file); an existing file is left as it is and False returned."""
    from torchbay.compat.accelerate_config_file import default_config_file

    path = save_location or default_config_file
    if os.path.exists(path):
        print(f"User config at {path} already exists. Will not override existing file.")
        return False
    mixed_precision = str(mixed_precision).lower()
    if mixed_precision not in ("no", "fp16", "bf16", "fp8"):
        raise ConfigError(f"mixed_precision {mixed_precision!r} is not one of no, fp16, bf16, fp8",
                          header="write_basic_config")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    config = {"compute_environment": "LOCAL_MACHINE", "debug": False, **_machine_layout(),
              "mixed_precision": mixed_precision, "rdzv_backend": "static", "same_network": False,
              "enable_cpu_affinity": False}
    with open(path, "x", encoding="utf-8") as handle:  # "x": never over a file that appeared meanwhile
        json.dump(config, handle, indent=2)
    return path


def _machine_layout() -> dict[str, Any]:
    """``distributed_type``, ``num_processes`` and ``use_cpu`` for this machine's best device, read back through
    the Accelerate tables (the device plugin that maps ``MULTI_<X>`` to its device names it)."""
    from torchbay.compat.config_import import mapping_table
    from torchbay.registry.manager import get_plugin_manager
    from torchbay.registry.selection import select_device

    pm = get_plugin_manager()
    device_cls = select_device("auto", pm.registries()["devices"], pm, [])
    count = int(device_cls.device_count()) if device_cls is not None and device_cls.name != "cpu" else 0
    if not count:
        return {"distributed_type": "NO", "num_processes": 1, "use_cpu": True}
    multi = next((name for name, keys in mapping_table(pm)["distributed_type"].items()
                  if keys == {"device": device_cls.name, "strategy": "ddp"}), None)
    if count > 1 and multi:
        return {"distributed_type": multi, "num_processes": count, "use_cpu": False}
    return {"distributed_type": "NO", "num_processes": 1, "use_cpu": False}


def _convert_nargs_to_dict(nargs: list[str]) -> dict[str, Any]:
    """A script's ``--key value`` arguments as ``{key: value}`` (numbers read as int or float, ``True``/``False``
    as bools); a flag without a value is an error, since a job's hyperparameters need explicit values."""
    out: dict[str, Any] = {}
    index = 0
    while index < len(nargs):
        token = nargs[index]
        if not token.startswith("-"):
            raise ValueError(f"unexpected argument {token!r}: give every script argument as --name value")
        name, eq, value = token.lstrip("-").partition("=")
        if not eq:
            if index + 1 >= len(nargs) or nargs[index + 1].startswith("-"):
                raise ValueError(f"--{name} has no value: switches (store_true/store_false) cannot be passed as "
                                 f"hyperparameters; give an explicit value (--{name} True)")
            value, index = nargs[index + 1], index + 1
        out[name.replace("-", "_")] = _infer(value)
        index += 1
    return out


def _infer(value: str) -> Any:
    if value in ("True", "False"):
        return ast.literal_eval(value)
    try:
        number = float(value)
    except ValueError:
        return value
    return int(number) if number.is_integer() else number
