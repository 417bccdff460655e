"""What torchbay knows about each plugin it found: :class:`PluginInfo` (what ``torchbay plugins`` shows), and the
installed versions of distributions."""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import os
from dataclasses import dataclass, field


@dataclass
class PluginInfo:
    """What ``torchbay plugins`` shows about one plugin."""

    name: str
    distribution: str
    version: str
    status: str  # "loaded", "builtin", "failed", "refused" (plugin API major), "blocked", "not autoloaded"
    error: str = ""
    hooks: list[str] = field(default_factory=list)
    registers: list[str] = field(default_factory=list)
    hook: str = ""  # where it failed: "import" or a hook name
    message: str = ""  # the one-line warning given when it failed or was refused
    api: str = ""  # the plugin API version it declares (plugin/api_version.py), "-" when none

    def how_to_remove(self) -> str:
        if self.distribution in ("(module)",):
            return f"remove '{self.name}' from TORCHBAY_PLUGINS / -p"
        if self.distribution in ("(in process)", "?", ""):
            return f"do not register '{self.name}'"
        return (f"block it with -p no:{self.name} or TORCHBAY_BLOCK_PLUGINS={self.name}, "
                f"or pip uninstall {self.distribution}")


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r})"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def library_version(distribution: str, install: str | None = None) -> str:
    """The installed version of ``distribution``, or "not installed (pip install ...)": a line of ``torchbay env``."""
    try:
        return importlib_metadata.version(distribution)
    except importlib_metadata.PackageNotFoundError:
        return f"not installed (pip install {install or distribution})"


def _own_version() -> str:
    try:
        return importlib_metadata.version("torchbay")
    except importlib_metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"
