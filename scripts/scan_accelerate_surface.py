"""Write the table of Accelerate's public surface that torchbay's switch answers for.

    .venv/bin/python scripts/scan_accelerate_surface.py   # with the real accelerate installed, switch off

Imports every module of the installed Accelerate (but ``test_utils``, which stays Accelerate's own code) and writes
``core/torchbay/compat/resources/accelerate_surface.yaml``: for each module its names (public ones, and the private
functions and classes the module defines, which Accelerate's own tests import), each name's kind (class, function,
module, value, object) and, for a plain constant, its value. With the switch on, a name of this table that torchbay
does not serve is a placeholder that raises on use with the reason (compat/surface.py): an import never fails.
Nothing of Accelerate's code is kept, only names, kinds and constant values.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "core" / "torchbay" / "compat" / "resources" / "accelerate_surface.yaml"
SKIP = ("accelerate.test_utils",)
SIMPLE = (str, int, float, bool, type(None))


def plain(value, depth: int = 0):
    """``value`` as YAML data when it is a plain constant (strings, numbers, lists and dicts of them), else raises."""
    if isinstance(value, SIMPLE) and not isinstance(value, type):
        return value
    if depth < 3 and isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in value]
    if depth < 3 and isinstance(value, dict) and all(isinstance(k, (str, int)) for k in value):
        return {k: plain(v, depth + 1) for k, v in value.items()}
    raise TypeError(type(value))


def kind_of(module_name: str, name: str, value) -> tuple[str, object]:
    if inspect.ismodule(value):
        return "module", value.__name__
    if inspect.isclass(value) and issubclass(value, enum.Enum):  # members kept: code reads them at import
        try:
            members = {member.name: plain(member.value) for member in value}
        except TypeError:
            return "class", None
        return "enum", {"str": issubclass(value, str), "members": members}
    if inspect.isclass(value):
        return "class", None
    if callable(value):
        return "function", None
    try:
        return "value", plain(value)
    except TypeError:
        return "object", None


def scan() -> dict:
    import accelerate

    modules: dict[str, dict] = {}
    names = ["accelerate"] + [m.name for m in pkgutil.walk_packages(accelerate.__path__, "accelerate.")
                              if not m.name.startswith(SKIP)]
    for module_name in sorted(names):
        try:
            module = importlib.import_module(module_name)
        except Exception as failed:  # a module that needs a library not installed here
            print(f"# {module_name}: not scanned ({type(failed).__name__}: {failed})", file=sys.stderr)
            continue
        entries = {}
        for name, value in sorted(vars(module).items()):
            if name.startswith("__"):
                continue
            if name.startswith("_"):  # private: only what this module defines (its own tests import those)
                if getattr(value, "__module__", None) != module_name or not callable(value):
                    continue
            if type(value).__module__ == "__future__":
                continue  # ``from __future__ import annotations``
            if inspect.ismodule(value) and not value.__name__.startswith("accelerate"):
                continue  # ``import torch`` in the module: not Accelerate's surface
            if not name.startswith("_") and getattr(value, "__module__", "") and \
                    not str(getattr(value, "__module__", "")).startswith("accelerate") and \
                    (inspect.isclass(value) or inspect.isfunction(value)):
                continue  # a name the module imported from torch, typing...: not Accelerate's surface
            kind, data = kind_of(module_name, name, value)
            entries[name] = {"kind": kind} if data is None else {"kind": kind, "value": data}
        modules[module_name] = entries
    return {"version": accelerate.__version__, "modules": modules}


def main() -> None:
    table = scan()
    header = ("# Accelerate's public surface (names, kinds, constant values), written by\n"
              "# scripts/scan_accelerate_surface.py "
              f"from accelerate {table['version']}; do not edit. compat/surface.py answers every name here.\n")
    OUT.write_text(header + yaml.safe_dump(table, sort_keys=True, width=120))
    count = sum(len(v) for v in table["modules"].values())
    print(f"{len(table['modules'])} modules, {count} names -> {OUT}")


if __name__ == "__main__":
    main()
