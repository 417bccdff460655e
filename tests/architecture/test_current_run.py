"""One home for the current run (issue 37, item 2): the services find the run through ``process/current.py``'s
record, not through Accelerate's ``PartialState``, and no core module reads a private member that another core
module defines. ``python tests/architecture/test_current_run.py`` prints the numbers (docs/architecture.md)."""

from __future__ import annotations

import ast
import sys
from collections import defaultdict

import imports

#: packages whose modules find the run through process/current.py (process/state.py is Accelerate's view itself)
SERVICES = ("data", "tracking", "checkpoint", "process")
STATE_VIEWS = {"PartialState", "AcceleratorState"}
#: private names read across modules that are not torchbay's own internals: torch's Module storage, and
#: Accelerate's conventions that user code and the Hugging Face libraries read on any model or state
FOREIGN_PRIVATE = {"_buffers", "_parameters", "_modules", "_non_persistent_buffers_set",
                   "_hf_hook", "_old_forward", "_reset_state"}
#: issue 37: at most this many reads of another core module's private member (20 before the record)
PRIVATE_READS_LIMIT = 5


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(imports.CORE)): ast.parse(path.read_text(encoding="utf-8"))
            for path in sorted(imports.CORE.rglob("*.py"))}


def state_view_imports(trees: dict[str, ast.Module]) -> list[str]:
    found = []
    for module, tree in trees.items():
        if module.split("/")[0] not in SERVICES or module == "process/state.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = {alias.name for alias in node.names} & STATE_VIEWS
                found += [f"{module}:{node.lineno} imports {name}" for name in sorted(names)]
    return found


def cross_module_private_reads(trees: dict[str, ast.Module]) -> list[str]:
    """``module:line expression`` for each read of ``x._name`` (``x`` not ``self``/``cls``) where ``_name`` is
    defined (assigned, or a def/class) in other core modules and not in the reading one."""
    defined: dict[str, set[str]] = defaultdict(set)
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.id
            else:
                continue
            if _private(name):
                defined[name].add(module)
    reads = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            owners = defined.get(node.attr, set())
            if owners and module not in owners and node.attr not in FOREIGN_PRIVATE:
                reads.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    return reads


def test_no_service_finds_the_run_through_accelerates_state_views():
    assert state_view_imports(_modules()) == []


def test_core_modules_read_at_most_five_private_members_of_other_modules():
    reads = cross_module_private_reads(_modules())
    assert len(reads) <= PRIVATE_READS_LIMIT, "\n".join(reads)


def test_the_counter_sees_a_private_read_and_a_state_import():
    trees = {"data/a.py": ast.parse("from torchbay.process.state import PartialState\nx = PartialState._shared\n"),
             "process/state.py": ast.parse("class PartialState:\n    _shared = {}\n")}
    assert state_view_imports(trees) == ["data/a.py:1 imports PartialState"]
    assert cross_module_private_reads(trees) == ["data/a.py:2 PartialState._shared"]


if __name__ == "__main__":
    trees = _modules()
    reads = cross_module_private_reads(trees)
    print(f"service modules importing PartialState/AcceleratorState: {len(state_view_imports(trees))}")
    print(f"reads of another core module's private member: {len(reads)} (limit {PRIVATE_READS_LIMIT})")
    print("\n".join(reads), file=sys.stderr)
