"""What to tell a user whose chosen name is not installed.

A hint names a distribution only when torchbay publishes it (``resources/published_plugins.yaml``,
the repository's ``plugins/``). A typed name that is not published gets the nearest installed or
published name: ``pip install torchbay-<typed>`` would invite installing whatever someone
registered under that name.
"""
from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
from importlib import resources

#: the kinds of name in the catalog
DEVICE, STRATEGY, FP8_ENGINE, TRACKER, SECTION = "device", "strategy", "fp8 engine", "tracker", "config section"
LAUNCH_SWITCH = "accelerate launch switch"  # e.g. --use_deepspeed
ACCELERATE_COMMAND = "accelerate command"  # an `accelerate` subcommand a plugin serves (its accelerate.yaml)


@functools.lru_cache(maxsize=None)
def catalog() -> dict:
    import yaml

    text = resources.files("torchbay").joinpath("resources", "published_plugins.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def published(kind: str) -> dict[str, str]:
    """``{registered name: distribution}`` for one kind."""
    return dict(catalog().get(kind) or {})


def distribution_for(kind: str, name: str) -> str | None:
    return published(kind).get(name)


def install_hint(kind: str, name: str, installed: Iterable[str] = ()) -> str:
    """What to do about ``kind`` ``name`` that is not installed, in a few words:
    ``pip install torchbay-x`` when torchbay publishes it, else the nearest known name."""
    installed = sorted(set(installed))
    catalog_names = published(kind)
    if name in catalog_names:
        return f"pip install {catalog_names[name]}"
    meant = (catalog().get("alias") or {}).get(kind, {}).get(name.lower())
    if meant is None:
        close = difflib.get_close_matches(name.lower(), sorted({*installed, *catalog_names}), n=1, cutoff=0.6)
        meant = close[0] if close else None
    if meant is not None:
        if meant in installed:
            return f"did you mean '{meant}'?"
        return f"did you mean '{meant}'? (pip install {catalog_names[meant]})"
    return (f"no plugin torchbay publishes provides {kind} '{name}': check the spelling (`torchbay plugins` lists "
            f"what is installed, the README's 'Plugins in this repository' what torchbay publishes)")
