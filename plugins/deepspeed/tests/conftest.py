import pytest

from torchbay.axes.cluster import ClusterEnvironment
from torchbay.registry.manager import PluginManager
from torchbay.registry.resolve import resolve_config
from torchbay.registry.selection import build_context
from torchbay.testing.pytest_fixtures import clean_torchbay_env  # noqa: F401 (autouse: a clean torchbay environment per test)


def _context(config: dict, world_size: int = 2):
    class Ranks(ClusterEnvironment):
        name = "two"

        def world_size(self):
            return world_size

        def rank(self):
            return 0

        def local_rank(self):
            return 0

    pm = PluginManager()
    resolved = resolve_config(args={"strategy": "deepspeed", "device": "cpu", **config}, pm=pm, environ={})
    return build_context(resolved, pm, cluster=Ranks())


@pytest.fixture
def deepspeed_context():
    """``deepspeed_context(config, world_size=2)``: the run context of strategy deepspeed on the cpu, as rank 0 of
    ``world_size`` processes, selected and validated without starting a process group."""
    return _context
