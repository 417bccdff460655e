"""Rules of the architecture (docs/architecture.md) that a grep or an import can check."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORE = os.path.join(ROOT, "core", "torchbay")
BANNED = re.compile(r"torch\.cuda|\b(cuda|xpu|npu|mlu|hpu|xla|mps|musa|deepspeed|fsdp|fully_shard|"
                    r"transformer_engine|torchao|msamp)\b", re.IGNORECASE)


#: non-Python lines of the core that may name a backend: (path, the stripped line) -> why. Only
#: Accelerate's own user-facing names whose meaning does not depend on which plugins are installed.
ALLOWED = {
    ("core/torchbay/resources/distributed_types.json",
     '"DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON"]'):
        "members of Accelerate's DistributedType enum, which exist whatever plugins are installed "
        "(scripts compare accelerator.distributed_type with DistributedType.DEEPSPEED)",
}
#: core files that may name backends on every line, with why: the table of Accelerate names the Hugging Face
#: libraries import that a published torchbay plugin serves (the placeholder for a missing plugin names it)
ALLOWED_FILES = {
    "core/torchbay/compat/resources/library_names.yaml":
        "Accelerate's own names and the torchbay distributions that serve them, which do not depend on what is "
        "installed (compat/ is the one room that maps Accelerate's surface, docs/architecture.md rule 12)",
    "core/torchbay/compat/resources/accelerate_surface.yaml":
        "Accelerate 1.15's own module names, constants and enum members as Accelerate spells them (DistributedType."
        "DEEPSPEED...), written by scripts/scan_accelerate_surface.py; it names no torchbay distribution and selects "
        "nothing: under the switch an unserved name imports from it as a placeholder (rule 12)",
}
SKIPPED_SUFFIXES = (".pyc", ".pyo", ".so")
#: the plugin distributions torchbay publishes, by the name each registers: install hints name only these,
#: never a distribution nobody published (data only: test_the_catalog_of_published_plugins_is_names_only)
CATALOG = "core/torchbay/resources/published_plugins.yaml"


def _core_files():
    for folder, dirs, files in os.walk(CORE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(SKIPPED_SUFFIXES) or path.endswith(os.path.join("builtin", "cpu.py")):
                continue
            if os.path.relpath(path, ROOT).replace(os.sep, "/") == CATALOG:
                continue
            yield path


def test_core_names_no_backend():
    """Python, YAML, templates, docs: every file of the core package (docs/architecture.md)."""
    hits, used = [], set()
    for path in _core_files():
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        if rel in ALLOWED_FILES:
            continue
        for number, line in enumerate(open(path, encoding="utf-8"), 1):
            if BANNED.search(line):
                if (rel, line.strip()) in ALLOWED:
                    used.add((rel, line.strip()))
                else:
                    hits.append(f"{rel}:{number}: {line.strip()}")
    assert not hits, ("the core names a backend (docs/architecture.md: the core names no device but cpu, no "
                      "strategy but single/ddp, no FP8 engine; a plugin's Accelerate names go in its own "
                      "accelerate.yaml):\n" + "\n".join(hits))
    assert used == set(ALLOWED), f"allow-list entries that match nothing any more: {set(ALLOWED) - used}"


def test_the_catalog_of_published_plugins_is_names_only():
    import yaml

    catalog = yaml.safe_load(open(os.path.join(ROOT, CATALOG), encoding="utf-8"))
    aliases = catalog.pop("alias")
    for kind, names in catalog.items():
        assert all(isinstance(n, str) and d.startswith("torchbay-") for n, d in names.items()), kind
    for kind, names in aliases.items():
        assert set(names.values()) <= set(catalog[kind]), kind  # an alias points at a published name
    assert not [line for line in open(os.path.join(ROOT, CATALOG), encoding="utf-8")
                if re.search(r"\bimport\b|\{|!!", line)]  # no code, no flow style, no YAML tags


def test_the_scan_covers_non_python_files():
    names = {os.path.basename(path) for path in _core_files()}
    assert "accelerate.yaml" in names and "accelerate_api.yaml" in names
    assert any(name.endswith(".tmpl") for name in names)


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
    code = ("import sys, torchbay; from torchbay.registry.manager import get_plugin_manager; "
            "pm = get_plugin_manager(); "
            "pm.registries(); pm.config_sections(); "
            "print(sorted(m for m in ('deepspeed', 'torchao', 'transformer_engine', 'msamp', 'torch_npu', "
            "'torch_xla', 'habana_frameworks', 'intel_extension_for_pytorch', 'huggingface_hub') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"imported at plugin load: {proc.stdout}"


def test_a_run_without_config_files_reads_no_yaml():
    """Start-up (issue 30): PyYAML is imported only to read a YAML file (its import costs ~10 ms)."""
    code = "import sys, torch; from torchbay import Accelerator; Accelerator(); print('yaml' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHBAY_", "ACCELERATE_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False", "PyYAML was imported by a run with no YAML file"


@pytest.mark.skipif(importlib.util.find_spec("torchbay") is None, reason="torchbay not installed")
def test_no_plugin_manager_is_built_at_import():
    code = "import torchbay.registry.manager as p; import torchbay; print(p._cached is None)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "True"
