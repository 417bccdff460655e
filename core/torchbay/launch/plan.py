"""What ``torchbay launch`` starts, and how: a plan, validated before any process exists.

torchbay decides what to run; torch.distributed.run (torchrun) runs it. The plan turns the
resolved ``launch`` section (and, inside SLURM / MPI / torchrun, the allocation) into one
unambiguous process layout: ``num_processes`` is the total across machines,
``nproc_per_node`` the count on each machine, and every number says where it came from.

Two modes:

- ``torchrun``: this process becomes torchrun's elastic agent for this machine
  (``torch.distributed.run.run``) and starts ``nproc_per_node`` workers, each running the
  user's script through :mod:`torchbay.launch.worker`;
- ``direct``: an allocation already started one process per rank (``srun -n 16``,
  ``mpirun -np 16``, or a torchrun worker); this process becomes that rank's worker.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping

from torchbay.axes.cluster import ClusterEnvironment, SingleProcessEnvironment, detect_cluster_environment
from torchbay.config.model import RESOLVED_ENV, ResolvedConfig
from torchbay.errors import ConfigError
from torchbay.registry.selection import build_context, select_device
from torchbay.switch.finder import SWITCH_ENV

WORKER = str(Path(__file__).resolve().parent / "worker.py")
DEFAULT_STATIC_PORT = 29500
DEFAULT_RDZV_PORT = 29400

_FLAGS = {"num_processes": "--num-processes", "nproc_per_node": "--nproc-per-node", "num_machines": "--num-machines",
          "machine_rank": "--machine-rank", "main_process_ip": "--main-process-ip",
          "main_process_port": "--main-process-port", "rdzv_backend": "--rdzv-backend",
          "rdzv_endpoint": "--rdzv-endpoint", "max_restarts": "--max-restarts",
          "monitor_interval": "--monitor-interval"}


def describe_source(resolved: ResolvedConfig, dotted: str, flag: str | None = None) -> str:
    """Human words for where ``dotted`` came from: ``--num-processes``, ``the config file``..."""
    source = resolved.source_of(dotted)
    if source == "cli":
        return f"command line {flag}" if flag else "command line"
    if source == "file":
        return "config file"
    if source == "env":
        return "environment TORCHBAY_" + dotted.upper().replace(".", "__")
    if source == "launcher":
        return "worked out by torchbay launch"
    return {"default": "default", "args": "Accelerator(...) arguments"}.get(source, source)


class PlannedCluster(ClusterEnvironment):
    """The job a launcher is about to start, as build_context's validation sees it."""

    name = "torchbay-launch"
    priority = -1000

    def __init__(self, world_size: int, local_world_size: int, machine_rank: int, address: str, port: int):
        self._world, self._local, self._machine = world_size, local_world_size, machine_rank
        self._address, self._port = address, port

    @classmethod
    def detect(cls) -> bool:
        return False

    def world_size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._machine * self._local

    def local_rank(self) -> int:
        return 0

    def local_world_size(self) -> int:
        return self._local

    def main_address(self) -> str:
        return self._address

    def main_port(self) -> int:
        return self._port


@dataclasses.dataclass
class LaunchPlan:
    mode: str  # "torchrun" or "direct"
    num_processes: int
    nproc_per_node: int
    num_machines: int
    machine_rank: int
    main_process_ip: str | None
    main_process_port: int | None
    rdzv_backend: str
    rdzv_endpoint: str | None
    max_restarts: int
    monitor_interval: float
    sources: dict[str, str]
    allocation: str | None = None  # name of the cluster environment that started us
    rank: int | None = None  # direct mode: this process's rank
    local_rank: int | None = None
    rdzv_id: str = "none"
    torchrun_options: dict[str, str] = dataclasses.field(default_factory=dict)  # --tee, --log-dir, --rdzv-conf

    def cluster(self) -> ClusterEnvironment:
        return PlannedCluster(self.num_processes, self.nproc_per_node, self.machine_rank,
                              self.main_process_ip or "127.0.0.1", self.main_process_port or DEFAULT_STATIC_PORT)

    def describe(self) -> list[str]:
        keys = ("num_processes", "nproc_per_node", "num_machines", "machine_rank", "main_process_ip",
                "main_process_port", "rdzv_backend", "rdzv_endpoint", "max_restarts")
        lines = [f"mode = {self.mode}" + (f" (processes started by {self.allocation})" if self.mode == "direct"
                                           else " (torch.distributed.run)")]
        for key in keys:
            value = getattr(self, key)
            if value is None and key not in self.sources:
                continue
            lines.append(f"{key} = {value}  ({self.sources.get(key, 'default')})")
        return lines

    def summary(self) -> str:
        where = f"{self.num_machines} machines" if self.num_machines > 1 else "1 machine"
        return (f"{self.num_processes} processes on {where} ({self.nproc_per_node} per machine; "
                f"num_processes from {self.sources['num_processes']}, nproc_per_node from "
                f"{self.sources['nproc_per_node']})")


def _default_nproc(resolved: ResolvedConfig, pm) -> tuple[int, str]:
    """Processes per machine when nothing says: one per device found, one on cpu."""
    problems: list[str] = []
    device_cls = select_device(resolved.config.device, pm.registries()["devices"], pm, problems)
    if device_cls is None or problems or device_cls.torch_type() == "cpu":
        return 1, "default: 1 process on cpu; set --num-processes N for more"
    count = max(int(device_cls.device_count()), 1)
    return count, f"one per {device_cls.name} device found ({count})"


def plan_launch(resolved: ResolvedConfig, pm, *, environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Work out the process layout; raise :class:`ConfigError` listing every problem."""
    environ = os.environ if environ is None else environ
    launch = resolved.config.launch
    src = {key: describe_source(resolved, f"launch.{key}", _FLAGS.get(key)) for key in _FLAGS}
    given = {key: resolved.source_of(f"launch.{key}") != "default" for key in _FLAGS}
    problems: list[str] = []
    values: dict[str, Any] = {key: getattr(launch, key) for key in _FLAGS}
    allocation = detect_cluster_environment(pm.registries()["cluster_environments"])
    mode = "torchrun"
    alloc_name = None
    rank = local_rank = None

    if not isinstance(allocation, SingleProcessEnvironment) and allocation.world_size() >= 1:
        alloc_name = allocation.name
        tasks, tasks_per_node = allocation.world_size(), allocation.local_world_size()
        # one task in the allocation (sbatch, srun -n 1): it is this machine's launcher
        wants_more = tasks == 1 or (values["nproc_per_node"] or 1) > 1 or (values["num_processes"] or tasks) > tasks
        what = f"the {alloc_name} allocation"
        if wants_more:
            # one launcher per machine (srun --ntasks-per-node=1 torchbay launch --nproc-per-node 8 ...)
            if tasks_per_node != 1:
                problems.append(f"{what} runs {tasks_per_node} tasks per machine, so each task is one process; "
                                f"drop --nproc-per-node/--num-processes, or start one task per machine")
            for key, alloc_value in (("num_machines", tasks), ("machine_rank", allocation.rank())):
                if given[key] and values[key] != alloc_value:
                    problems.append(f"{_FLAGS[key]} {values[key]} (from {src[key]}) disagrees with {what} "
                                    f"({key} {alloc_value}); remove it")
                values[key], src[key] = alloc_value, what
            if not given["main_process_ip"]:
                values["main_process_ip"], src["main_process_ip"] = allocation.main_address(), what
            if not given["main_process_port"]:
                values["main_process_port"], src["main_process_port"] = allocation.main_port(), what
        else:
            mode = "direct"
            if given["num_processes"] and values["num_processes"] != tasks:
                problems.append(f"--num-processes {values['num_processes']} (from {src['num_processes']}) disagrees "
                                f"with {what}, which started {tasks} processes; remove it or change the allocation")
            values.update(num_processes=tasks, nproc_per_node=tasks_per_node,
                          num_machines=max(tasks // max(tasks_per_node, 1), 1),
                          machine_rank=allocation.rank() // max(tasks_per_node, 1),
                          main_process_ip=allocation.main_address(), main_process_port=allocation.main_port())
            for key in ("num_processes", "nproc_per_node", "num_machines", "machine_rank", "main_process_ip",
                        "main_process_port"):
                src[key] = what
            rank, local_rank = allocation.rank(), allocation.local_rank()

    machines = values["num_machines"]
    total, per_node = values["num_processes"], values["nproc_per_node"]
    if mode == "torchrun":
        if total is not None and per_node is not None:
            if total != per_node * machines:
                problems.append(f"--num-processes {total} (the total across machines, from {src['num_processes']}) "
                                f"is not --nproc-per-node {per_node} (processes on each machine, from "
                                f"{src['nproc_per_node']}) x --num-machines {machines} (from {src['num_machines']}); "
                                f"give only one of --num-processes and --nproc-per-node")
        elif total is not None:
            if total % machines:
                problems.append(f"--num-processes {total} (the total, from {src['num_processes']}) cannot be split "
                                f"evenly over --num-machines {machines} (from {src['num_machines']}); use a multiple "
                                f"of {machines}, or give --nproc-per-node")
            else:
                per_node, src["nproc_per_node"] = (total // machines,
                                                   f"--num-processes {total} / --num-machines {machines}")
        elif per_node is not None:
            total, src["num_processes"] = (per_node * machines,
                                           f"--nproc-per-node {per_node} x --num-machines {machines}")
        else:
            per_node, src["nproc_per_node"] = _default_nproc(resolved, pm)
            total, src["num_processes"] = per_node * machines, f"{per_node} per machine x {machines} machine(s)"
        if values["machine_rank"] >= machines:
            problems.append(f"--machine-rank {values['machine_rank']} (from {src['machine_rank']}) must be below "
                            f"--num-machines {machines}; machines are numbered 0..{machines - 1}")
        backend = values["rdzv_backend"]
        if machines > 1 and backend == "static" and not values["main_process_ip"] and not values["rdzv_endpoint"]:
            problems.append(f"--num-machines {machines} needs the address of machine 0: give --main-process-ip "
                            f"(and --main-process-port), or --rdzv-backend c10d --rdzv-endpoint HOST:PORT")
        if backend != "static" and not values["rdzv_endpoint"]:
            if values["main_process_ip"]:
                port = values["main_process_port"] or DEFAULT_RDZV_PORT
                values["rdzv_endpoint"] = f"{values['main_process_ip']}:{port}"
                src["rdzv_endpoint"] = "--main-process-ip:--main-process-port"
            elif machines > 1:
                problems.append(f"--rdzv-backend {backend} needs --rdzv-endpoint HOST:PORT (or --main-process-ip)")
    if problems:
        raise ConfigError(problems, header="cannot work out how many processes to start")
    return LaunchPlan(mode=mode, num_processes=total, nproc_per_node=per_node, num_machines=machines,
                      machine_rank=values["machine_rank"], main_process_ip=values["main_process_ip"],
                      main_process_port=values["main_process_port"], rdzv_backend=values["rdzv_backend"],
                      rdzv_endpoint=values["rdzv_endpoint"], max_restarts=values["max_restarts"],
                      monitor_interval=values["monitor_interval"], sources=src, allocation=alloc_name,
                      rank=rank, local_rank=local_rank, rdzv_id=resolved.config.launch.rdzv_id,
                      torchrun_options=_torchrun_options(resolved.config.launch))


def _torchrun_options(launch) -> dict[str, str]:
    """torchrun's own options that torchbay passes through as set (``--tee 3 --log-dir logs``)."""
    given = {"--tee": launch.tee, "--log-dir": launch.log_dir, "--rdzv-conf": launch.rdzv_conf}
    return {flag: str(value) for flag, value in given.items() if value is not None}


def apply_plan(resolved: ResolvedConfig, plan: LaunchPlan) -> None:
    """Write the worked-out layout into the config the workers get (source ``launcher``)."""
    launch = resolved.config.launch
    for key in ("num_processes", "nproc_per_node", "num_machines", "machine_rank", "main_process_ip",
                "main_process_port", "rdzv_endpoint"):
        value = getattr(plan, key)
        if getattr(launch, key) != value:
            setattr(launch, key, value)
            resolved.sources[f"launch.{key}"] = "launcher"


def prepare(resolved: ResolvedConfig, pm, *, environ: Mapping[str, str] | None = None):
    """Plan, validate the whole set-up for the planned job, and compute the workers' environment.

    :return: ``(plan, context, worker_env)``.
    """
    plan = plan_launch(resolved, pm, environ=environ)
    apply_plan(resolved, plan)
    context = build_context(resolved, pm, cluster=plan.cluster())
    device_cls = context.device_backend_cls
    env = dict(device_cls.worker_env(resolved.config, plan.nproc_per_node))
    env.update(context.strategy_cls.launch_env(plan.nproc_per_node, resolved.config, device_cls))
    env = {key: str(value) for key, value in env.items()}
    env.update(cpu_threads_env(context, plan, os.environ if environ is None else environ,
                               resolved.config.launch.cpu_threads_per_process))
    if resolved.config.launch.as_accelerate:

        env[SWITCH_ENV] = "1"
    env[RESOLVED_ENV] = resolved.to_json()
    return plan, context, env


def cpu_threads_env(context, plan: LaunchPlan, environ: Mapping[str, str],
                    chosen: int | None = None) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for the workers when several share a machine and the user set none: what
    torchrun would set (1), but quietly; on the cpu device the machine's cores shared out instead
    (as Accelerate does for CPU jobs), since there they do the work. ``chosen``
    (launch.cpu_threads_per_process) wins."""
    if chosen is not None:  # asked for (accelerate launch --num_cpu_threads_per_process): it wins, as there
        return {"OMP_NUM_THREADS": str(chosen)}
    if "OMP_NUM_THREADS" in environ or plan.nproc_per_node <= 1:
        return {}
    threads = 1
    if context.device_backend_cls is not None and context.device_backend_cls.name == "cpu":
        threads = max(1, (os.cpu_count() or 1) // plan.nproc_per_node)
    return {"OMP_NUM_THREADS": str(threads)}


def port_in_use(port: int) -> bool:
    """Whether another process listens on ``port`` here (IPv4 or IPv6), probed as torch's store binds."""
    import errno
    import socket

    for family, address in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True  # other errors: e.g. no IPv6 here
    return False


def check_port_free(plan: LaunchPlan) -> None:
    """On the machine that hosts the job's store (machine 0, static rendezvous), refuse a port
    another process already listens on, before anything starts."""
    if plan.mode != "torchrun" or plan.rdzv_backend != "static" or plan.machine_rank != 0:
        return
    if plan.main_process_port is None and plan.num_machines == 1 and not plan.rdzv_endpoint:
        return  # torchrun picks a free port itself
    port = plan.main_process_port or DEFAULT_STATIC_PORT
    if port_in_use(port):
        source = plan.sources.get("main_process_port", "default")
        raise ConfigError(f"main_process_port {port} (from {source}) is already in use on this machine (another "
                          f"job, or one still shutting down); pick a free port with --main-process-port N (the "
                          f"same on every machine), or on one machine leave it unset and torchrun picks one",
                          header="cannot start the job")
