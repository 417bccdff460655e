"""Point ``import accelerate...`` at torchbay, at run time, for Accelerate's own test scripts.

``install()`` puts a finder first on ``sys.meta_path``:

- ``accelerate.test_utils`` and everything under it (Accelerate's fixtures: RegressionModel,
  RegressionDataset, ``are_the_same_tensors``, the test scripts themselves) are loaded from the
  installed Accelerate files, so the fixtures stay Accelerate's code;
- every other ``accelerate`` module is a stand-in whose names come from one torchbay module
  (``ALIASES``), so ``from accelerate.utils import gather`` gives ``torchbay.utils.gather``
  and ``from accelerate import Accelerator`` gives ``torchbay.Accelerator``.

A stand-in is a module object of its own: the import system's ``setattr(parent, child,
module)`` lands on the stand-in, never on a torchbay module. Nothing of Accelerate's runtime
(state, launch, operations) is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

#: Accelerate module -> the torchbay module that answers for it (the migration table)
ALIASES = {
    "accelerate": "torchbay",
    "accelerate.accelerator": "torchbay.accelerator",
    "accelerate.state": "torchbay.state",
    "accelerate.data_loader": "torchbay.data",
    "accelerate.logging": "torchbay.utils",
    "accelerate.launchers": "torchbay.launchers",
    "accelerate.optimizer": "torchbay.wrappers",
    "accelerate.scheduler": "torchbay.wrappers",
    "accelerate.utils": "torchbay.utils",
    "accelerate.tracking": "torchbay.tracking",
    "accelerate.big_modeling": "torchbay.big_modeling",
    "accelerate.parallelism_config": "torchbay.parallelism_config",
}
#: everything under these comes from the installed Accelerate files
REAL_PREFIXES = ("accelerate.test_utils",)


def target_for(fullname: str) -> str | None:
    """The torchbay module standing in for ``fullname`` (``accelerate.utils.*`` -> ``torchbay.utils``)."""
    if fullname in ALIASES:
        return ALIASES[fullname]
    if fullname.startswith("accelerate.utils."):
        return "torchbay.utils"
    return None


class _StandIn(types.ModuleType):
    """A module whose missing attributes are read from a torchbay module."""

    def __init__(self, name: str, target: str):
        super().__init__(name)
        self.__dict__["_torchbay_target"] = target
        self.__path__ = []  # a package: its submodules are found by the finder below

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(importlib.import_module(self._torchbay_target), name)

    def __dir__(self):
        return sorted(set(dir(importlib.import_module(self._torchbay_target))))

    def __repr__(self) -> str:
        return f"<module {self.__name__!r} (torchbay stand-in for {self._torchbay_target})>"


class _StandInLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return _StandIn(spec.name, self.target)

    def exec_module(self, module) -> None:
        import logging

        importlib.import_module(self.target)  # fail at import time if the target is broken
        # Accelerate's modules log under their own names; a script that looks up such a logger
        # (logging.root.manager.loggerDict["accelerate.accelerator"]) gets torchbay's
        logging.root.manager.loggerDict.setdefault(module.__name__, logging.getLogger(self.target))


class AccelerateToTorchbay(importlib.abc.MetaPathFinder):
    def __init__(self, accelerate_dir: str):
        self.accelerate_dir = accelerate_dir

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "accelerate" and not fullname.startswith("accelerate."):
            return None
        if fullname.startswith(REAL_PREFIXES):
            return self._real_spec(fullname)
        torchbay_name = target_for(fullname)
        if torchbay_name is None and fullname.count(".") > 1:
            return None  # ``from accelerate.state import X``: X is looked up on the stand-in, not imported
        if torchbay_name is None:
            raise ImportError(f"{fullname} has no torchbay counterpart (see docs/accelerate-compat.md)",
                              name=fullname)
        return importlib.machinery.ModuleSpec(fullname, _StandInLoader(torchbay_name), is_package=True)

    def _real_spec(self, fullname: str):
        relative = fullname.split(".")[1:]
        base = os.path.join(self.accelerate_dir, *relative)
        if os.path.isdir(base):
            return importlib.util.spec_from_file_location(fullname, os.path.join(base, "__init__.py"),
                                                          submodule_search_locations=[base])
        if os.path.isfile(base + ".py"):
            return importlib.util.spec_from_file_location(fullname, base + ".py")
        return None


def accelerate_dir() -> str:
    """Where the installed Accelerate package lies (found without importing it)."""
    spec = importlib.machinery.PathFinder.find_spec("accelerate")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("Accelerate is not installed: pip install -c constraints.txt 'accelerate==1.15.*'")
    return list(spec.submodule_search_locations)[0]


def install() -> AccelerateToTorchbay:
    for name in [n for n in sys.modules if n == "accelerate" or n.startswith("accelerate.")]:
        del sys.modules[name]
    finder = AccelerateToTorchbay(accelerate_dir())
    sys.meta_path.insert(0, finder)
    return finder
