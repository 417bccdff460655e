"""Running a launch plan: torchrun's elastic agent on this machine, or this rank's worker.

``run_torchrun`` makes this process torch.distributed.run's agent (workers run the user's
script through :mod:`torchbay.launch.worker`) and turns worker failures into one report;
``exec_direct`` becomes the worker itself when an allocation already started one process per
rank. The plan itself comes from :mod:`torchbay.launch.plan`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Mapping

from torchbay.errors import LaunchError
from torchbay.launch.failures import describe_failures, describe_stacks
from torchbay.launch.flight_recorder import DUMP_FILE_ENV, DUMP_ON_TIMEOUT_ENV, DUMP_PREFIX
from torchbay.launch.plan import DEFAULT_STATIC_PORT, WORKER, LaunchPlan
from torchbay.launch.worker import LAUNCHER_PID_ENV, RUN_DIR_ENV, collect_peer_stacks


def torchrun_argv(plan: LaunchPlan, target: str, target_args: list[str], module: bool = False) -> list[str]:
    """The torch.distributed.run command line for ``plan`` (without the program name)."""
    argv = ["--nnodes", str(plan.num_machines), "--nproc-per-node", str(plan.nproc_per_node),
            "--max-restarts", str(plan.max_restarts), "--monitor-interval", str(plan.monitor_interval)]
    if plan.rdzv_backend == "static":
        if plan.num_machines > 1 or plan.main_process_port is not None or plan.rdzv_endpoint:
            argv += ["--node-rank", str(plan.machine_rank),
                     "--master-addr", plan.main_process_ip or "127.0.0.1",
                     "--master-port", str(plan.main_process_port or DEFAULT_STATIC_PORT)]
            if plan.rdzv_endpoint:
                argv += ["--rdzv-endpoint", plan.rdzv_endpoint]
        # else: one machine, no port given: torchrun picks a free port itself (c10d on localhost:0)
    else:
        # every machine of the job must use the same id (torchrun's default is "none")
        argv += ["--rdzv-backend", plan.rdzv_backend, "--rdzv-endpoint", plan.rdzv_endpoint or "localhost:0",
                 "--rdzv-id", plan.rdzv_id]
    for flag, value in plan.torchrun_options.items():
        argv += [flag, value]
    argv.append(WORKER)
    argv += (["-m", target] if module else [target]) + list(target_args)
    return argv


def run_torchrun(plan: LaunchPlan, env: Mapping[str, str], target: str, target_args: list[str],
                 module: bool = False) -> int:
    """Become torchrun's agent for this machine; return the job's exit code."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = torchrun.get_args_parser()
    parser.allow_abbrev = False
    args = parser.parse_args(torchrun_argv(plan, target, []))
    # everything after the script is the script's, unchanged: never parsed by torchrun
    args.training_script_args = (["-m", target] if module else [target]) + list(target_args)
    import shutil
    import tempfile

    run_dir = tempfile.mkdtemp(prefix="torchbay-run-")
    os.environ.update(env)
    os.environ.update({RUN_DIR_ENV: run_dir, LAUNCHER_PID_ENV: str(os.getpid())})
    if os.environ.get(DUMP_ON_TIMEOUT_ENV) == "1":  # a device plugin turned the flight recorder's dumps on
        os.environ.setdefault(DUMP_FILE_ENV, os.path.join(run_dir, DUMP_PREFIX))  # read by the failure report
    quiet_elastic_reports()
    previous = _stop_signals_collect_stacks(run_dir, args)
    try:
        return _run_agent(torchrun, args, plan, run_dir, ChildFailedError)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(run_dir, ignore_errors=True)


#: torch elastic's log lines about a failure that torchbay's own report tells better (the rank,
#: its error, its traceback, how the others were stopped): "failed (exitcode: 1) local_rank: 1
#: (pid...)", "Sending process N closing signal SIGTERM", "Unable to shutdown process N via SIGTERM,
#: forcefully exiting via SIGKILL"
ELASTIC_LINES_REPORTED = ("failed (exitcode", "Sending process", "Closing process", "Unable to shutdown process")


class _ReportedByTorchbay(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(ELASTIC_LINES_REPORTED)


def quiet_elastic_reports() -> None:
    """Drop elastic's lines that repeat what torchbay reports; its other lines (restarts,
    rendezvous) stay."""
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _ReportedByTorchbay) for f in logger.filters):
        logger.addFilter(_ReportedByTorchbay())


def _stop_signals_collect_stacks(run_dir: str, args) -> dict:
    """SIGINT (Ctrl-C on a job that hangs) and SIGTERM: first ask every worker for its Python
    stack (at most 2 s), then stop the job as torchrun does (its ``SignalException``)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stop(signum, frame):
        collect_peer_stacks(run_dir=run_dir)
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    if threading.current_thread() is not threading.main_thread():
        return {}
    handled = [s.strip() for s in (getattr(args, "signals_to_handle", "") or "").split(",") if s.strip()]
    mine = [s for s in ("SIGINT", "SIGTERM") if s in handled]
    # torchrun installs its own handlers each time it starts workers: leave it the others
    args.signals_to_handle = ",".join(s for s in handled if s not in mine)
    return {getattr(signal, s): signal.signal(getattr(signal, s), stop) for s in mine}


def _run_agent(torchrun, args, plan: LaunchPlan, run_dir: str, ChildFailedError) -> int:
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        report, code = describe_failures(exc.failures, plan, run_dir)
        sys.stdout.flush()
        print(report, file=sys.stderr, flush=True)
        return code
    except Exception as exc:
        sigval = getattr(exc, "sigval", None)
        if type(exc).__name__ == "SignalException" and sigval is not None:

            print(f"torchbay launch: stopped by signal {getattr(sigval, 'name', sigval)}; every process of the job "
                  f"was stopped", file=sys.stderr, flush=True)
            lines = describe_stacks(run_dir)
            if lines:
                print("\n".join(["where each rank was:"] + lines), file=sys.stderr, flush=True)
            return 128 + int(sigval)
        if type(exc).__module__.startswith(("torch.distributed.elastic", "torch.distributed")) or \
                type(exc).__name__ in ("DistNetworkError", "DistStoreError"):
            raise LaunchError(f"the job could not run: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
                              f"{_rendezvous_hint(plan)}") from None
        raise
    return 0


def _rendezvous_hint(plan: LaunchPlan) -> str:
    if plan.num_machines <= 1:
        return ""
    where = plan.rdzv_endpoint or f"{plan.main_process_ip}:{plan.main_process_port or DEFAULT_STATIC_PORT}"
    return (f"; every one of the {plan.num_machines} machines must run torchbay launch with the same "
            f"--num-machines, --nproc-per-node and rendezvous ({where}), each with its own --machine-rank, and "
            f"reach {where} over the network")


def exec_direct(plan: LaunchPlan, env: Mapping[str, str], target: str, target_args: list[str],
                module: bool = False) -> None:
    """Replace this process by the worker of this rank (the allocation started every rank)."""
    full = dict(os.environ)
    full.update(env)
    full.update(RANK=str(plan.rank), WORLD_SIZE=str(plan.num_processes), LOCAL_RANK=str(plan.local_rank),
                LOCAL_WORLD_SIZE=str(plan.nproc_per_node), MASTER_ADDR=str(plan.main_process_ip),
                MASTER_PORT=str(plan.main_process_port))
    argv = [sys.executable, "-u", WORKER] + (["-m", target] if module else [target]) + list(target_args)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, full)


# --- failures: see torchbay.launch.failures ----------------------------------------------------------
