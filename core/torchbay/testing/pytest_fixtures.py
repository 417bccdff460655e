"""Fixtures shared by torchbay's own test suites (the core's and the plugins'): import them into a
``conftest.py`` (``from torchbay.testing.pytest_fixtures import clean_torchbay_env``)."""

import os
import warnings

import pytest

from torchbay.registry.manager import reset_plugin_manager


@pytest.fixture(autouse=True)
def clean_torchbay_env(monkeypatch, request):
    """Each test starts with no TORCHBAY_* settings, a fresh plugin manager and no process group, and
    leaves the environment as it found it: variables the code under test set itself (a strategy
    library's own set-up may export RANK, WORLD_SIZE, MASTER_PORT...) would make a later test in the
    same process (the same pytest-xdist worker) see a torchrun job."""
    import torch.distributed as dist

    for name in list(os.environ):
        if name.startswith("TORCHBAY_"):
            monkeypatch.delenv(name)
    before = dict(os.environ)
    reset_plugin_manager(None)
    yield
    reset_plugin_manager(None)
    for name in set(os.environ) - set(before):
        del os.environ[name]
    for name, value in before.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    if dist.is_available() and dist.is_initialized():  # a test that forgot end_training: keep it from the next
        dist.destroy_process_group()
        warnings.warn(f"{request.node.nodeid} left a process group initialized (call accelerator.end_training())")
