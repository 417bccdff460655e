"""Every moved module path in ``torchbay/_moved.py`` still imports, as the very module at its new path, with one
``DeprecationWarning`` naming that path; and every new path exists (a move that forgot ``_moved.py`` breaks the old
path of a user or a plugin, one that forgot the table breaks it here)."""

from __future__ import annotations

import json
import subprocess
import sys

CHECK = """
import importlib, json, warnings
import torchbay._moved as moved
found = {}
for old, new in moved.MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    found[old] = [module is importlib.import_module(new),
                  [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]]
print(json.dumps(found))
"""


def test_every_moved_path_imports_its_new_module_with_one_warning():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert {"torchbay.checkpoint.full_state", "torchbay.config.resolve", "torchbay.compat.finder"} <= set(found)
    for old, (same, messages) in found.items():
        assert same, f"{old} is not the module at its new path"
        assert len(messages) == 1 and old in messages[0], (old, messages)
