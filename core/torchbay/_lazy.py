"""The one way a torchbay module serves names that live in other modules: imported on first use.

A façade (``torchbay``, ``torchbay.plugin``, ``torchbay.utils``...) or a package at one of Accelerate's module paths
(``torchbay.data``, ``torchbay.tracking``...) holds a literal table ``_LAZY = {name: "module that defines it"}`` and
answers it through :func:`attach`; nothing is imported until a name is read, so ``import torchbay.data`` stays as cheap
as the package docstring. Below the table, the module states the same names for static tools (pyright, jedi, mypy,
ruff): a literal ``__all__`` and the imports under ``if TYPE_CHECKING:``, which never run. That block is written by
``scripts/public_names.py`` and ``tests/architecture/test_public_names.py`` checks it against the table, and
``tests/architecture`` counts every table entry as an import edge of the layers (docs/architecture.md).

A module may also answer names no table can list (Accelerate names served by the installed plugins, refusals with
advice): ``attach(..., otherwise=function)``, asked after the table for any name that does not start with ``_``.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def attach(module: str, table: dict[str, str], otherwise: Callable[[str], Any] | None = None
           ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``module``: each name of ``table`` is read from the module the table gives for it
    on first use and then kept in ``module`` as a plain attribute; any other name that does not start with ``_`` is
    asked of ``otherwise`` (which raises :class:`AttributeError` for what it does not know)."""

    def __getattr__(name: str) -> Any:
        source = table.get(name)
        if source is not None:
            value = getattr(importlib.import_module(source), name)
            setattr(sys.modules[module], name, value)  # the next read is a plain attribute
            return value
        if otherwise is not None and not name.startswith("_"):
            return otherwise(name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module])) | set(table))

    return __getattr__, __dir__
