"""The precision registry: keyed by (mode, engine), filled by plugins, with no mode or engine
known to the core beyond the built-in ``no``, ``fp16`` and ``bf16``.

A stand-in plugin registers a mode ``int4`` served by two engines (``fast``, which cannot run
here, and ``slow``) with its own ``int4`` section, and a plain mode ``half8``: everything the
FP8 plugins rely on (``<mode>.backend``, ``auto``, the errors naming what to install, the
``--<section>-<key>`` flags) works for them too.
"""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from torchbay import Accelerator
from torchbay.axes.precision import Precision, by_mode, engine_setting, mode_install_hint, registry_key
from torchbay.errors import ConfigError, IncompatibleSetupError
from torchbay.registry.manager import PluginManager, hookimpl, reset_plugin_manager
from torchbay.registry.resolve import resolve_config


class Int4Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: str = Field("auto", description="int4 engine, or auto")
    layers: list[str] = Field(default_factory=list, description="layers to convert (100% of them by default)")
    strict: bool = False


class Int4Slow(Precision):
    name = "int4"
    engine = "slow"
    priority = 1

    def convert_module(self, module):
        module.int4_engine = self.engine
        return module


class Int4Fast(Int4Slow):
    engine = "fast"
    priority = 2

    @classmethod
    def unavailable_reason(cls, device_backend_cls, config=None):
        return f"no int4 tensor cores on device '{device_backend_cls.name}'"


class Half8(Precision):
    name = "half8"


class StandIn:
    @hookimpl
    def torchbay_register_precisions(self):
        return [Int4Slow, Int4Fast, Half8]

    @hookimpl
    def torchbay_config_sections(self):
        return {"int4": Int4Section}

    @hookimpl
    def torchbay_add_cli_options(self, parser, command):
        from torchbay.cli.options import add_section_options

        add_section_options(parser.add_argument_group("int4"), "int4", Int4Section)


@pytest.fixture
def pm():
    pm = PluginManager(autoload=False)  # built-ins only (no FP8 plugin), plus the stand-in
    pm.register_plugin(StandIn(), "int4-stand-in")
    reset_plugin_manager(pm)
    return pm


def test_the_registry_is_keyed_by_mode_and_engine(pm):
    registry = pm.registries()["precisions"]
    assert {"no", "bf16", "fp16", "int4:slow", "int4:fast", "half8"} <= set(registry)
    assert registry_key(Int4Fast) == "int4:fast" and registry_key(Half8) == "half8"
    modes = by_mode(registry)
    assert modes["int4"] == {"slow": Int4Slow, "fast": Int4Fast}
    assert modes["half8"] == {None: Half8} and modes["no"] == {None: Precision}
    assert "fp8" not in modes  # the core registers no FP8 of its own
    assert {"precision:int4:slow", "precision:int4:fast", "precision:half8"} <= set(pm.infos["int4-stand-in"].registers)


def test_a_plain_mode_of_a_plugin_is_selected_by_its_name(pm):
    acc = Accelerator(mixed_precision="half8")
    assert type(acc.precision) is Half8 and acc.precision.engine is None and acc.fp8_backend is None


def test_auto_picks_the_available_engine_of_highest_priority_and_says_why(pm, caplog):
    caplog.set_level(logging.INFO)
    acc = Accelerator(mixed_precision="int4")
    assert type(acc.precision) is Int4Slow
    chose = [r.getMessage() for r in caplog.records if "auto chose" in r.getMessage()]
    assert chose and chose[0].startswith("int4.backend auto chose 'slow'")
    assert "fast: no int4 tensor cores on device 'cpu'" in chose[0]
    assert acc.prepare(torch.nn.Linear(4, 4)).int4_engine == "slow"


def test_the_mode_section_backend_picks_an_engine_and_every_misuse_is_named(pm):
    assert type(Accelerator(mixed_precision="int4", config={"int4": {"backend": "slow"}}).precision) is Int4Slow
    with pytest.raises(IncompatibleSetupError, match="int4 backend 'fast' cannot run here: no int4 tensor cores"):
        Accelerator(mixed_precision="int4", config={"int4": {"backend": "fast"}})
    with pytest.raises(IncompatibleSetupError) as err:
        Accelerator(mixed_precision="int4", config={"int4": {"backend": "nosuch"}})
    assert ("int4 backend 'nosuch' is not installed (installed engines: fast, slow): no plugin torchbay publishes "
            "provides int4 engine 'nosuch'" in str(err.value))
    with pytest.raises(IncompatibleSetupError, match="int4.backend 'nosuch' is not an installed INT4 engine"):
        Accelerator(mixed_precision="bf16", config={"int4": {"backend": "nosuch"}})


def test_settings_of_a_mode_not_in_use_are_a_warning(pm, caplog):
    Accelerator(mixed_precision="no", config={"int4": {"backend": "slow", "strict": True}})
    assert "int4.backend, int4.strict set but mixed_precision is 'no'" in caplog.text


def test_a_mode_no_plugin_registers_names_what_to_install(pm):
    with pytest.raises(ConfigError) as err:
        resolve_config(environ={}, args={"mixed_precision": "int8"})
    message = str(err.value)
    assert "'mixed_precision' = 'int8' (set in Accelerator(...) arguments)" in message
    assert "registered: no, bf16, fp16, int4, half8" in message and "pip install" not in message
    assert "torchbay-fp8-<engine>" in mode_install_hint("fp8")  # the data table, with no engine named in the core
    with pytest.raises(ConfigError, match="torchbay-fp8-<engine>"):
        resolve_config(environ={}, args={"mixed_precision": "fp8"})


def test_engine_setting_reads_the_section_named_like_the_mode():
    from types import SimpleNamespace

    assert engine_setting(SimpleNamespace(int4=SimpleNamespace(backend="slow")), "int4") == "slow"
    assert engine_setting(SimpleNamespace(), "int4") == "auto"  # no section: auto


def test_a_plugin_section_gets_flags_like_the_core_s(pm):
    from torchbay.cli.options import add_config_options, cli_values

    parser = argparse.ArgumentParser()
    add_config_options(parser, "launch", pm)
    args = parser.parse_args(["--int4-backend", "slow", "--int4-layers", "a,b", "--int4-layers", "c",
                              "--int4-strict", "--mixed-precision", "int4"])
    values = cli_values(args)
    assert values == {"int4.backend": "slow", "int4.layers": ["a", "b", "c"], "int4.strict": "true",
                      "mixed_precision": "int4"}
    resolved = resolve_config(environ={}, cli=values, pm=pm)
    assert resolved.config.int4.layers == ["a", "b", "c"] and resolved.config.int4.strict is True
    assert resolved.source_of("int4.backend") == "cli"
    assert "100%% of them" not in parser.format_help() and "100% of them" in parser.format_help()
