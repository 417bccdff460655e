"""Write what static tools read of each lazy module of the core: its ``__all__`` and its ``if TYPE_CHECKING:`` imports.

    .venv/bin/python scripts/public_names.py          # rewrite the blocks from the tables
    .venv/bin/python scripts/public_names.py --check  # exit 1, naming the modules, when a block is stale

A module that serves names through :func:`torchbay._lazy.attach` holds them in a literal table
``_LAZY = {name: "module"}``, which is what runs. Pyright, jedi, mypy and ruff do not run it: for them this script
writes, between two marker comments, a literal ``__all__`` (the table's names, the module's own public functions and
classes, and what it already listed that it binds) and one import per name under ``if TYPE_CHECKING:`` (which never
runs, so start-up is unchanged). Then ruff sorts those imports as ``make lint`` wants them.
``tests/architecture/test_public_names.py`` runs :func:`stale` on every module.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "torchbay"
BEGIN = "# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --"
END = "# -- end of the names written by scripts/public_names.py --"


def lazy_modules() -> list[Path]:
    """Every core module that calls ``attach`` (torchbay/_lazy.py)."""
    found = []
    for path in sorted(CORE.rglob("*.py")):
        if "templates" in path.parts or path.name == "_lazy.py":
            continue
        if "attach(" in path.read_text(encoding="utf-8") and read_table(ast.parse(path.read_text())) is not None:
            found.append(path)
    return found


def read_table(tree: ast.Module) -> dict[str, str] | None:
    """The literal ``_LAZY`` table at the module's top level, or None when there is none."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_LAZY"]) or (
                isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "_LAZY"):
            return {k: v for k, v in ast.literal_eval(node.value).items()}
    return None


def own_names(tree: ast.Module) -> list[str]:
    """The public functions and classes the module defines itself."""
    return [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
            and not node.name.startswith("_")]


def bound_names(tree: ast.Module) -> set[str]:
    """The names the module binds at its top level when it runs (``if TYPE_CHECKING:`` imports left out)."""
    bound = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Assign):
            bound.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return bound


def expected_all(tree: ast.Module) -> list[str]:
    """The table's names, the module's own public functions and classes, and what its ``__all__`` already lists
    that the module binds when it runs (a name it imports to serve it at Accelerate's path, say)."""
    kept = set(written(tree)[0] or ()) & bound_names(tree)
    return sorted(set(read_table(tree) or {}) | set(own_names(tree)) | kept)


def written(tree: ast.Module) -> tuple[list[str] | None, dict[str, str]]:
    """``(__all__, {name: module imported under TYPE_CHECKING})`` as the module states them."""
    all_names, imported = None, {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            try:
                all_names = list(ast.literal_eval(node.value))
            except ValueError:
                all_names = None
        elif isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for sub in node.body:
                if isinstance(sub, ast.ImportFrom) and not sub.level:
                    for alias in sub.names:
                        imported[alias.asname or alias.name] = sub.module
    return all_names, imported


def stale(path: Path) -> list[str]:
    """What the module's written names get wrong against its table (nothing when they agree)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    table = read_table(tree)
    if table is None:
        return [f"{path}: no literal _LAZY table"]
    all_names, imported = written(tree)
    problems = []
    if all_names != expected_all(tree):
        problems.append(f"{path}: __all__ is not the table's names and the module's own: {expected_all(tree)}")
    if imported != table:
        missing = sorted(set(table.items()) - set(imported.items()))
        extra = sorted(set(imported.items()) - set(table.items()))
        problems.append(f"{path}: the TYPE_CHECKING imports differ from _LAZY (missing {missing}, extra {extra})")
    return problems


def block(tree: ast.Module) -> str:
    table = read_table(tree) or {}
    names = ", ".join(f'"{name}"' for name in expected_all(tree))
    lines = [BEGIN, *textwrap.wrap(f"__all__ = [{names}]", 120, subsequent_indent=" " * 11, break_on_hyphens=False),
             "", "if TYPE_CHECKING:"]
    by_module: dict[str, list[str]] = {}
    for name, module in table.items():
        by_module.setdefault(module, []).append(name)
    for module, imported in sorted(by_module.items()):
        lines.append(f"    from {module} import ({', '.join(sorted(imported))})")
    lines.append(END)
    return "\n".join(lines) + "\n"


def rewrite(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    new = block(tree)
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + new + rest.split(END + "\n", 1)[1]
    else:  # first time: after the statement that calls attach, and an ``__all__`` written by hand goes
        call = next(node for node in tree.body
                    if "attach(" in ast.unparse(node) and not isinstance(node, ast.ImportFrom))
        lines = text.splitlines(keepends=True)
        for node in tree.body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
                lines[node.lineno - 1:node.end_lineno] = [""] * (node.end_lineno - node.lineno + 1)
        text = "".join(lines[:call.end_lineno]) + "\n" + new + "".join(lines[call.end_lineno:])
    path.write_text(text, encoding="utf-8")
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff:  # sort and wrap the imports as `make lint` wants them
        subprocess.run([ruff, "check", "--quiet", "--select", "I", "--fix", str(path)], check=False)


def main(argv: list[str]) -> int:
    paths = lazy_modules()
    if "--check" in argv:
        problems = [problem for path in paths for problem in stale(path)]
        print("\n".join(problems) or f"{len(paths)} modules: their written names match their tables")
        return 1 if problems else 0
    for path in paths:
        if stale(path) or BEGIN not in path.read_text(encoding="utf-8"):
            rewrite(path)
            print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
