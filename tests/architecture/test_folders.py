"""Folders are layers (docs/architecture.md, "The rooms and their layers"): the layer table names only top-level
names (a folder, or a module of ``core/torchbay/``), so a module's layer is its folder's; and no import between two
top-level names, ``if TYPE_CHECKING:`` imports included, runs up the layers or closes a circle between folders.

A type-only import still ties two folders (a reader, a type checker and the next refactoring follow it), so it
counts here, unlike in test_layers.py's runtime check. ``python tests/architecture/test_folders.py`` prints the
numbers: imports between folders that run up the layers, and the circles between folders."""

from __future__ import annotations

import ast
from pathlib import Path

import imports


def top(module: str) -> str:
    """The top-level name of ``torchbay.x.y``: ``x`` (``__init__`` for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def every_import(path: Path, name: str) -> list[tuple[str, int]]:
    """``(imported module of the core, line)`` for every import in ``path``, wherever it stands (module level,
    functions, ``if TYPE_CHECKING:``)."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "torchbay")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] == "torchbay":
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    found.append((candidate if imports._is_module(candidate) else base, node.lineno))
    return found


def room(module: str) -> str:
    """The node of ``module`` in the folder graph: its top-level name; a façade package itself (the ``__init__`` that
    serves names of modules above its folder, imports.FACADES) is a node of its own."""
    inner = module.removeprefix("torchbay").lstrip(".") or "__init__"
    return f"{inner} (façade)" if inner in imports.FACADES and inner != "__init__" else top(module)


def folder_imports() -> list[tuple[str, str, str]]:
    """``(importing folder, imported folder, "importer:line -> imported")`` for each import between two top-level
    names of the core."""
    edges = []
    for name, path in sorted(imports.core_modules().items()):
        for target, line in every_import(path, name):
            if room(name) != room(target):
                edges.append((room(name), room(target), f"{name}:{line} -> {target}"))
    return edges


def folder_layer(module: str) -> int | str:
    """The layer of ``module``'s folder; a façade package itself (its lazy table) sits where imports.FACADES says."""
    inner = module.removeprefix("torchbay").lstrip(".") or "__init__"
    if inner in imports.FACADES:
        return imports.FACADES[inner]
    if top(module) == imports.PLUGIN_LAYER:
        return imports.PLUGIN_LAYER
    return next(index for index, names in enumerate(imports.LAYERS) if top(module) in names)


def upward_folder_imports() -> list[str]:
    """Imports between folders that point up the layers (or into ``builtin`` from the core)."""
    found = []
    for name, path in sorted(imports.core_modules().items()):
        for target, line in every_import(path, name):
            if top(name) == top(target):
                continue
            src, dst = folder_layer(f"torchbay.{top(name)}"), folder_layer(target)
            plugin, builtin_may_import = imports.PLUGIN_LAYER, imports.BUILTIN_MAY_IMPORT
            if (dst == plugin and src != plugin) or (src == plugin and dst != plugin and dst > builtin_may_import) \
                    or (plugin not in (src, dst) and dst > src):
                found.append(f"{name}:{line} -> {target}")
    return found


def folder_circles() -> list[list[str]]:
    """Groups of top-level names that import each other in a loop."""
    return imports.cycles([(source, target, 0, False) for source, target, _ in folder_imports()])


def test_the_layer_table_names_only_top_level_names():
    dotted = [name for layer in imports.LAYERS for name in layer if "." in name]
    assert not dotted, (f"tests/architecture/imports.py LAYERS puts single modules in a layer of their own: "
                        f"{dotted}; move each into a folder of its layer and list only the folder")


def test_no_import_between_folders_runs_up():
    found = upward_folder_imports()
    assert not found, ("imports between folders that point up the layers (TYPE_CHECKING included): move the class "
                       "into the lowest folder its users need:\n" + "\n".join(found))


def test_no_circle_between_folders():
    found = folder_circles()
    assert not found, "folders that import each other in a loop:\n" + "\n".join(
        " <-> ".join(group) + ":\n  " + "\n  ".join(where for source, target, where in folder_imports()
                                                    if source in group and target in group) for group in found)


if __name__ == "__main__":
    print(f"imports between folders that run up the layers: {len(upward_folder_imports())}")
    print(f"circles between folders: {len(folder_circles())}")
