"""Imports point one way (docs/architecture.md, "Layers"): every runtime import of a core module, at module
level or inside a function (``if TYPE_CHECKING:`` exempt), and every entry of a lazy table (torchbay/_lazy.py), goes
to its own layer or one below; nothing in the core imports ``builtin``; there is no runtime import cycle; each module
imports alone."""

from __future__ import annotations

import subprocess
import sys

import imports

#: imports that still point up, by ``importer -> imported``: this list may only shrink (a fixed one must leave it)
KNOWN_UPWARD: set[str] = set()
#: runtime import cycles that remain, each a sorted tuple of modules: may only shrink
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def _edges():
    return imports.import_edges()


def test_every_core_module_has_a_layer():
    for name in imports.core_modules():
        imports.layer_of(name)  # raises with the fix when a new room is in no layer


def test_imports_point_down():
    found = {line.split(":")[0] + " -> " + line.split(" -> ")[1] for line in imports.upward(_edges())}
    new = sorted(found - KNOWN_UPWARD)
    fixed = sorted(KNOWN_UPWARD - found)
    assert not new, ("imports that point up the layers (move the code down, or pass the object in):\n"
                     + "\n".join(line for line in imports.upward(_edges()) if line.split(":")[0] + " -> "
                                 + line.split(" -> ")[1] in new))
    assert not fixed, f"fixed, so remove them from KNOWN_UPWARD: {fixed}"


def test_no_runtime_import_cycle():
    found = {tuple(group) for group in imports.cycles(_edges())}
    assert not (found - KNOWN_CYCLES), f"new runtime import cycles: {sorted(found - KNOWN_CYCLES)}"
    assert not (KNOWN_CYCLES - found), f"gone, so remove them from KNOWN_CYCLES: {sorted(KNOWN_CYCLES - found)}"


def test_function_level_imports_are_the_exception():
    """At most imports.FUNCTION_LEVEL_SHARE_MAX of the core's internal imports (outside the command modules) sit
    inside functions; tests/architecture/test_plugin_imports.py shows the check failing a package over it."""
    assert not [p for p in imports.problems(imports.CORE) if "inside functions" in p], imports.problems(imports.CORE)


def test_the_checker_sees_an_upward_import(tmp_path):
    assert imports.upward([("torchbay.config.model", "torchbay.accelerator.accelerator", 1, True)])
    assert imports.upward([("torchbay.data.loader", "torchbay.builtin.cpu", 1, False)])
    assert not imports.upward([("torchbay.builtin.cpu", "torchbay.axes.device", 1, False)])
    assert imports.cycles([("a", "b", 1, False), ("b", "a", 2, True)]) == [["a", "b"]]


def test_each_module_imports_alone():
    """pytest's test_meta idea: a module that works only after another torchbay module was imported has a hidden
    dependency. One interpreter imports the third-party libraries once, then forks a child per module that imports
    that module alone (no torchbay module is loaded before the fork), with DeprecationWarning as an error."""
    names = sorted(imports.core_modules())
    code = (
        "import os, sys, warnings, importlib\n"
        "import torch, numpy, yaml, pydantic, pluggy, safetensors  # shared by every child\n"
        "assert not any(m == 'torchbay' or m.startswith('torchbay.') for m in sys.modules)\n"
        "bad = []\n"
        "for name in sys.argv[1:]:\n"
        "    read, write = os.pipe()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os.close(read)\n"
        "        warnings.simplefilter('error', DeprecationWarning)\n"
        "        try:\n"
        "            importlib.import_module(name)\n"
        "            message = b''\n"
        "        except BaseException as exc:\n"
        "            message = f'{name}: {type(exc).__name__}: {exc}'.encode()\n"
        "        os.write(write, message)\n"
        "        os._exit(0)\n"
        "    os.close(write)\n"
        "    with os.fdopen(read, 'rb') as pipe:\n"
        "        message = pipe.read().decode()\n"
        "    os.waitpid(pid, 0)\n"
        "    if message:\n"
        "        bad.append(message)\n"
        "print('\\n'.join(bad))\n")
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert not proc.stdout.strip(), proc.stdout


def test_the_checker_counts_lazy_tables(tmp_path):
    """A name served on first use is an import: the table handed to ``attach`` gives edges, and the façades are
    read that way (the top-level package reaches the Accelerator through its table)."""
    module = tmp_path / "facade.py"
    module.write_text('from torchbay._lazy import attach\n\n_LAZY = {\n    "Accelerator": '
                      '"torchbay.accelerator.accelerator",\n}\n__getattr__, __dir__ = attach(__name__, _LAZY)\n')
    assert imports.lazy_tables(module, "torchbay.config.facade") == [("torchbay.accelerator.accelerator", 4)]
    edges = _edges()
    assert ("torchbay", "torchbay.accelerator.accelerator") in {(e[0], e[1]) for e in edges}
    assert ("torchbay._moved", "torchbay.axes.strategy") in {(e[0], e[1]) for e in edges}
    assert imports.upward([("torchbay.config.facade", "torchbay.accelerator.accelerator", 4, False)])
    assert imports.layer_of("torchbay.plugin") > imports.layer_of("torchbay.registry.manager")
