"""The versioned plugin contract: ``torchbay.plugin`` is the one import of a plugin author, and a plugin that
declares another major version of it (``TORCHBAY_PLUGIN_API``) is refused by name at discovery while the run goes
on; a newer minor is loaded with a warning. Plugins made by ``torchbay new-plugin`` really installed here."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torchbay.plugin
from torchbay.cli.new_plugin import scaffold_device_plugin
from torchbay.registry import api_version
from torchbay.registry.manager import PluginManager

ROOT = Path(__file__).resolve().parents[2]
PUBLIC_MODULES = {"torchbay", "torchbay.plugin", "torchbay.hookspecs", "torchbay.errors"}


def torchbay_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torchbay":
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "torchbay")
    return found


def test_every_public_name_resolves_and_is_listed():
    assert torchbay.plugin.API_VERSION == api_version.API_VERSION
    for name in torchbay.plugin.__all__:
        assert getattr(torchbay.plugin, name) is not None
    assert set(torchbay.plugin.__all__) <= set(dir(torchbay.plugin))
    with pytest.raises(AttributeError, match="has no attribute 'get_plugin_manager'"):
        torchbay.plugin.get_plugin_manager  # noqa: B018 (internal: not part of the promise)


#: plugin test files that still check the core's selection and config against their plugin through internal modules
#: (they were core tests until the layout step moved them beside their plugin): this list may only shrink
TESTS_ON_INTERNALS = {
    "plugins/deepspeed/tests/conftest.py": {"torchbay.axes.cluster", "torchbay.registry.resolve",
                                            "torchbay.registry.manager", "torchbay.registry.selection"},
    "plugins/deepspeed/tests/test_deepspeed.py": {"torchbay.accelerator.prepared", "torchbay.registry.resolve",
                                                  "torchbay.registry.manager"},
    "plugins/devices/tests/test_devices.py": {"torchbay.registry.resolve", "torchbay.registry.manager",
                                              "torchbay.registry.selection"},
    "plugins/fp8/tests/test_fp8.py": {"torchbay.axes.precision", "torchbay.axes.strategy", "torchbay.config.model",
                                      "torchbay.registry.resolve", "torchbay.registry.manager"},
    "plugins/fsdp/tests/scripts/fsdp_accelerate_files.py": {"torchbay.utils"},
    "plugins/fsdp/tests/test_fsdp.py": {"torchbay.cli.main", "torchbay.registry.resolve", "torchbay.registry.manager",
                                        "torchbay.registry.selection"},
    "plugins/fsdp/tests/test_parallelism.py": {"torchbay.accelerator.surface", "torchbay.cli.main",
                                               "torchbay.registry.resolve", "torchbay.registry.manager",
                                               "torchbay.registry.selection", "torchbay.utils"},
}


def test_in_repo_plugins_use_only_the_public_api_and_declare_its_version():
    """docs/writing-plugins.md: a plugin imports torchbay, torchbay.plugin, torchbay.hookspecs, torchbay.errors
    (and torchbay.testing in its tests), no underscore name, and says which API version it was written for."""
    offenders, undeclared, in_tests = [], [], {}
    for path in sorted((ROOT / "plugins").rglob("*.py")):
        tests = "tests" in path.relative_to(ROOT / "plugins").parts or path.name == "conftest.py"
        for module in torchbay_imports(path):
            if module in PUBLIC_MODULES or (tests and module.startswith("torchbay.testing")):
                continue
            if tests:
                in_tests.setdefault(str(path.relative_to(ROOT)), set()).add(module)
            else:
                offenders.append(f"{path.relative_to(ROOT)}: {module}")
    for cfg in sorted((ROOT / "plugins").rglob("setup.cfg")):
        for line in cfg.read_text().splitlines():
            if "= torchbay_" in line and line.strip().split("=")[1].strip().endswith(".plugin"):
                module = line.split("=")[1].strip()
                source = next(cfg.parent.rglob(module.replace(".", "/") + ".py"))
                if "TORCHBAY_PLUGIN_API = " not in source.read_text():
                    undeclared.append(str(source.relative_to(ROOT)))
    assert not offenders, "plugins import internal modules (use torchbay.plugin):\n" + "\n".join(offenders)
    assert not undeclared, f"entry-point modules without TORCHBAY_PLUGIN_API: {undeclared}"
    grown = {f: sorted(m - TESTS_ON_INTERNALS.get(f, set())) for f, m in in_tests.items()
             if m - TESTS_ON_INTERNALS.get(f, set())}
    assert not grown, f"plugin tests that import internal modules (use torchbay.plugin / torchbay.testing): {grown}"
    shrunk = {f: sorted(m - in_tests.get(f, set())) for f, m in TESTS_ON_INTERNALS.items()
              if m - in_tests.get(f, set())}
    assert not shrunk, f"no longer imported, so remove them from TESTS_ON_INTERNALS: {shrunk}"


def test_the_scaffold_imports_only_torchbay_plugin(tmp_path):
    package = scaffold_device_plugin("acme", tmp_path)
    imports = set()
    for path in (package / "torchbay_acme").rglob("*.py"):
        imports |= torchbay_imports(path)
    assert imports == {"torchbay.plugin"}


@pytest.mark.parametrize("declared, verdict", [
    (None, "ok"), ((1, 0), "ok"), ((1, 99), "warn"), ((2, 0), "refuse"), ((0, 9), "refuse")])
def test_verdicts(declared, verdict):
    assert api_version.verdict("acme", "torchbay-acme", declared)[0] == verdict


def test_a_malformed_declaration_is_a_failed_plugin_with_the_fix():
    class Module:
        TORCHBAY_PLUGIN_API = "1.0"

    pm = PluginManager(autoload=False)
    info = pm.infos["acme"] = type(pm.infos["cpu"])("acme", "torchbay-acme", "0.1", "loaded")
    pm._load(info, lambda: Module)
    assert info.status == "failed"
    assert "TORCHBAY_PLUGIN_API = (major, minor)" in info.error


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Three scaffolds, installed into one target: written for API 2.0 (refused), 1.99 (warned), the current."""
    site = tmp_path_factory.mktemp("site")
    for name, version in (("nextmajor", (api_version.API_VERSION[0] + 1, 0)),
                          ("nextminor", (api_version.API_VERSION[0], 99)), ("current", api_version.API_VERSION)):
        package = scaffold_device_plugin(name, tmp_path_factory.mktemp(f"src_{name}"))
        plugin = package / f"torchbay_{name}" / "plugin.py"
        text = plugin.read_text()
        assert "TORCHBAY_PLUGIN_API = (1, 0)" in text
        plugin.write_text(text.replace("TORCHBAY_PLUGIN_API = (1, 0)", f"TORCHBAY_PLUGIN_API = {version!r}"))
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--target", str(site), str(package)], capture_output=True, text=True, timeout=300)
        assert pip.returncode == 0, pip.stdout + pip.stderr
    return site


def _run(site, *argv):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=180)


def test_next_major_is_refused_by_name_and_the_run_goes_on(installed):
    listed = _run(installed, "-m", "torchbay.cli.main", "plugins", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    major = api_version.API_VERSION[0]
    assert (rows["nextmajor"]["status"], rows["nextmajor"]["api"]) == ("refused", f"{major + 1}.0")
    assert (rows["nextminor"]["status"], rows["nextminor"]["api"]) == ("loaded", f"{major}.99")
    assert (rows["current"]["status"], rows["current"]["api"]) == ("loaded", api_version.show(api_version.API_VERSION))
    assert rows["cpu"]["api"] == api_version.show(api_version.API_VERSION)
    refusals = [line for line in listed.stderr.splitlines() if "'nextmajor'" in line]
    assert len(refusals) == 1, listed.stderr
    assert (f"plugin 'nextmajor' (distribution torchbay-nextmajor) was written for torchbay plugin API {major + 1}.0, "
            f"this torchbay implements {api_version.show(api_version.API_VERSION)}: it is not loaded") in refusals[0]
    assert "pip uninstall torchbay-nextmajor" in refusals[0]
    assert any("'nextminor'" in line and "newer than this torchbay's" in line for line in listed.stderr.splitlines())

    code = ("from torchbay import Accelerator\n"
            "acc = Accelerator(device='current')\n"
            "print(acc.device_backend.name, acc.reduce(__import__('torch').ones(2), 'sum').tolist())\n"
            "acc.end_training()\n")
    run = _run(installed, "-c", code)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[0] == "current"

    chosen = _run(installed, "-c", "from torchbay import Accelerator; Accelerator(device='nextmajor')")
    assert chosen.returncode != 0
    assert "nextmajor" in chosen.stderr.splitlines()[-1], chosen.stderr[-2000:]
