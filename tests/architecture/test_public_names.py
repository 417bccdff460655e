"""Public names that static tools see (issue 37): every façade and lazy package of the core serves its names through
the one mechanism of torchbay/_lazy.py, from a literal ``_LAZY`` table, and states the same names for pyright, jedi
and ruff (a literal ``__all__`` and ``if TYPE_CHECKING:`` imports, written by scripts/public_names.py). Start-up stays
what the lazy tables make it: ``import torchbay`` imports four small torchbay modules and ``typing``."""

from __future__ import annotations

import ast
import configparser
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import public_names  # noqa: E402

#: the modules a user or a plugin author imports names from: each must be a lazy module of the one mechanism
FACADES = {"torchbay", "torchbay.plugin", "torchbay.utils", "torchbay.state", "torchbay.wrappers",
           "torchbay.launchers", "torchbay.accelerator", "torchbay.big_modeling", "torchbay.compile",
           "torchbay.config", "torchbay.data", "torchbay.tracking"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT / "core").with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _lazy_modules() -> dict[str, Path]:
    return {_module_name(path): path for path in public_names.lazy_modules()}


def test_every_facade_is_a_lazy_module():
    assert FACADES <= set(_lazy_modules()), f"façades without a _LAZY table: {sorted(FACADES - set(_lazy_modules()))}"


def test_written_names_match_the_tables():
    problems = [problem for path in _lazy_modules().values() for problem in public_names.stale(path)]
    assert not problems, "\n".join(problems) + "\nrun: python scripts/public_names.py"


def test_stale_names_are_seen(tmp_path):
    module = tmp_path / "facade.py"
    module.write_text('from typing import TYPE_CHECKING\n\nfrom torchbay._lazy import attach\n\n'
                      '_LAZY = {"Accelerator": "torchbay.accelerator.accelerator",\n'
                      '         "set_seed": "torchbay.process.seeding"}\n'
                      '__getattr__, __dir__ = attach(__name__, _LAZY)\n\n'
                      f'{public_names.BEGIN}\n__all__ = ["Accelerator"]\n\nif TYPE_CHECKING:\n'
                      f'    from torchbay.accelerator.accelerator import Accelerator\n{public_names.END}\n')
    problems = public_names.stale(module)
    assert len(problems) == 2 and "set_seed" in problems[1]
    public_names.rewrite(module)
    assert public_names.stale(module) == []


def test_each_name_comes_from_the_module_its_table_gives():
    """The table names the module that binds the name (so the TYPE_CHECKING import resolves for static tools), and
    the façade answers that very object; a name its module answers dynamically (the installed trackers' classes by
    Accelerate's names) need only exist there as a module ``__getattr__``."""
    wrong = []
    for name, path in sorted(_lazy_modules().items()):
        module = importlib.import_module(name)
        for attr, source_name in public_names.read_table(ast.parse(path.read_text(encoding="utf-8"))).items():
            source = importlib.import_module(source_name)
            if attr in vars(source):
                if getattr(module, attr) is not vars(source)[attr]:
                    wrong.append(f"{name}.{attr} is not {source_name}.{attr}")
            elif "__getattr__" not in vars(source):
                wrong.append(f"{name}.{attr}: {source_name} does not bind {attr}")
    assert not wrong, "\n".join(wrong)


def test_one_lazy_mechanism():
    """No module of the core writes its own module ``__getattr__``: each comes from ``_lazy.attach``, given a literal
    table (so tests/architecture counts its entries as import edges)."""
    found = []
    for path in sorted((ROOT / "core" / "torchbay").rglob("*.py")):
        if "templates" in path.parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} defines {node.name}")
            call = node.value if isinstance(node, ast.Assign) else None
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "attach":
                table = call.args[1]
                if not (isinstance(table, ast.Dict) or getattr(table, "id", None) == "_LAZY"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} gives attach a table that is not _LAZY")
    assert not found, "\n".join(found)


def test_unknown_names_and_dir():
    import torchbay.plugin
    import torchbay.utils

    with pytest.raises(AttributeError, match="has no attribute 'get_plugin_manager'"):
        torchbay.plugin.get_plugin_manager  # noqa: B018 (internal: not part of the plugin author's promise)
    with pytest.raises(ImportError):
        exec("from torchbay.data import move_to_device", {})  # an internal helper of torchbay.data.loader
    assert set(torchbay.plugin.__all__) <= set(dir(torchbay.plugin))
    assert {"gather", "get_logger", "tqdm", "MultiProcessAdapter"} <= set(dir(torchbay.utils))


def test_version_is_setup_cfgs():
    import torchbay
    from torchbay._version import __version__

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert torchbay.__version__ == __version__ == config["metadata"]["version"]


def test_import_torchbay_stays_small():
    """``import torchbay`` reads the tables and nothing they name (start-up: DESIGN rule 14, docs/performance.md)."""
    code = ("import sys; before = set(sys.modules); import torchbay, torchbay.plugin, torchbay.utils, torchbay.data; "
            "print(' '.join(sorted(m for m in set(sys.modules) - before if m.startswith('torchbay'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["torchbay", "torchbay._lazy", "torchbay._moved", "torchbay._version",
                                   "torchbay.data", "torchbay.plugin", "torchbay.utils"]


def test_an_old_module_path_is_the_new_module_with_one_warning():
    """torchbay/_moved.py: a 0.1 path imports, for one release, as the module at its new path, warning once."""
    code = ("import warnings; warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    import torchbay.strategy as old\n"
            "    import torchbay.strategy as again\n"
            "from torchbay.axes import strategy as new\n"
            "print(old is new and again is new, [str(w.message) for w in caught if w.category is DeprecationWarning])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("True ['torchbay.strategy moved to torchbay.axes.strategy in torchbay 0.2"), \
        proc.stdout
    assert proc.stdout.count("moved to") == 1


def test_py_typed_ships():
    """PEP 561: the wheel carries py.typed, so type checkers read torchbay's annotations and these names
    (scripts/check_release.sh finds it in the installed wheel)."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert (ROOT / "core" / "torchbay" / "py.typed").is_file()
    assert "py.typed" in config["options.package_data"]["torchbay"].split()
