"""Plugin API 1.1's ``LazyClass``: a class registered by its import path is imported only when a run selects it
(or something reads more of it than its name); one that cannot be imported, or registers under a name that is not
its own, disables its plugin with a message that names the plugin and the class path."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import pytest

from torchbay.cli.plugins_cmd import rows
from torchbay.errors import IncompatibleSetupError
from torchbay.plugin import LazyClass, hookimpl
from torchbay.registry.manager import PluginManager
from torchbay.registry.resolve import resolve_config
from torchbay.registry.selection import build_context

MODULE = "torchbay_lazy_fixture_strategies"


@pytest.fixture
def strategies_module(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent("""
        from torchbay.builtin.strategies import SingleStrategy

        class LazyStrategy(SingleStrategy):
            name = "lazystrat"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield MODULE
    sys.modules.pop(MODULE, None)


def plugin_registering(*entries: LazyClass) -> types.SimpleNamespace:
    @hookimpl
    def torchbay_register_strategies():
        return list(entries)

    return types.SimpleNamespace(TORCHBAY_PLUGIN_API=(1, 1), torchbay_register_strategies=torchbay_register_strategies)


def manager_with(name: str, plugin) -> PluginManager:
    pm = PluginManager(autoload=False, only=())
    pm.register_plugin(plugin, name)
    return pm


def context_for(pm: PluginManager, strategy: str):
    return build_context(resolve_config(environ={}, args={"strategy": strategy}, pm=pm), pm)


def test_a_lazily_registered_class_is_imported_only_when_selected(strategies_module):
    pm = manager_with("lazyplug", plugin_registering(LazyClass(f"{MODULE}:LazyStrategy", name="lazystrat")))
    entry = pm.registries()["strategies"]["lazystrat"]
    assert isinstance(entry, LazyClass) and MODULE not in sys.modules
    context_for(pm, "single")  # a run that selects another strategy leaves it unimported
    assert MODULE not in sys.modules
    context = context_for(pm, "lazystrat")
    assert context.strategy_cls is sys.modules[MODULE].LazyStrategy  # the class itself, not the stand-in
    assert context.strategy_cls._torchbay_plugin == "lazyplug" and pm.infos["lazyplug"].status == "loaded"


def test_a_class_that_cannot_be_imported_disables_its_plugin_once_selected():
    pm = manager_with("lazybroken", plugin_registering(LazyClass("torchbay_no_such_module:Nothing",
                                                                 name="brokenstrat")))
    context_for(pm, "single")  # never selected: never imported, nothing to report
    assert pm.infos["lazybroken"].status == "loaded"
    with pytest.raises(IncompatibleSetupError) as failed:
        context_for(pm, "brokenstrat")
    message = str(failed.value)
    assert "plugin 'lazybroken'" in message and "torchbay_no_such_module:Nothing" in message
    assert "No module named 'torchbay_no_such_module'" in message
    assert pm.infos["lazybroken"].status == "failed"


def test_a_class_registered_under_another_name_is_refused(strategies_module):
    pm = manager_with("lazymisnamed", plugin_registering(LazyClass(f"{MODULE}:LazyStrategy", name="othername")))
    with pytest.raises(IncompatibleSetupError, match=r"plugin 'lazymisnamed'.*registered .*LazyStrategy as "
                                                     r"name='othername'.*declares name='lazystrat'"):
        context_for(pm, "othername")


def test_torchbay_plugins_imports_every_lazy_class_to_list_a_broken_one():
    pm = manager_with("lazybroken", plugin_registering(LazyClass("torchbay_no_such_module:Nothing",
                                                                 name="brokenstrat")))
    row = next(r for r in rows(pm) if r["name"] == "lazybroken")
    assert row["status"] == "failed" and "torchbay_no_such_module" in row["error"]


def test_a_malformed_class_path_is_refused_at_once():
    with pytest.raises(ValueError, match="'package.module:ClassName'"):
        LazyClass("mypackage.strategy.MyStrategy", name="mystrategy")


def test_a_default_run_imports_no_lazily_registered_class_of_the_installed_plugins():
    script = textwrap.dedent("""
        import json, sys
        from torchbay import Accelerator
        from torchbay.plugin import LazyClass
        from torchbay.registry.manager import get_plugin_manager

        Accelerator()
        lazy = [entry.target.partition(":")[0] for registry in get_plugin_manager().registries().values()
                for entry in registry.values() if isinstance(entry, LazyClass)]
        print(json.dumps({"lazy": lazy, "imported": [m for m in lazy if m in sys.modules]}))
    """)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    if not found["lazy"]:
        pytest.skip("no installed plugin registers a class lazily (install torchbay-fsdp or a tracker plugin)")
    assert found["imported"] == []
