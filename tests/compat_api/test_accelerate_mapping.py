"""Plugins contribute their part of the Accelerate compatibility tables (hook torchbay_accelerate_mapping):
the config import and the Accelerate names use it, a key defined twice disables the later plugin, and a
value no installed plugin maps is reported as not imported, saying which kind of plugin to install."""

import configparser
import glob
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torchbay
from torchbay.compat import config_import as accelerate_import
from torchbay.compat.names import UnsupportedAPIError
from torchbay.config.model import Section
from torchbay.registry.manager import PluginManager, get_plugin_manager, hookimpl, reset_plugin_manager

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "accelerate"


class SdaaSection(Section):
    level: int = 0


class SdaaPlugin:
    """A third-party device plugin that maps Accelerate's MULTI_SDAA and a nested config of its own."""

    @hookimpl
    def torchbay_config_sections(self):
        return {"sdaa": SdaaSection}

    @hookimpl
    def torchbay_accelerate_mapping(self):
        return {
            "config_import": {
                "distributed_type": {"MULTI_SDAA": {"device": "sdaa", "strategy": "ddp"}},
                "sections": {"sdaa_config": {"target": "sdaa", "plugin": "torchbay-sdaa",
                                             "keys": {"sdaa_level": {"key": "level"}}}},
            },
            "api": {
                "available_plugins": {"sdaa_runtime": "json"},
                "unsupported": [{"status": "refused", "advice": "torchbay-sdaa does it in prepare()",
                                 "names": ["prepare_sdaa_model"]}],
            },
        }


class Clashing:
    """Maps a distributed_type that another plugin (or the core) already maps."""

    def __init__(self, distributed_type):
        self.distributed_type = distributed_type

    @hookimpl
    def torchbay_accelerate_mapping(self):
        return {"config_import": {"distributed_type": {self.distributed_type: {"device": "other"}}}}


SDAA_RUN = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_SDAA", "num_processes": 2,
            "sdaa_config": {"sdaa_level": 3}}


def _lines(report, prefix):
    return [line for line in report.lines() if line.startswith(prefix)]


def test_a_third_party_plugins_fragment_is_merged_and_used_by_the_import():
    pm = PluginManager(autoload=False)
    tree, report = accelerate_import.convert(dict(SDAA_RUN), pm)
    assert "device" not in tree and "sdaa" not in tree
    (dist,) = [line for line in _lines(report, "NOT IMPORTED") if "distributed_type" in line]
    assert "no installed plugin maps it; install the torchbay device plugin for it" in dist
    assert any(line.startswith("NOT IMPORTED sdaa_config.sdaa_level = 3: sdaa_config: no installed plugin")
               for line in report.lines())

    pm.register_plugin(SdaaPlugin(), "sdaa")
    tree, report = accelerate_import.convert(dict(SDAA_RUN), pm)
    assert tree == {"device": "sdaa", "strategy": "ddp", "launch": {"num_processes": 2}, "sdaa": {"level": 3}}
    assert not _lines(report, "NOT IMPORTED") and not report.problems and not report.unchecked
    _, report = accelerate_import.convert({**SDAA_RUN, "sdaa_config": {"sdaa_level": "high"}}, pm)
    assert report.problems and "sdaa.level" in report.problems[0]  # checked against the plugin's section


def test_a_third_party_plugins_api_fragment_answers_accelerate_names():
    from torchbay import utils

    with pytest.raises(AttributeError):
        utils.prepare_sdaa_model
    pm = PluginManager(autoload=False)
    pm.register_plugin(SdaaPlugin(), "sdaa")
    reset_plugin_manager(pm)
    assert utils.is_sdaa_runtime_available() is True  # its library ('json') is installed
    with pytest.raises(UnsupportedAPIError, match="torchbay-sdaa does it in prepare"):
        utils.prepare_sdaa_model
    with pytest.raises(UnsupportedAPIError):  # the core's own refusals are still there
        torchbay.utils.TorchTensorParallelPlugin


def test_a_key_defined_twice_disables_the_later_plugin(caplog):
    pm = PluginManager(autoload=False)
    pm.register_plugin(SdaaPlugin(), "sdaa")
    pm.register_plugin(Clashing("MULTI_SDAA"), "late")
    pm.register_plugin(Clashing("MULTI_CPU"), "core-clash")
    with caplog.at_level(logging.WARNING, logger="torchbay"):
        tree, _ = accelerate_import.convert(dict(SDAA_RUN), pm)
    assert tree["device"] == "sdaa"  # the first plugin's mapping
    assert pm.is_failed("late") and pm.is_failed("core-clash") and not pm.is_failed("sdaa")
    messages = [r.getMessage() for r in caplog.records]
    assert any("plugin 'late'" in m and "config_import.distributed_type.MULTI_SDAA" in m and "plugin 'sdaa'" in m
               for m in messages), messages
    assert any("plugin 'core-clash'" in m and "torchbay's own table" in m for m in messages), messages
    assert accelerate_import.convert({"distributed_type": "MULTI_CPU"}, pm)[0] == {"device": "cpu",
                                                                                   "strategy": "ddp"}


def test_a_malformed_fragment_disables_its_plugin():
    class Malformed:
        @hookimpl
        def torchbay_accelerate_mapping(self):
            return {"config_import": ["not", "a", "mapping"]}

    pm = PluginManager(autoload=False)
    pm.register_plugin(Malformed(), "malformed")
    assert accelerate_import.mapping_table(pm)["distributed_type"] == {"NO": {}, "MULTI_CPU": {"device": "cpu",
                                                                                              "strategy": "ddp"}}
    assert pm.is_failed("malformed") and "not {'config_import'" in pm.infos["malformed"].error


def test_without_the_plugins_each_backend_value_says_what_to_install():
    pm = PluginManager(autoload=False)
    _, report = accelerate_import.import_file(str(FIXTURES / "multi_gpu.yaml"), pm)
    assert ("NOT IMPORTED distributed_type = 'MULTI_GPU': no installed plugin maps it; install the torchbay device "
            "plugin for it") in "\n".join(report.lines())
    _, report = accelerate_import.import_file(str(FIXTURES / "fsdp.yaml"), pm)
    text = "\n".join(report.lines())
    assert "install the torchbay strategy or device plugin for it" in text
    assert "NOT IMPORTED fsdp_config.fsdp_version = 2: fsdp_config: no installed plugin maps it" in text
    tree, report = accelerate_import.convert({"distributed_type": "NO", "fsdp_config": {}}, pm)
    assert tree == {} and "ignored      fsdp_config = {} (no effect: empty)" in report.lines()
    _, report = accelerate_import.convert({"distributed_type": "NOT_A_TYPE"}, pm)
    assert "unknown distributed_type 'NOT_A_TYPE'" in report.lines()[-1]


def test_every_installed_plugins_fragment_merges_without_conflict():
    pm = get_plugin_manager()
    table = accelerate_import.mapping_table(pm)
    from torchbay.compat import names as compat_names

    api = compat_names._table()
    assert not pm.failed_plugins(), [info.message for info in pm.failed_plugins()]
    if "fsdp" in pm.infos:
        assert table["sections"]["fsdp_config"]["target"] == "fsdp"
    if "cuda" in pm.infos:
        assert table["distributed_type"]["MULTI_GPU"] == {"device": "cuda", "strategy": "ddp"}
        assert api["available_devices"]["cuda"] == "cuda"


def test_every_fragment_ships_in_its_distribution():
    """Each plugin's accelerate.yaml is package data of its setup.cfg (else a wheel would lack it)."""
    fragments = glob.glob(str(ROOT / "plugins" / "**" / "torchbay_*" / "accelerate.yaml"), recursive=True)
    assert fragments
    for fragment in fragments:
        package = Path(fragment).parent
        setup = configparser.ConfigParser()
        setup.read(package.parent / "setup.cfg")
        data = setup["options.package_data"].get(package.name, "") if setup.has_section(
            "options.package_data") else ""
        assert "accelerate.yaml" in data.split(), f"{package.parent / 'setup.cfg'}: package_data lacks accelerate.yaml"


def test_fragments_are_read_only_when_needed():
    code = ("import torchbay; from torchbay import Accelerator; from torchbay.utils import set_seed; "
            "acc = Accelerator(); acc.distributed_type; "
            "from torchbay.compat.config_import import read_fragment; a = read_fragment.cache_info().currsize; "
            "torchbay.utils.is_cuda_available(); from torchbay.registry.manager import get_plugin_manager; "
            "plugins = get_plugin_manager().hook.torchbay_accelerate_mapping.get_hookimpls(); "
            "print(a, read_fragment.cache_info().currsize > 0 or not plugins)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "True"], proc.stdout


def test_the_import_maps_back_each_devices_distributed_type():
    """A ddp run on a device reports a DistributedType member (the device class says which); importing
    an Accelerate config of that member selects that device again (its plugin's accelerate.yaml)."""
    from torchbay.process.state import DistributedType

    pm = get_plugin_manager()
    table = accelerate_import.mapping_table(pm)
    checked = []
    for name, cls in pm.registries()["devices"].items():
        member = getattr(cls, "accelerate_distributed_type", None) or f"MULTI_{name.upper()}"
        if member not in DistributedType.__members__:
            continue  # e.g. mps: Accelerate runs it with one process only
        assert table["distributed_type"].get(member) == {"device": name, "strategy": "ddp"}, (name, member)
        checked.append(name)
    assert "cpu" in checked


def _plugin_package(root: Path, name: str, fragment: str) -> None:
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "plugin.py").write_text("from torchbay.plugin import hookimpl\n\n\n@hookimpl\n"
                                       "def torchbay_report_env():\n    return {}\n")
    (package / "accelerate.yaml").write_text(fragment)


def test_a_plugins_accelerate_yaml_is_read_without_a_hook(tmp_path, monkeypatch, caplog):
    """Issue 37: the manager reads the accelerate.yaml in a plugin's package (the 13 identical hooks went);
    a malformed file disables that plugin with a warning naming the file."""
    import importlib

    _plugin_package(tmp_path, "torchbay_yamlonly", "api:\n  unsupported:\n    - status: refused\n"
                    "      advice: torchbay-yamlonly does it in prepare()\n      names: [prepare_yamlonly_model]\n")
    _plugin_package(tmp_path, "torchbay_badyaml", "- not a mapping\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = PluginManager(autoload=False)
    pm.register_plugin(importlib.import_module("torchbay_yamlonly.plugin"), "yamlonly")
    pm.register_plugin(importlib.import_module("torchbay_badyaml.plugin"), "badyaml")
    reset_plugin_manager(pm)
    try:
        with pytest.raises(UnsupportedAPIError, match="torchbay-yamlonly does it in prepare"):
            torchbay.utils.prepare_yamlonly_model
        assert pm.is_failed("badyaml") and not pm.is_failed("yamlonly")
        assert "torchbay_badyaml/accelerate.yaml" in pm.info_of("badyaml").message
    finally:
        reset_plugin_manager(None)


def test_no_in_tree_plugin_repeats_the_fragment_hook():
    repeated = [path for path in glob.glob(str(ROOT / "plugins" / "**" / "torchbay_*" / "*.py"), recursive=True)
                if "def torchbay_accelerate_mapping" in Path(path).read_text()]
    assert repeated == []
