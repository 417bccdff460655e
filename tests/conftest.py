import os

import pytest

from torchbay.testing.pytest_fixtures import clean_torchbay_env  # noqa: F401 (autouse)

HERE = os.path.dirname(__file__)
SCRIPTS = os.path.join(HERE, "scripts")


@pytest.fixture
def script():
    return lambda name: os.path.join(SCRIPTS, name)
