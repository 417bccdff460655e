"""Built-in cluster environments: torchrun, SLURM, Open MPI and MPICH/Intel MPI."""

from __future__ import annotations

import os
import re

from torchbay.cluster import ClusterEnvironment
from torchbay.plugins import hookimpl


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
    """Started by ``srun``: one task per process."""

    name = "slurm"
    priority = 50

    @classmethod
    def detect(cls) -> bool:
        return "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ and \
            os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")

    def world_size(self) -> int:
        return int(os.environ["SLURM_NTASKS"])

    def rank(self) -> int:
        return int(os.environ["SLURM_PROCID"])

    def local_rank(self) -> int:
        return int(os.environ.get("SLURM_LOCALID", "0"))

    def local_world_size(self) -> int:
        tasks = os.environ.get("SLURM_NTASKS_PER_NODE", "")
        match = re.match(r"\d+", tasks)
        return int(match.group()) if match else self.world_size()

    def main_address(self) -> str:
        if "MASTER_ADDR" in os.environ:
            return os.environ["MASTER_ADDR"]
        nodes = os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURM_NODELIST", "127.0.0.1"))
        return expand_first_host(nodes)

    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return int(os.environ["MASTER_PORT"])
        return 10000 + int(os.environ.get("SLURM_JOB_ID", "0")[-4:] or 0)


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
