"""Rules of the architecture that a grep or an import can check."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))
CORE = os.path.join(ROOT, "core", "torchbay")
BANNED = re.compile(r"torch\.cuda|\b(cuda|xpu|npu|mlu|hpu|xla|mps|musa|deepspeed|fsdp|fully_shard|"
                    r"transformer_engine|torchao|msamp)\b", re.IGNORECASE)


def test_core_names_no_backend():
    hits = []
    for folder, _, files in os.walk(CORE):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path.endswith(os.path.join("builtin", "cpu.py")):
                continue
            for number, line in enumerate(open(path, encoding="utf-8"), 1):
                if BANNED.search(line):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not hits, "the core names a backend (DESIGN.md rule 1):\n" + "\n".join(hits)


def test_the_grep_catches_a_backend_name():
    assert BANNED.search("x = torch.cuda.is_available()")
    assert BANNED.search("if strategy == 'deepspeed':")
    assert not BANNED.search("device = 'cpu'  # discuss devices generically")


def test_every_hook_is_documented_and_exercised():
    sys.path.insert(0, os.path.join(ROOT, "docs"))
    import generate_hooks

    from torchbay import hookspecs

    docs = open(os.path.join(ROOT, "docs", "hooks.md"), encoding="utf-8").read()
    assert docs == generate_hooks.render(), "docs/hooks.md is stale: run python docs/generate_hooks.py"
    test_sources = ""
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in files:
            if name.endswith(".py") and name != "test_architecture.py":
                test_sources += open(os.path.join(folder, name), encoding="utf-8").read()
    missing_doc, missing_test = [], []
    for name in generate_hooks.hook_names():
        func = getattr(hookspecs, name)
        if not (func.__doc__ or "").strip() or f"## {name}" not in docs:
            missing_doc.append(name)
        if f"def {name}" not in test_sources:
            missing_test.append(name)
    assert not missing_doc, f"hooks without documentation: {missing_doc}"
    assert not missing_test, f"hooks that no test implements: {missing_test}"


def test_import_torchbay_imports_no_backend_library():
    code = ("import sys, torchbay; from torchbay.plugins import get_plugin_manager; pm = get_plugin_manager(); "
            "pm.registries(); pm.config_sections(); "
            "print(sorted(m for m in ('deepspeed', 'torchao', 'transformer_engine', 'msamp', 'torch_npu', "
            "'torch_xla', 'habana_frameworks', 'intel_extension_for_pytorch', 'huggingface_hub') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"imported at plugin load: {proc.stdout}"


@pytest.mark.skipif(importlib.util.find_spec("torchbay") is None, reason="torchbay not installed")
def test_no_plugin_manager_is_built_at_import():
    code = "import torchbay.plugins as p; import torchbay; print(p._cached is None)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "True"
