"""docs/accelerate-compat.md lists every public name of Accelerate 1.15 (top level and accelerate.utils)
with what torchbay does when asked for it, and torchbay does exactly that."""

import importlib
import os
import re
import sys

import pytest

pytest.importorskip("accelerate")  # a dev dependency: its names are the data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "docs"))

import generate_accelerate_compat as gen  # noqa: E402

from torchbay.compat.names import UnsupportedAPIError  # noqa: E402


def _rows():
    text = open(os.path.join(ROOT, "docs", "accelerate-compat.md"), encoding="utf-8").read()
    rows, section = {}, None
    for line in text.splitlines():
        heading = re.match(r"^## `([\w.]+)`", line)
        if heading:
            section = heading.group(1)
        row = re.match(r"^\| `(\w+)` \| ([\w-]+) \|", line)
        if row and section:
            rows[(section, row.group(1))] = row.group(2)
    return rows


def test_the_table_covers_every_exported_name_and_is_fresh():
    rows = _rows()
    names = gen.accelerate_names()
    missing = [(where, n) for where, listed in names.items() for n in listed if (where, n) not in rows]
    assert not missing, f"names missing from docs/accelerate-compat.md: {missing}"
    assert open(os.path.join(ROOT, "docs", "accelerate-compat.md"), encoding="utf-8").read() == gen.render(), \
        "docs/accelerate-compat.md is stale: python docs/generate_accelerate_compat.py"


def test_torchbay_does_what_the_table_says():
    wrong = []
    for (where, name), status in _rows().items():
        module = importlib.import_module({"accelerate": "torchbay", "accelerate.hooks": "torchbay.compat.hooks"}.get(
            where, "torchbay.utils"))
        try:
            value = getattr(module, name)
        except UnsupportedAPIError as exc:
            if status not in ("refused", "not-planned", "plugin-provided") or "torchbay" not in str(exc):
                wrong.append((where, name, status, "raised"))
            continue
        except AttributeError as exc:  # never: every name is offered or refused with advice
            wrong.append((where, name, status, f"AttributeError: {exc}"))
            continue
        if status in ("refused", "not-planned"):
            wrong.append((where, name, status, "did not raise"))
        if status == "placeholder":  # imports; building or calling it raises with the advice
            try:
                value()
                wrong.append((where, name, status, "a placeholder that can be used"))
            except UnsupportedAPIError as exc:
                if "torchbay" not in str(exc):
                    wrong.append((where, name, status, f"says {exc}"))
        if status == "plugin-answered":
            assert value() in (True, False), name
    assert not wrong, wrong
