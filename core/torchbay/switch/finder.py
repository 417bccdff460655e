"""The switch that makes torchbay answer ``import accelerate`` (and its distribution metadata).

With the switch on, :class:`AccelerateFinder` sits first on ``sys.meta_path``:

- every ``accelerate`` module in :data:`MODULES` is a stand-in whose names are read from the torchbay module that
  answers for it, so ``from accelerate.utils import gather`` gives ``torchbay.utils.gather`` and
  ``from accelerate import Accelerator`` gives ``torchbay.Accelerator``;
- ``accelerate.test_utils`` (Accelerate's own test fixtures) is loaded from the installed Accelerate files when
  Accelerate is installed, so its fixtures stay Accelerate's code while everything they import is torchbay's;
- ``importlib.metadata`` finds a distribution named ``accelerate`` whose version is the Accelerate API level
  torchbay implements, with torchbay's own version as a local label (``1.15.0+torchbay0.2.0``): libraries that
  check ``accelerate>=X`` see what they get.

A name torchbay does not offer is a missing attribute whose message says why (``hasattr`` is False, and
``from accelerate.utils import X`` is an ImportError carrying that message). Without the switch nothing here runs.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import pathlib
import sys
import types
from typing import Any, Iterator

from torchbay._version import __version__ as torchbay_version
from torchbay.errors import ConfigError, UnsupportedAPIError

#: the environment variable that switches the serving on, in every process that sees it
SWITCH_ENV = "TORCHBAY_AS_ACCELERATE"
#: the Accelerate release whose API torchbay implements (docs/accelerate-compat.md lists the differences)
ACCELERATE_API_LEVEL = "1.15.0"

#: Accelerate module -> the torchbay module that answers for it
MODULES = {
    "accelerate": "torchbay",
    "accelerate.accelerator": "torchbay.accelerator.accelerator",
    "accelerate.big_modeling": "torchbay.big_modeling.modeling",
    "accelerate.checkpointing": "torchbay.utils",
    "accelerate.commands": "torchbay.cli.accelerate.commands",
    "accelerate.commands.accelerate_cli": "torchbay.cli.accelerate.main",
    "accelerate.commands.config": "torchbay.cli.accelerate.commands",
    "accelerate.commands.config.default": "torchbay.cli.accelerate.config_commands",
    "accelerate.commands.env": "torchbay.cli.accelerate.config_commands",
    "accelerate.commands.estimate": "torchbay.cli.accelerate.config_commands",
    "accelerate.commands.launch": "torchbay.cli.accelerate.commands",
    "accelerate.commands.test": "torchbay.cli.accelerate.config_commands",
    "accelerate.data_loader": "torchbay.data",
    "accelerate.hooks": "torchbay.compat.hooks",
    "accelerate.launchers": "torchbay.launch.notebook",
    "accelerate.local_sgd": "torchbay.accelerator.local_sgd",
    "accelerate.logging": "torchbay.utils",
    "accelerate.optimizer": "torchbay.wrappers",
    "accelerate.parallelism_config": "torchbay.distributed.parallelism_config",
    "accelerate.scheduler": "torchbay.wrappers",
    "accelerate.state": "torchbay.state",
    "accelerate.tracking": "torchbay.tracking",
    "accelerate.utils": "torchbay.utils",
    "accelerate.utils.launch": "torchbay.cli.accelerate.launch_helpers",
}
#: stand-ins whose torchbay module answers part of the Accelerate module: the other names come from this one
#: (``accelerate.utils.launch`` also holds ``accelerate.utils``' names, which torchbay.utils serves)
ALSO_FROM = {"accelerate.utils.launch": "torchbay.utils"}

#: Accelerate's command modules whose command a plugin serves, by that command: the module named by the plugin's
#: accelerate.yaml (``api: commands``) answers for it (:mod:`torchbay.cli.accelerate.plugin_commands` finds it); without
#: that plugin, the module's names import as placeholders saying which distribution to install
PLUGIN_COMMAND_MODULES = {"accelerate.commands.to_fsdp2": "to-fsdp2", "accelerate.commands.tpu": "tpu-config"}
#: the torchbay module that tells which plugin module answers for one of :data:`PLUGIN_COMMAND_MODULES`
PLUGIN_COMMANDS = "torchbay.cli.accelerate.plugin_commands"

#: Accelerate's logger -> the torchbay module that logs what Accelerate logs there (when the two
#: differ from the module mapping above): a script listening on Accelerate's logger hears torchbay's
LOGGERS = {
    "accelerate.utils.environment": "torchbay.cli.accelerate.launch_helpers",
    "accelerate.utils.launch": "torchbay.cli.accelerate.launch_helpers",
    "accelerate.utils.other": "torchbay.compat.helpers",
}

#: the table of Accelerate names the Hugging Face libraries import (compat/library_names.py reads the rest)
LIBRARY_NAMES = "compat/resources/library_names.yaml"


@functools.lru_cache(maxsize=1)
def served_modules() -> dict[str, str]:
    """:data:`MODULES` and accelerate.utils' own modules, each answered by torchbay.utils (which serves every
    accelerate.utils name) unless :data:`MODULES` names another; their names are listed in
    compat/resources/library_names.yaml."""
    from torchbay.config.files import read_packaged_yaml
    from torchbay.switch import surface

    submodules = read_packaged_yaml("torchbay", LIBRARY_NAMES)["utils_submodules"]
    served = {**{f"accelerate.utils.{name}": "torchbay.utils" for name in submodules}, **MODULES,  # MODULES' win
              **dict.fromkeys(PLUGIN_COMMAND_MODULES, PLUGIN_COMMANDS)}
    for module in surface.modules():  # the rest of Accelerate's modules: their nearest served parent answers
        parent = module
        while parent not in served and "." in parent:
            parent = parent.rpartition(".")[0]
        served.setdefault(module, served.get(parent, "torchbay"))
    return served


#: everything under these comes from the installed Accelerate files (Accelerate's own test fixtures)
REAL_PREFIXES = ("accelerate.test_utils",)

_TRUE = ("1", "true", "yes", "on")


def switch_requested(environ: Any = None) -> bool:
    """Whether ``TORCHBAY_AS_ACCELERATE`` asks for the serving."""
    return (environ if environ is not None else os.environ).get(SWITCH_ENV, "").strip().lower() in _TRUE


def served_version() -> str:
    """``accelerate.__version__`` and the distribution's version while torchbay serves it."""
    return f"{ACCELERATE_API_LEVEL}+torchbay{torchbay_version}"


class _StandIn(types.ModuleType):
    """An ``accelerate`` module whose names are read from a torchbay module."""

    def __init__(self, name: str, target: str, advice: str | None = None):
        super().__init__(name)
        self.__dict__["_torchbay_target"] = target
        self.__dict__["_torchbay_advice"] = advice  # why its unserved names are placeholders, when known
        self.__dict__["_torchbay_replaced"] = {}  # name -> the torchbay object an assignment here replaced
        self.__dict__["_taken_from_target"] = set()  # names deleted from the target through here
        self.__path__ = []  # a package: its submodules are found by the finder
        if name == "accelerate":
            self.__version__ = served_version()

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        try:
            return getattr(importlib.import_module(self._torchbay_target), name)
        except (AttributeError, UnsupportedAPIError) as missing:
            if isinstance(missing, AttributeError) and self.__name__ in ALSO_FROM:
                try:
                    return getattr(importlib.import_module(ALSO_FROM[self.__name__]), name)
                except (AttributeError, UnsupportedAPIError) as also_missing:
                    missing = also_missing
            from torchbay.switch import surface

            # a name of Accelerate's surface that torchbay does not serve imports as a placeholder saying why
            value = surface.answer(self.__name__, name, self.__dict__["_torchbay_advice"] or _advice(missing))
            if value is surface.MISSING:
                raise AttributeError(_reason(self.__name__, name, missing), name=name, obj=self) from None
            return value

    def __setattr__(self, name: str, value) -> None:
        """A library that patches an Accelerate function (``accelerate.big_modeling.check_device_map = ...``)
        patches the torchbay function that answers for it, as it would patch Accelerate's own module (and puts it
        back there: ``unittest.mock.patch`` deletes, then sets the original)."""
        target = importlib.import_module(self._torchbay_target) if not name.startswith("__") else None
        if target is not None and (name in vars(target) or name in self._taken_from_target) \
                and not isinstance(value, types.ModuleType):
            self._taken_from_target.discard(name)
            replaced = self.__dict__["_torchbay_replaced"]
            if name in vars(target):
                replaced.setdefault(name, vars(target)[name])
            if replaced.get(name) is value:  # put back
                del replaced[name]
            setattr(target, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        """Deleting a name assigned through the stand-in brings back the torchbay object it replaced:
        ``unittest.mock.patch("accelerate.x.name")`` ends so (it deletes what it set on a module that did not hold
        the name itself), and Accelerate's own module would then hold its function again."""
        replaced = self.__dict__["_torchbay_replaced"]
        if name in self.__dict__:
            super().__delattr__(name)
        elif name in replaced:
            setattr(importlib.import_module(self._torchbay_target), name, replaced.pop(name))
        else:
            delattr(importlib.import_module(self._torchbay_target), name)
            self._taken_from_target.add(name)

    def __dir__(self):
        return sorted(set(dir(importlib.import_module(self._torchbay_target))) | set(self.__dict__))

    def __repr__(self) -> str:
        return f"<module {self.__name__!r} (torchbay stand-in for {self._torchbay_target})>"


def _advice(missing: Exception) -> str:
    said = str(missing)
    if isinstance(missing, UnsupportedAPIError):
        return said.split(" is not offered by torchbay: ", 1)[-1]
    return ("torchbay does not serve it (docs/accelerate-compat.md lists what it serves and the alternatives); "
            "open an issue if your code needs it")


def _reason(module: str, name: str, missing: AttributeError) -> str:
    said = str(missing)
    if said.startswith("module ") or not said:
        return (f"{module}.{name} is not offered by torchbay, which answers `import accelerate` "
                f"({SWITCH_ENV}=1); see docs/accelerate-compat.md")
    return f"{module}.{name}: {said}"


class _StandInLoader(importlib.abc.Loader):
    def __init__(self, target: str, advice: str | None = None):
        self.target = target
        self.advice = advice

    def create_module(self, spec):
        return _StandIn(spec.name, self.target, self.advice)

    def exec_module(self, module) -> None:
        importlib.import_module(self.target)  # fail at import time if the target is broken
        # Accelerate's modules log under their own names; a script that looks up such a logger
        # (logging.root.manager.loggerDict["accelerate.accelerator"]) gets torchbay's
        logging.root.manager.loggerDict.setdefault(module.__name__, logging.getLogger(self.target))


class _ServedDistribution(importlib.metadata.Distribution):
    """The ``accelerate`` distribution as ``importlib.metadata`` reports it while torchbay serves it."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: accelerate\nVersion: {served_version()}\n"
                    f"Summary: Accelerate's API served by torchbay ({SWITCH_ENV}=1)\n")
        return None

    def locate_file(self, path) -> pathlib.Path:
        return pathlib.Path(__file__).parent / path


class AccelerateFinder(importlib.abc.MetaPathFinder):
    """Finds torchbay's stand-ins for ``accelerate`` modules, and the ``accelerate`` distribution."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "accelerate" and not fullname.startswith("accelerate."):
            return None
        if fullname.startswith(REAL_PREFIXES):
            return _real_spec(fullname)
        modules = served_modules()
        if fullname in modules:
            target, advice = modules[fullname], None
            if target == PLUGIN_COMMANDS:  # the plugin's module, when a plugin serves that command
                target, advice = importlib.import_module(PLUGIN_COMMANDS).accelerate_module_target(
                    PLUGIN_COMMAND_MODULES[fullname])
            spec = importlib.machinery.ModuleSpec(fullname, _StandInLoader(target, advice), is_package=True,
                                                  origin=_origin(fullname, target))
            spec.has_location = True  # ``accelerate.__file__`` is a file, as a package's is
            return spec
        parent, _, name = fullname.rpartition(".")
        if parent in modules:  # ``from accelerate.utils import X`` asks for a submodule X when X is not a name
            try:
                getattr(importlib.import_module(parent), name)
            except AttributeError as missing:
                raise ImportError(str(missing), name=fullname) from None
            return None  # a name, not a module: the import system reads it from the parent
        raise ImportError(f"{fullname} has no torchbay counterpart (see docs/accelerate-compat.md)", name=fullname)

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()) -> Iterator[Any]:
        name = context.name
        if name is None or name.replace("-", "_").replace(".", "_").lower() == "accelerate":
            yield _ServedDistribution()


def _accelerate_dir() -> str | None:
    """Where an installed Accelerate lies (found without importing it), or None."""
    spec = importlib.machinery.PathFinder.find_spec("accelerate")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _origin(fullname: str, target: str) -> str:
    """``__file__`` of a stand-in: the installed Accelerate's own file for that module (Accelerate's test helpers
    find their scripts beside it), else the file of the torchbay module that answers."""
    root = _accelerate_dir()
    if root is not None:
        base = os.path.join(root, *fullname.split(".")[1:])
        for candidate in (os.path.join(base, "__init__.py"), base + ".py"):
            if os.path.isfile(candidate):
                return candidate
    spec = importlib.util.find_spec(target)
    return spec.origin if spec is not None and spec.origin else __file__


def _real_spec(fullname: str):
    root = _accelerate_dir()
    if root is None:
        raise ImportError(f"{fullname} is Accelerate's own test helpers, which torchbay does not serve: "
                          "pip install accelerate to use them", name=fullname)
    base = os.path.join(root, *fullname.split(".")[1:])
    if os.path.isdir(base):
        return importlib.util.spec_from_file_location(fullname, os.path.join(base, "__init__.py"),
                                                      submodule_search_locations=[base])
    if os.path.isfile(base + ".py"):
        return importlib.util.spec_from_file_location(fullname, base + ".py")
    return None


def installed_finder() -> AccelerateFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, AccelerateFinder)), None)


def install(replace_imported: bool = False) -> AccelerateFinder:
    """Put the finder first on ``sys.meta_path`` (once per process).

    An ``accelerate`` already imported from its own files cannot be replaced under the objects that hold it:
    that is an error unless ``replace_imported`` (Accelerate's test scripts import nothing before it).
    """
    finder = installed_finder()
    if finder is not None:
        return finder
    imported = sorted(n for n in sys.modules if n == "accelerate" or n.startswith("accelerate."))
    if imported and not replace_imported:
        raise ConfigError(f"the real Accelerate is already imported ({imported[0]}), so torchbay cannot answer "
                          "`import accelerate` any more in this process: call torchbay.compat.as_accelerate() "
                          f"before importing transformers/peft/trl/diffusers, or set {SWITCH_ENV}=1 in the "
                          "environment before Python starts")
    for name in imported:
        del sys.modules[name]
    finder = AccelerateFinder()
    sys.meta_path.insert(0, finder)
    _alias_loggers()
    importlib.invalidate_caches()
    return finder


def _alias_loggers() -> None:
    """Answer ``logging.getLogger(<Accelerate's logger>)`` with the torchbay logger of :data:`LOGGERS`."""
    for accelerate_name, torchbay_module in LOGGERS.items():
        logging.root.manager.loggerDict.setdefault(accelerate_name, logging.getLogger(torchbay_module))


def install_from_environment() -> None:
    """Interpreter start-up (``torchbay_as_accelerate.pth``): install the finder when the switch is on."""
    if switch_requested():
        install()


def as_accelerate() -> AccelerateFinder:
    """Serve ``import accelerate`` from torchbay in this process and in every process it starts."""
    os.environ[SWITCH_ENV] = "1"
    return install()
