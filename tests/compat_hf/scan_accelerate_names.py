"""List every name the Hugging Face libraries import from ``accelerate`` (module level and inside functions).

Reads the installed sources with ``ast`` (nothing is imported), so the list is what the libraries' code asks for:
``python tests/compat_hf/scan_accelerate_names.py transformers peft trl diffusers`` prints one YAML document,
``{library: {accelerate module: [names]}}``, which is kept as ``tests/compat_hf/accelerate_names.yaml``.
``import accelerate.x`` and attribute reads such as ``accelerate.utils.x`` are listed too.

``python tests/compat_hf/scan_accelerate_names.py --resolve`` (with ``TORCHBAY_AS_ACCELERATE=1``) asks for every name
kept in ``accelerate_names.yaml`` and prints one JSON line, ``{"count": {library: n}, "missing": [...]}``: the check
that tests/compat_api/test_compat_switch.py, ``make compat-hf`` and docs/generate_accelerate_compat.py share.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys

import yaml


def _package_dir(library: str) -> pathlib.Path:
    spec = importlib.util.find_spec(library)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{library} is not installed here (make compat-hf installs it into .venv-hf)")
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def names_in_file(path: pathlib.Path) -> dict[str, set[str]]:
    """``{accelerate module: names}`` asked for by one source file."""
    found: dict[str, set[str]] = {}
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "accelerate" or node.module.startswith("accelerate.")):
            found.setdefault(node.module, set()).update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "accelerate" or alias.name.startswith("accelerate."):
                    found.setdefault(alias.name, set())
        elif isinstance(node, ast.Attribute) and node.value is not None:
            dotted = _dotted(node)
            if dotted and dotted.startswith("accelerate.") and not isinstance(node.ctx, ast.Store):
                module, _, name = dotted.rpartition(".")
                found.setdefault(module, set()).add(name)
    return found


def scan(library: str) -> dict[str, list[str]]:
    merged: dict[str, set[str]] = {}
    for path in sorted(_package_dir(library).rglob("*.py")):
        for module, names in names_in_file(path).items():
            merged.setdefault(module, set()).update(names)
    return {module: sorted(names) for module, names in sorted(merged.items())}


KEPT = pathlib.Path(__file__).resolve().parent / "accelerate_names.yaml"


def resolve_kept_names() -> dict:
    """Ask for every kept name (``from module import name`` as the libraries do): how many names each library
    asks for, and each one that does not resolve (``"<library>: <module>.<name>: <error>"``)."""
    import importlib

    names = yaml.safe_load(KEPT.read_text(encoding="utf-8"))
    count, missing = {}, []
    for library, modules in names.items():
        count[library] = 0
        for module, attrs in modules.items():
            try:
                found = importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - reported, with its type
                count[library] += len(attrs)
                missing += [f"{library}: {module}.{attr}: import {module}: {type(exc).__name__}: {exc}"
                            for attr in attrs]
                continue
            for attr in attrs:
                count[library] += 1
                try:
                    getattr(found, attr)
                except AttributeError:
                    try:
                        importlib.import_module(f"{module}.{attr}")
                    except ImportError as exc:
                        missing.append(f"{library}: {module}.{attr}: {exc}")
    return {"count": count, "missing": missing}


def main(argv: list[str]) -> None:
    if argv == ["--resolve"]:
        import json

        print(json.dumps(resolve_kept_names()))
        return
    libraries = argv or ["transformers", "peft", "trl", "diffusers"]
    yaml.safe_dump({library: scan(library) for library in libraries}, sys.stdout, sort_keys=False, width=110)


if __name__ == "__main__":
    main(sys.argv[1:])
