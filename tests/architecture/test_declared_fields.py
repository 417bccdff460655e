"""Declared collaborators (issue 37, item 4): each class torchbay composes from mixins declares what it reads.

An *undeclared field* is an attribute a class reads as ``self.X`` (or ``cls.X`` in a classmethod) that neither
the class itself nor one of its own bases defines: no method, property, class attribute, class-level annotation
(``strategy: Strategy``) or ``self.X = ...`` in its methods. A mixin that reads its host's ``self.config`` without
a ``config: CoreConfig`` line has one: nothing in the mixin says where the value comes from. Augmented assignment
(``self.x += 1``) reads before it writes, so it declares nothing.

The check reads each class's source with ``ast``; the classes are imported only to get their method resolution
order. Bases that are not torchbay's (``torch.optim.Optimizer``...) declare whatever they have at run time.
``python tests/architecture/test_declared_fields.py`` prints the numbers (docs/architecture.md).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the classes built from mixins (issue 37 item 4), by ``module:qualname``
TARGETS = {
    "Accelerator": "torchbay.accelerator.accelerator:Accelerator",
    "Strategy": "torchbay.axes.strategy:Strategy",
    "FSDPStrategy": "torchbay_fsdp.strategy:FSDPStrategy",
}
#: attributes every Python object has
OBJECT_NAMES = set(dir(object)) | {"__dict__", "__weakref__", "__module__", "__annotations__"}


def _own(cls: type) -> bool:
    return cls.__module__.split(".")[0].startswith("torchbay")


def class_node(cls: type) -> ast.ClassDef:
    """The ``ClassDef`` of ``cls``, from the source file its module was loaded from."""
    source = textwrap.dedent(inspect.getsource(cls))
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef) and node.name == cls.__name__, cls
    return node


def _methods(node: ast.ClassDef):
    """``(method node, the name its first argument binds, or None)`` for each function in the class body."""
    for item in node.body:
        if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decorators = {d.id for d in item.decorator_list if isinstance(d, ast.Name)}
        args = item.args.posonlyargs + item.args.args
        receiver = args[0].arg if args and "staticmethod" not in decorators else None
        yield item, receiver


def defined_names(node: ast.ClassDef) -> set[str]:
    """What the class body defines: methods, class attributes, annotations, and ``self.X = ...`` in its methods."""
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        elif isinstance(item, ast.Assign):
            names.update(n.id for target in item.targets for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    for method, receiver in _methods(node):
        if receiver is None:
            continue
        for sub in ast.walk(method):
            targets = (sub.targets if isinstance(sub, ast.Assign) else
                       [sub.target] if isinstance(sub, ast.AnnAssign) else [])
            for target in targets:
                for n in ast.walk(target):
                    if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                            and isinstance(n.value, ast.Name) and n.value.id == receiver):
                        names.add(n.attr)
    return names


def read_names(node: ast.ClassDef) -> dict[str, int]:
    """``{name: first line}`` of every ``self.X`` read in the class's methods (``self.X += ...`` included)."""
    reads: dict[str, int] = {}
    for method, receiver in _methods(node):
        if receiver is None:
            continue
        for sub in ast.walk(method):
            if isinstance(sub, ast.AugAssign) and isinstance(sub.target, ast.Attribute):
                sub = ast.Attribute(value=sub.target.value, attr=sub.target.attr, ctx=ast.Load(),
                                    lineno=sub.lineno)
            if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Load)
                    and isinstance(sub.value, ast.Name) and sub.value.id == receiver):
                reads.setdefault(sub.attr, sub.lineno)
    return reads


def undeclared_fields(target: type, own=_own) -> dict[str, list[str]]:
    """For ``target`` and each of its own (torchbay's) classes in its MRO: the names it reads and neither it
    nor its bases declare, as ``{class: ["name (line n)", ...]}`` (classes with none are left out)."""
    out: dict[str, list[str]] = {}
    for cls in target.__mro__:
        if not own(cls):
            continue
        declared = set(OBJECT_NAMES)
        for ancestor in cls.__mro__:
            if own(ancestor):
                declared |= defined_names(class_node(ancestor))
            else:
                declared |= set(dir(ancestor))
        node = class_node(cls)
        first = inspect.getsourcelines(cls)[1]
        missing = [f"{name} (line {first + line - 1})" for name, line in sorted(read_names(node).items())
                   if name not in declared]
        if missing:
            out[f"{cls.__module__}.{cls.__qualname__}"] = missing
    return out


def load(spec: str) -> type:
    module_name, _, qualname = spec.partition(":")
    module = importlib.import_module(module_name)
    here = Path(module.__file__).resolve()
    assert ROOT in here.parents, (f"{module_name} was imported from {here}, not from this checkout ({ROOT}): put "
                                  f"{ROOT}/core and the plugin's folder first on PYTHONPATH")
    return getattr(module, qualname)


def own_classes(target: type) -> list[str]:
    return [cls.__qualname__ for cls in target.__mro__ if _own(cls)]


def count(found: dict[str, list[str]]) -> int:
    return sum(len(names) for names in found.values())


def test_the_accelerator_declares_every_field_its_mixins_read():
    found = undeclared_fields(load(TARGETS["Accelerator"]))
    assert count(found) == 0, found


def test_the_strategy_base_declares_every_field_its_parts_read():
    found = undeclared_fields(load(TARGETS["Strategy"]))
    assert count(found) == 0, found


def test_fsdps_strategy_declares_every_field_its_mixins_read():
    found = undeclared_fields(load(TARGETS["FSDPStrategy"]))
    assert count(found) == 0, found


SYNTHETIC = '''
from typing import ClassVar


class Base:
    shared: ClassVar[int] = 1

    def setup(self):
        self.made = 1


class Reads:
    declared: int

    def use(self):
        self.count += 1
        return self.declared, self.config.name, self.method()

    def method(self):
        return self.made


class Host(Reads, Base):
    def __init__(self):
        self.config = object()
        self.count = 0

    def run(self):
        return self.shared, self.made, self.use(), self.declared
'''


def test_the_checker_finds_a_field_a_mixin_reads_from_its_host(tmp_path, monkeypatch):
    (tmp_path / "tb_synthetic.py").write_text(SYNTHETIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("tb_synthetic")
    try:
        found = undeclared_fields(module.Host, own=lambda cls: cls.__module__ == "tb_synthetic")
    finally:
        sys.modules.pop("tb_synthetic", None)
    # Host declares config and count itself and inherits shared/made/use/declared; Reads declares ``declared``
    # only: ``count`` (read by +=), ``config`` and ``made`` come from elsewhere; Base reads nothing
    assert found == {"tb_synthetic.Reads": ["config (line 17)", "count (line 16)", "made (line 20)"]}


if __name__ == "__main__":
    for label, spec in TARGETS.items():
        target = load(spec)
        found = undeclared_fields(target)
        public = [name for name in dir(target) if not name.startswith("_")]
        distinct = {entry.split(" ")[0] for names in found.values() for entry in names}
        print(f"{label}: {len(own_classes(target))} torchbay classes in its MRO, {len(public)} public members, "
              f"{count(found)} undeclared fields (a name read by two classes counts twice; {len(distinct)} names)")
        for owner, names in found.items():
            print(f"  {owner}: {', '.join(names)}", file=sys.stderr)
