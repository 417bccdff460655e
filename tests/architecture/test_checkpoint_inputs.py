"""The checkpointer gets its collaborators, never the Accelerator (issue 29): no module of ``torchbay.checkpoint``
names ``Accelerator`` or imports ``torchbay.accelerator`` (not even for type checking), and none reads another
object's private member through a function's parameter (``acc._models``) or an attribute of ``self``
(``self.acc._models``). What the checkpointer is given is :mod:`torchbay.checkpoint.inputs`."""

from __future__ import annotations

import ast
from pathlib import Path

import imports

CHECKPOINT = imports.CORE / "checkpoint"


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> set[str]:
    args = function.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    return names - {"self", "cls"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def reaches_into_the_accelerator(source: str) -> list[str]:
    """``line: what`` for each way ``source`` refers to the Accelerator or reads a collaborator's private member."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "Accelerator":
            found.append(f"{node.lineno}: the name Accelerator")
        elif isinstance(node, ast.Attribute) and node.attr == "Accelerator":
            found.append(f"{node.lineno}: the attribute .Accelerator")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchbay.accelerator"):
            found.append(f"{node.lineno}: an import from {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {alias.name}" for alias in node.names
                      if alias.name.startswith("torchbay.accelerator")]
        if isinstance(node, (ast.ImportFrom, ast.Import)):
            found += [f"{node.lineno}: an import of Accelerator" for alias in node.names
                      if alias.name.rpartition(".")[2] == "Accelerator" or alias.asname == "Accelerator"]
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if (isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "self"):
                found.append(f"{node.lineno}: self.{owner.attr}.{node.attr} (another object's private member)")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            params = _parameters(node)
            found += [f"{inner.lineno}: {inner.value.id}.{inner.attr} (a parameter's private member)"
                      for inner in ast.walk(node) if isinstance(inner, ast.Attribute) and _private(inner.attr)
                      and isinstance(inner.value, ast.Name) and inner.value.id in params]
    return sorted(set(found), key=lambda line: int(line.split(":")[0]))


def _modules() -> list[Path]:
    return sorted(CHECKPOINT.glob("*.py"))


def test_the_checkpoint_package_never_sees_the_accelerator():
    problems = {path.name: reaches_into_the_accelerator(path.read_text(encoding="utf-8")) for path in _modules()}
    problems = {name: lines for name, lines in problems.items() if lines}
    assert not problems, ("core/torchbay/checkpoint/ reaches into the Accelerator: pass the collaborator in "
                          "(torchbay.checkpoint.inputs) instead:\n"
                          + "\n".join(f"{name}:{line}" for name, lines in problems.items() for line in lines))


def test_the_checker_sees_the_old_checkpointer():
    """What the checkpointer looked like before issue 29; each form is caught."""
    old = '''
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from torchbay.accelerator.accelerator import Accelerator

class StateCheckpointer:
    def __init__(self, accelerator: Accelerator):
        self.acc = accelerator

    def counts(self):
        return len(self.acc._models)

def _check(acc, directory):
    return len(acc._optimizers)
'''
    found = reaches_into_the_accelerator(old)
    assert any("import from torchbay.accelerator" in line for line in found)
    assert any("the name Accelerator" in line for line in found)
    assert any("self.acc._models" in line for line in found)
    assert any("acc._optimizers" in line for line in found)
    assert not reaches_into_the_accelerator(
        "class C:\n    def __init__(self, run):\n        self.run = run\n        self._own = run.strategy\n"
        "    def f(self):\n        return self._own, self.run.strategy.__class__\n")
