"""Where this process is in the job: rank, world size, local rank, rendezvous address.

Cluster environments are plugins (hook ``torchbay_register_cluster_environments``); the
built-ins read torchrun's, SLURM's and Open MPI / MPICH's environment variables.
"""

from __future__ import annotations

import os
from typing import ClassVar


class ClusterEnvironment:
    """Reads one launcher's environment. Subclasses implement :meth:`detect` and the fields."""

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0

    @classmethod
    def detect(cls) -> bool:
        raise NotImplementedError

    def world_size(self) -> int:
        raise NotImplementedError

    def rank(self) -> int:
        raise NotImplementedError

    def local_rank(self) -> int:
        raise NotImplementedError

    def local_world_size(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size()))

    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "29500"))

    def export_torch_env(self) -> None:
        """Set the variables ``init_process_group(init_method="env://")`` reads."""
        os.environ.setdefault("MASTER_ADDR", self.main_address())
        os.environ.setdefault("MASTER_PORT", str(self.main_port()))
        os.environ.setdefault("WORLD_SIZE", str(self.world_size()))
        os.environ.setdefault("RANK", str(self.rank()))
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank()))

    def describe(self) -> str:
        return f"{self.name}: rank {self.rank()} of {self.world_size()} (local {self.local_rank()})"


class SingleProcessEnvironment(ClusterEnvironment):
    """No launcher: one process."""

    name = "single"
    priority = -100

    @classmethod
    def detect(cls) -> bool:
        return True

    def world_size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def local_rank(self) -> int:
        return 0

    def local_world_size(self) -> int:
        return 1

    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "29500"))


def detect_cluster_environment(registry: dict[str, type[ClusterEnvironment]]) -> ClusterEnvironment:
    for cls in sorted(registry.values(), key=lambda c: -c.priority):
        if cls.detect():
            return cls()
    return SingleProcessEnvironment()
