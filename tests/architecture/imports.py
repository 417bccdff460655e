"""Runtime imports among torchbay's own modules, read with ``ast`` (module level and inside functions;
imports under ``if TYPE_CHECKING:`` do not run and are left out), and the layer each module belongs to."""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core" / "torchbay"

#: docs/architecture.md, "Layers": a runtime import may only point to the same layer or one below
LAYERS = [
    ("__init__", "errors", "_lazy", "_moved"),
    ("config", "distributed", "compile", "checkpoint.files", "checkpoint.full_state", "checkpoint.publish",
     "checkpoint.inplace", "checkpoint.safe_load", "compat.finder", "compat.surface"),
    ("axes",),
    ("plugin", "hookspecs", "config.resolve"),
    ("process",),
    ("data", "checkpoint", "big_modeling", "tracking", "launch"),
    ("compat",),
    ("accelerator",),
    ("utils", "state", "wrappers", "launchers", "cli", "testing", "compat.commands", "compat.accelerate_cli",
     "compat.config_commands", "compat.launch_helpers", "compat.launch_namespace", "compat.launch_validation"),
]
# a plugin inside the core: it may import layers 0-5 (up to the services), and no core module imports it
PLUGIN_LAYER = "builtin"
BUILTIN_MAY_IMPORT = 5


def module_name(path: Path, root: Path = CORE) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] if len(parts) > 1 else parts
    return ".".join(parts)


def layer_of(module: str) -> int | str:
    """The layer index of ``torchbay.x.y``; the most specific entry of :data:`LAYERS` wins."""
    inner = module.removeprefix("torchbay").lstrip(".") or "__init__"
    if inner.split(".")[0] == PLUGIN_LAYER:
        return PLUGIN_LAYER
    best, best_len = None, -1
    for index, names in enumerate(LAYERS):
        for name in names:
            if (inner == name or inner.startswith(name + ".")) and len(name) > best_len:
                best, best_len = index, len(name)
    if best is None:
        raise KeyError(f"{module} is in no layer of tests/architecture/imports.py LAYERS: add it there and to "
                       f"docs/architecture.md")
    return best


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def runtime_imports(path: Path, name: str) -> list[tuple[str, int, bool]]:
    """``(imported torchbay module, line, inside a function)`` for each runtime import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_block(child):
                for sub in child.orelse:
                    visit(sub, in_function)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names if a.name.startswith("torchbay"))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - child.level + 1]
                                    + ([base] if base else []))
                if base == "torchbay" or base.startswith("torchbay."):
                    for alias in child.names:
                        candidate = f"{base}.{alias.name}"
                        found.append((candidate if _is_module(candidate) else base, child.lineno, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def _is_module(dotted: str) -> bool:
    base = CORE.parent.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def core_modules() -> dict[str, Path]:
    modules = {}
    for folder, dirs, files in os.walk(CORE):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "templates", "resources")]
        for file in files:
            if file.endswith(".py"):
                path = Path(folder) / file
                modules[module_name(path)] = path
    return modules


def import_edges() -> list[tuple[str, str, int, bool]]:
    """``(importer, imported, line, inside a function)`` for every runtime import between core modules."""
    edges = []
    for name, path in sorted(core_modules().items()):
        for target, line, in_function in runtime_imports(path, name):
            if target != name:
                edges.append((name, target, line, in_function))
    return edges


def upward(edges) -> list[str]:
    """Imports that point up the layers (or into builtin from the core): ``importer:line -> imported``."""
    bad = []
    for source, target, line, _ in edges:
        src, dst = layer_of(source), layer_of(target)
        if dst == PLUGIN_LAYER and src != PLUGIN_LAYER:
            bad.append(f"{source}:{line} -> {target}")
        elif src == PLUGIN_LAYER and dst != PLUGIN_LAYER and dst > BUILTIN_MAY_IMPORT:
            bad.append(f"{source}:{line} -> {target}")
        elif src != PLUGIN_LAYER and dst != PLUGIN_LAYER and dst > src:
            bad.append(f"{source}:{line} -> {target}")
    return bad


def cycles(edges) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted; packages' __init__ excluded
    when they only re-export lazily (an import of ``torchbay.x.y`` runs ``torchbay.x`` first, which is harmless)."""
    graph: dict[str, set[str]] = {}
    for source, target, _, _ in edges:
        graph.setdefault(source, set()).add(target)
        graph.setdefault(target, set())
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def strong(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                strong(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    import sys
    sys.setrecursionlimit(10000)
    for node in sorted(graph):
        if node not in index:
            strong(node)
    return sorted(out)
