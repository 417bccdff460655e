"""Point ``import accelerate...`` at torchbay for Accelerate's own test scripts: the switch users turn on.

``install()`` is ``torchbay.compat.as_accelerate()`` for a process that may already have imported the real
Accelerate (the compat runner checks its installation first): those modules are dropped, and the finder serves
every ``accelerate`` module from torchbay, except ``accelerate.test_utils`` (Accelerate's fixtures and the test
scripts themselves), which is loaded from the installed Accelerate files. Nothing of Accelerate's runtime (state,
launch, operations) is imported.
"""

from __future__ import annotations

import importlib.machinery
import os

from torchbay.switch import finder


def accelerate_dir() -> str:
    """Where the installed Accelerate package lies (found without importing it)."""
    spec = importlib.machinery.PathFinder.find_spec("accelerate")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("Accelerate is not installed: pip install -c constraints.txt 'accelerate==1.15.*'")
    return list(spec.submodule_search_locations)[0]


def install() -> finder.AccelerateFinder:
    accelerate_dir()  # its test scripts are what runs
    os.environ[finder.SWITCH_ENV] = "1"
    return finder.install(replace_imported=True)
