"""Runtime imports of torchbay's code, read with ``ast`` (module level and inside functions; imports under
``if TYPE_CHECKING:`` do not run and are left out): the core's layers, and for the core and every in-repo plugin
package (``plugins/**/torchbay_*``) its runtime cycles and its share of imports made inside functions.

A lazy table is an import too: each entry of a ``_LAZY`` table that a core module serves through
``torchbay._lazy.attach`` (and of ``torchbay._moved``'s table of 0.1 paths) imports the module it names on first use,
so it is an edge of the layer and cycle checks like any ``import`` statement (not of the share of imports inside
functions, which counts import statements).

``python tests/architecture/imports.py`` prints the table of docs/architecture.md, "Imports inside functions"."""

from __future__ import annotations

import ast
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core" / "torchbay"
PLUGINS = ROOT / "plugins"

#: imports of torchbay's code (the package's own modules and the core) made inside functions: at most this share
#: of a package's such imports, rounded down, and always one. A function-level import is kept only to keep
#: start-up light (a module loaded at plugin discovery or by ``import torchbay`` defers what a command or a
#: strategy needs) or to reach an optional dependency; anything else goes at module level. Third-party imports
#: are not counted (``torch.distributed.checkpoint``, ``deepspeed``, ``wandb``: optional or heavy by nature).
FUNCTION_LEVEL_SHARE_MAX = 0.10
#: core modules left out of the share: the command-line tools (``torchbay`` and, in ``cli.accelerate``, the
#: ``accelerate`` commands) defer each command's imports to the command, so that ``--help`` and every other command
#: start fast
START_UP_DEFERRED = ("torchbay.cli",)

#: docs/architecture.md, "Layers": a runtime import may only point to the same layer or one below
LAYERS = [
    ("errors", "_lazy", "_version"),
    ("config", "distributed", "compile", "storage", "switch"),
    ("axes",),
    ("registry", "hookspecs"),
    ("process",),
    ("data", "checkpoint", "big_modeling", "tracking", "launch", "telemetry"),
    ("compat",),
    ("accelerator",),
    ("utils", "state", "wrappers", "launchers", "cli", "testing", "_moved"),
]
#: façades: a package ``__init__`` that serves names of modules above its own room (its lazy table) sits at the layer
#: of the highest of them; its submodules keep their room's layer (importing ``torchbay.x.y`` runs the façade
#: ``torchbay.x`` first, which imports only ``torchbay._lazy`` until a name is read)
FACADES = {"__init__": 8, "plugin": 8}
#: the lazy tables that are not handed to ``attach``: module -> the name of its table of module paths
OTHER_LAZY_TABLES = {"torchbay._moved": "MOVED"}
# a plugin inside the core: it may import layers 0-5 (up to the services), and no core module imports it
PLUGIN_LAYER = "builtin"
BUILTIN_MAY_IMPORT = 5


def module_name(path: Path, package: Path = CORE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] if len(parts) > 1 else parts
    return ".".join(parts)


def layer_of(module: str) -> int | str:
    """The layer index of ``torchbay.x.y``; the most specific entry of :data:`LAYERS` wins."""
    inner = module.removeprefix("torchbay").lstrip(".") or "__init__"
    if inner.split(".")[0] == PLUGIN_LAYER:
        return PLUGIN_LAYER
    if inner in FACADES:
        return FACADES[inner]
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


def runtime_imports(path: Path, name: str, package: Path = CORE) -> list[tuple[str, int, bool]]:
    """``(imported module of torchbay's code, line, inside a function)`` for each runtime import in ``path``, a
    module of ``package`` (the core or a plugin package): imports of the package itself and of the core."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tops = {package.name, CORE.name}
    found: list[tuple[str, int, bool]] = []

    def ours(dotted: str) -> bool:
        return dotted.split(".")[0] in tops

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_block(child):
                for sub in child.orelse:
                    visit(sub, in_function)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names if ours(a.name))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(here.split(".")[:len(here.split(".")) - child.level + 1]
                                    + ([base] if base else []))
                if ours(base):
                    for alias in child.names:
                        candidate = f"{base}.{alias.name}"
                        found.append((candidate if _is_module(candidate, package) else base, child.lineno,
                                      in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def _is_module(dotted: str, package: Path = CORE) -> bool:
    root = package.parent if dotted.split(".")[0] == package.name else CORE.parent
    base = root.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def package_modules(package: Path = CORE) -> dict[str, Path]:
    """Every module of ``package`` (a directory holding ``__init__.py``) by dotted name."""
    modules = {}
    for folder, dirs, files in os.walk(package):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "templates", "resources")]
        for file in files:
            if file.endswith(".py"):
                path = Path(folder) / file
                modules[module_name(path, package)] = path
    return modules


def core_modules() -> dict[str, Path]:
    return package_modules(CORE)


def plugin_packages() -> list[Path]:
    """Every in-repo plugin package: ``plugins/**/torchbay_*`` holding ``__init__.py`` (tests left out)."""
    return sorted(path for path in PLUGINS.glob("**/torchbay_*")
                  if (path / "__init__.py").is_file() and "tests" not in path.relative_to(PLUGINS).parts)


def lazy_tables(path: Path, name: str) -> list[tuple[str, int]]:
    """``(module named by a lazy table, line)`` for each entry of the module's lazy tables: the table handed to
    ``attach`` (a literal dict, or the name of one assigned at the top level) and those of :data:`OTHER_LAZY_TABLES`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assigned = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)}
    tables = [assigned[OTHER_LAZY_TABLES[name]]] if name in OTHER_LAZY_TABLES else []
    for node in tree.body:
        call = node.value if isinstance(node, ast.Assign) else None
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "attach" and len(call.args) > 1:
            table = call.args[1]
            tables.append(assigned.get(table.id) if isinstance(table, ast.Name) else table)
    found = []
    for table in tables:
        if not isinstance(table, ast.Dict):
            raise ValueError(f"{path}: a lazy table that is not a literal dict (tests/architecture reads it as edges)")
        found.extend((value.value, value.lineno) for value in table.values
                     if isinstance(value, ast.Constant) and str(value.value).startswith("torchbay"))
    return found


def import_edges(package: Path = CORE, lazy: bool = True) -> list[tuple[str, str, int, bool]]:
    """``(importer, imported, line, inside a function)`` for every runtime import of torchbay's code made by a
    module of ``package`` (by default the core: the imports between core modules), with the entries of its lazy
    tables (each an import at module level) unless ``lazy`` is False."""
    edges = []
    for name, path in sorted(package_modules(package).items()):
        found = runtime_imports(path, name, package)
        if lazy:
            found += [(target, line, False) for target, line in lazy_tables(path, name)]
        for target, line, in_function in found:
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for node in sorted(graph):
        if node not in index:
            strong(node)
    return sorted(out)


def function_level(edges) -> tuple[int, int]:
    """``(inside functions, all)``: import statements of torchbay's code, one per importer, imported module and
    line (``from m import a, b`` is one import of ``m``)."""
    statements = {(source, target, line): in_function for source, target, line, in_function in edges}
    return sum(statements.values()), len(statements)


def function_level_limit(total: int) -> int:
    """The most of ``total`` imports that may sit inside functions (:data:`FUNCTION_LEVEL_SHARE_MAX`)."""
    return max(1, math.floor(FUNCTION_LEVEL_SHARE_MAX * total))


def share_edges(package: Path = CORE) -> list[tuple[str, str, int, bool]]:
    """The imports the share counts: the package's, less the core's :data:`START_UP_DEFERRED` modules."""
    return [e for e in import_edges(package, lazy=False) if not e[0].startswith(START_UP_DEFERRED)]


def problems(package: Path) -> list[str]:
    """What breaks the rules in ``package`` (the core or a plugin package): its runtime import cycles and too
    many imports inside functions, each with the fix; empty when it keeps them."""
    found = [f"{package.name}: runtime import cycle {' <-> '.join(group)}: move what one of them needs into a "
             f"module below both" for group in cycles(import_edges(package))]
    inside, total = function_level(share_edges(package))
    if inside > function_level_limit(total):
        where = sorted({f"{source}:{line} -> {target}" for source, target, line, in_function in
                        share_edges(package) if in_function})
        found.append(f"{package.name}: {inside} of {total} imports of torchbay's code sit inside functions (the "
                     f"limit is {function_level_limit(total)}, {FUNCTION_LEVEL_SHARE_MAX:.0%}): import at module "
                     f"level unless start-up cost or an optional dependency needs the import deferred:\n  "
                     + "\n  ".join(where))
    return found


def table() -> str:
    """The markdown table of docs/architecture.md, "Imports inside functions", measured now."""
    rows = ["| package | modules | imports of torchbay's code | inside functions | share | limit | runtime cycles |",
            "|---|---:|---:|---:|---:|---:|---|"]
    for package in [CORE, *plugin_packages()]:
        inside, total = function_level(share_edges(package))
        groups = cycles(import_edges(package))
        name = f"{package.name} (outside the command modules)" if package == CORE else package.name
        rows.append(f"| {name} | {len(package_modules(package))} | {total} | {inside} | "
                    f"{inside / total if total else 0:.0%} | {function_level_limit(total)} | "
                    f"{'; '.join(' <-> '.join(g) for g in groups) or 0} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
