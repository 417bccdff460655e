"""Built-in cluster environments: torchrun, SLURM, Open MPI and MPICH/Intel MPI."""

from __future__ import annotations

import os
import re

from torchbay.axes.cluster import ClusterEnvironment
from torchbay.registry.manager import hookimpl


class TorchrunEnvironment(ClusterEnvironment):
    """Started by torchrun / torch.distributed.run (also by ``torchbay launch``)."""

    name = "torchrun"
    priority = 100

    @classmethod
    def detect(cls) -> bool:
        return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))

    def world_size(self) -> int:
        return int(os.environ["WORLD_SIZE"])

    def rank(self) -> int:
        return int(os.environ["RANK"])

    def local_rank(self) -> int:
        return int(os.environ["LOCAL_RANK"])


class SlurmEnvironment(ClusterEnvironment):
    """Started by ``srun``: one task per process.

    Only a task that ``srun`` started is a rank. SLURM also sets ``SLURM_PROCID=0`` and
    ``SLURM_NTASKS`` (the allocation's task count) for the batch script of ``sbatch -n 2``, which
    is one process, not rank 0 of 2; a shell under ``salloc`` has ``SLURM_NTASKS`` and no
    ``SLURM_PROCID``. ``srun`` (and only ``srun``) sets ``SLURM_STEP_ID`` to the step's number,
    which tells them apart; the batch, extern and interactive steps have reserved numbers near
    2**32 instead. The job's name says nothing: ``srun -n 2 python train.py`` under
    ``salloc`` runs in a job named ``interactive``, ``srun -n 2 bash -c ...`` in one named ``bash``.
    The step's own counts (``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_TASKS_PER_NODE``,
    ``SLURM_STEP_NODELIST``) come first: a step may use part of its allocation.
    """

    name = "slurm"
    priority = 50
    #: step ids at and above this are SLURM's reserved steps (batch script 0xfffffffb, extern
    #: 0xfffffffc, salloc's interactive step 0xfffffffa...), not tasks started by srun
    RESERVED_STEP_IDS = 0xFFFFFFF0

    @classmethod
    def detect(cls) -> bool:
        step = os.environ.get("SLURM_STEP_ID", os.environ.get("SLURM_STEPID"))
        if "SLURM_PROCID" not in os.environ or step is None or not step.isdigit():
            return False
        return int(step) < cls.RESERVED_STEP_IDS and \
            ("SLURM_STEP_NUM_TASKS" in os.environ or "SLURM_NTASKS" in os.environ)

    def world_size(self) -> int:
        return int(os.environ.get("SLURM_STEP_NUM_TASKS", os.environ.get("SLURM_NTASKS", "1")))

    def rank(self) -> int:
        return int(os.environ["SLURM_PROCID"])

    def local_rank(self) -> int:
        return int(os.environ.get("SLURM_LOCALID", "0"))

    def local_world_size(self) -> int:
        node = int(os.environ.get("SLURM_NODEID", "0") or 0)
        for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            counts = tasks_per_node(os.environ.get(key, ""))
            if counts:
                return counts[min(node, len(counts) - 1)]
        tasks = os.environ.get("SLURM_NTASKS_PER_NODE", "")
        match = re.match(r"\d+", tasks)
        return int(match.group()) if match else self.world_size()

    def main_address(self) -> str:
        if "MASTER_ADDR" in os.environ:
            return os.environ["MASTER_ADDR"]
        for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if os.environ.get(key):
                return expand_first_host(os.environ[key])
        return "127.0.0.1"

    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return int(os.environ["MASTER_PORT"])
        return 10000 + int(os.environ.get("SLURM_JOB_ID", "0")[-4:] or 0)


def tasks_per_node(value: str) -> list[int]:
    """SLURM's compressed per-node counts, one per node: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in filter(None, value.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return []
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def expand_first_host(nodelist: str) -> str:
    """``node[003-005,9],other`` -> ``node003``."""
    first = re.split(r",(?![^\[]*\])", nodelist)[0]
    match = re.match(r"([^\[]*)\[([^\],-]+)", first)
    return match.group(1) + match.group(2) if match else first


class OpenMPIEnvironment(ClusterEnvironment):
    name = "openmpi"
    priority = 40
    prefix = "OMPI_COMM_WORLD_"

    @classmethod
    def detect(cls) -> bool:
        return f"{cls.prefix}RANK" in os.environ and f"{cls.prefix}SIZE" in os.environ

    def world_size(self) -> int:
        return int(os.environ[f"{self.prefix}SIZE"])

    def rank(self) -> int:
        return int(os.environ[f"{self.prefix}RANK"])

    def local_rank(self) -> int:
        return int(os.environ.get(f"{self.prefix}LOCAL_RANK", "0"))

    def local_world_size(self) -> int:
        return int(os.environ.get(f"{self.prefix}LOCAL_SIZE", self.world_size()))


class MPICHEnvironment(ClusterEnvironment):
    """MPICH and Intel MPI (``PMI_RANK``/``PMI_SIZE``)."""

    name = "mpich"
    priority = 30

    @classmethod
    def detect(cls) -> bool:
        return "PMI_RANK" in os.environ and "PMI_SIZE" in os.environ

    def world_size(self) -> int:
        return int(os.environ["PMI_SIZE"])

    def rank(self) -> int:
        return int(os.environ["PMI_RANK"])

    def local_rank(self) -> int:
        return int(os.environ.get("MPI_LOCALRANKID", os.environ.get("PALS_LOCAL_RANKID", "0")))

    def local_world_size(self) -> int:
        return int(os.environ.get("MPI_LOCALNRANKS", self.world_size()))


@hookimpl
def torchbay_register_cluster_environments():
    return [TorchrunEnvironment, SlurmEnvironment, OpenMPIEnvironment, MPICHEnvironment]
