"""Shared fixtures of the tracker plugins' tests: a clean torchbay environment per test (the
core suite's fixture), and ``launches``: two real 2-process runs (gloo) of
:mod:`torchbay.testing.tracking_run`, the second resuming from the first's saved state."""

import json

import pytest

from torchbay.testing.pytest_fixtures import clean_torchbay_env  # noqa: F401 (autouse)


def pytest_collection_modifyitems(items):
    """A test that uses ``launches`` starts two 2-process runs (about 20-60 s on 2 cores): ``slow``, so that
    ``make test`` leaves it to ``make test-slow`` (which ``.ci/run`` runs too)."""
    for item in items:
        if "launches" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multiprocess)
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def launches(tmp_path):
    """``launches(log_with, env=None, init_kwargs=None)``: run 3 logged steps in 2 processes, save,
    then 3 more in a new 2-process launch after load_state; return each rank's result of the second."""
    from torchbay.testing import tracking_run
    from torchbay.testing.processes import run_torchrun

    def run(log_with: str, env: dict | None = None, init_kwargs: dict | None = None) -> list[dict]:
        args = ["--project-dir", str(tmp_path), "--log-with", log_with, "--init-kwargs", json.dumps(init_kwargs or {})]
        for extra in ([], ["--resume"]):
            # from the test's own folder: a tracker library must never find (and change) this repository
            run_torchrun(tracking_run.__file__, 2, [*args, *extra], env=env, timeout=300, cwd=str(tmp_path)).check()
        return [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in range(2)]

    return run
