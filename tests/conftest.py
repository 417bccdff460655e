import os

import pytest

from torchbay.plugins import reset_plugin_manager

HERE = os.path.dirname(__file__)
SCRIPTS = os.path.join(HERE, "scripts")


@pytest.fixture(autouse=True)
def _clean_torchbay_env(monkeypatch):
    """Each test starts with no TORCHBAY_* settings and a fresh plugin manager."""
    for name in list(os.environ):
        if name.startswith("TORCHBAY_"):
            monkeypatch.delenv(name)
    reset_plugin_manager(None)
    yield
    reset_plugin_manager(None)


@pytest.fixture
def script():
    return lambda name: os.path.join(SCRIPTS, name)
