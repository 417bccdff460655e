"""``torchbay new-plugin --kind device NAME``: the scaffold installs, is selected and passes the kit.

The generated package is pip-installed into a temporary target directory (put on
PYTHONPATH of a subprocess), never into the venv, so that no other test sees the device.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchbay.cli.main import main
from torchbay.cli.new_plugin import DEVICE_FILES, names_for, scaffold_device_plugin
from torchbay.errors import TorchbayError

ROOT = Path(__file__).resolve().parents[2]


#: where a device would have to be added if torchbay were built like the tools it replaces
REGISTRATION_FILES = ("setup.cfg", "core/torchbay/registry/manager.py", "core/torchbay/registry/selection.py",
                      "core/torchbay/axes/device.py", "core/torchbay/config/model.py",
                      "core/torchbay/checkpoint/checkpointer.py", "core/torchbay/builtin/__init__.py",
                      "core/torchbay/builtin/cpu.py", "core/torchbay/hookspecs.py")


def registration_digest() -> str:
    digest = hashlib.sha256()
    for relative in REGISTRATION_FILES:
        digest.update(relative.encode())
        digest.update((ROOT / relative).read_bytes())
    return digest.hexdigest()


def test_names():
    assert names_for("acme") == {"name": "acme", "dist": "torchbay-acme", "package": "torchbay_acme",
                                 "classname": "AcmeBackend"}
    assert names_for("big_chip")["classname"] == "BigChipBackend"
    assert names_for("big_chip")["dist"] == "torchbay-big-chip"
    for bad in ("Acme", "1chip", "a-b", "", "class"):
        with pytest.raises(TorchbayError, match="must be lowercase"):
            names_for(bad)
    for reserved in ("cpu", "auto"):
        with pytest.raises(TorchbayError, match="reserved"):
            names_for(reserved)


def test_cli_writes_only_the_new_package(tmp_path, capsys):
    assert main(["new-plugin", "--kind", "device", "acme", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "created torchbay-acme" in out and "pip install -e" in out
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files == sorted(f"acme/{rel.format(**names_for('acme'))}" for rel in DEVICE_FILES.values())
    for path in [p for p in (tmp_path / "acme").rglob("*") if p.is_file()]:
        text = path.read_text()
        assert "${" not in text, f"unrendered placeholder in {path}"
        if path.suffix == ".py":
            compile(text, str(path), "exec")
    setup = (tmp_path / "acme" / "setup.cfg").read_text()
    assert "name = torchbay-acme" in setup and "acme = torchbay_acme.plugin" in setup
    assert 'CONFORMANCE_DEVICE = "acme"' in (tmp_path / "acme" / "tests" / "test_acme_conformance.py").read_text()
    # a second run refuses to overwrite
    assert main(["new-plugin", "--kind", "device", "acme", "--output", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert scaffold_device_plugin("acme", tmp_path, force=True) == tmp_path / "acme"  # same files: nothing to lose
    # --force fills a non-empty directory, but never replaces a file that differs (the author's work)
    edited = tmp_path / "acme" / "torchbay_acme" / "plugin.py"
    edited.write_text("# my device\n")
    (tmp_path / "acme" / "tests" / "test_acme_conformance.py").unlink()
    with pytest.raises(TorchbayError, match=r"(?s)would replace.*torchbay_acme/plugin.py.*move them away"):
        scaffold_device_plugin("acme", tmp_path, force=True)
    assert edited.read_text() == "# my device\n"
    assert not (tmp_path / "acme" / "tests" / "test_acme_conformance.py").exists()  # nothing written at all


def test_templates_name_no_device_but_cpu():
    import re

    banned = re.compile(r"torch\.cuda|\b(cuda|xpu|npu|mlu|hpu|xla|mps|musa)\b", re.IGNORECASE)
    folder = ROOT / "core" / "torchbay" / "templates"
    hits = [f"{p.name}:{n}" for p in folder.rglob("*.tmpl") for n, line in enumerate(p.read_text().splitlines(), 1)
            if banned.search(line)]
    assert not hits, hits


@pytest.mark.multiprocess
@pytest.mark.slow
def test_scaffolded_device_builds_installs_is_selected_and_passes_the_kit(tmp_path):
    core_before = registration_digest()
    package = scaffold_device_plugin("acme", tmp_path / "src")
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(package)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert (site / "torchbay_acme" / "plugin.py").exists()
    probe = tmp_path / "probe" / "test_acme_selected.py"
    probe.parent.mkdir()
    probe.write_text(textwrap.dedent("""
        from torchbay import Accelerator
        from torchbay.registry.manager import get_plugin_manager, reset_plugin_manager


        def test_installed_and_selected():
            reset_plugin_manager(None)
            info = get_plugin_manager().infos["acme"]
            assert (info.status, info.distribution) == ("loaded", "torchbay-acme")
            acc = Accelerator(device="acme")
            assert acc.device_backend.name == "acme"
            acc.end_training()
            # a device that maps to the CPU must not win device: auto
            assert Accelerator().device_backend.name == "cpu"


        def test_accelerate_names_know_the_device():
            from torchbay import utils

            assert utils.is_acme_available() is True  # from the package's accelerate.yaml
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    # the generated tests are the whole conformance kit, run through pytest as a vendor would
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           str(package / "tests"), str(probe)],
                          capture_output=True, text=True, timeout=500, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert "11 passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-5000:]
    assert any(line.startswith("PASSED") and "test_conformance_collectives" in line
               for line in proc.stdout.splitlines()), proc.stdout[-3000:]
    # adding the device touched only its own package
    assert registration_digest() == core_before
    import importlib.util

    assert importlib.util.find_spec("torchbay_acme") is None, "the test must not install into the venv"
