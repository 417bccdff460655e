"""Names a package or façade serves from the module that implements them, imported on first use.

A package at one of Accelerate's module paths (``torchbay.data``, ``torchbay.tracking``...) or a façade
(``torchbay.state``) lists its public names in ``__all__`` and answers them, and any other public name of its
implementing module, through :func:`serve_names`; nothing is imported until a name is read, so ``import
torchbay.data`` stays as cheap as the package docstring.
"""

from __future__ import annotations

import importlib
from typing import Callable


def serve_names(package: str, sources: dict[str, list[str]], fallback: tuple[str, ...] = ()
                ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name comes from the module ``sources`` lists it under;
    any other public name from the first of the ``fallback`` modules that has it (what the package's old
    single-module form offered)."""
    where = {name: module for module, names in sources.items() for name in names}

    def __getattr__(name: str) -> object:
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        for module in fallback if not name.startswith("_") else ():
            implementation = importlib.import_module(module)
            if hasattr(implementation, name):
                return getattr(implementation, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__
