"""Plugin machinery: a third-party distribution built and installed here, a broken one,
and pytest-style control over which plugins load."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from torchbay.registry.manager import PluginManager, hookimpl

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(TESTS, "fixtures")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """Build and install the toy and broken plugin distributions into a temporary location."""
    target = tmp_path_factory.mktemp("site")
    for name in ("toy_plugin", "broken_plugin"):
        src = tmp_path_factory.mktemp("src") / name
        shutil.copytree(os.path.join(FIXTURES, name), src)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(src)], check=True, capture_output=True)
    return str(target)


def probe(site, *args, env=None, script="plugin_probe.py"):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    full_env["PYTHONPATH"] = site + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "scripts", script), *args], capture_output=True,
                          text=True, env=full_env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def setup_errors(site, config_file=None, **kwargs):
    """What ``Accelerator(...)`` refuses, run in a process that sees the installed test plugins."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    full_env["PYTHONPATH"] = site
    args = ", ".join([f"config_file={str(config_file)!r}"] * bool(config_file)
                     + [f"{k}={v!r}" for k, v in kwargs.items()])
    code = ("from torchbay import Accelerator, IncompatibleSetupError\n"
            f"try:\n    Accelerator({args})\n"
            "except IncompatibleSetupError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=60)
    return proc.stdout


def test_builtins_register_through_the_same_hooks():
    pm = PluginManager(autoload=False)
    reg = pm.registries()
    assert {"cpu"} <= set(reg["devices"])
    assert {"single", "ddp"} <= set(reg["strategies"])
    assert {"no", "fp16", "bf16"} <= set(reg["precisions"])
    assert {"safetensors", "dcp"} <= set(reg["checkpoint_io"])
    assert {"torchrun", "slurm", "openmpi", "mpich"} <= set(reg["cluster_environments"])
    assert pm.infos["cpu"].status == "builtin"
    assert "torchbay_register_devices" in pm.hooks_of("cpu")


def test_third_party_plugin_end_to_end(site, tmp_path):
    cfg = tmp_path / "toy.yaml"
    cfg.write_text("device: toydev\nstrategy: toystrategy\nmixed_precision: fp8\nfp8:\n  backend: toyfp8\n"
                   "checkpoint:\n  io: toyio\ntoy:\n  level: 3\n")
    out = probe(site, "--train", "--config-file", str(cfg), "--ckpt", str(tmp_path / "ck"), env={"TOY_RANK": "0"})
    toy = out["infos"]["toy"]
    assert toy["status"] == "loaded" and toy["distribution"] == "torchbay-toy" and toy["version"] == "0.3.1"
    assert {"device:toydev", "strategy:toystrategy", "precision:fp8:toyfp8", "checkpoint_io:toyio",
            "cluster_environment:toycluster"} <= set(toy["registers"])
    run = out["run"]
    assert run == {**run, "device": "toydev", "strategy": "toystrategy", "precision": "fp8:toyfp8", "io": "toyio",
                   "cluster": "toycluster", "toy_level": 3}
    events = run["events"]
    for expected in ("set_current:toydev", "prepare:1+1", "toyfp8.convert_module", "load_state_extra:3"):
        assert expected in events
    assert run["steps"] == 3  # ToyPrecision.after_optimizer_step counted 3 steps; state_extra saved and restored them
    assert "torchbay_state_extra" in out["hooks"]["toy"]


def test_plugin_validation_joins_the_core_complaints(site, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("device: nosuch\ntoy:\n  level: 9\n  mode: careful\n")
    out = setup_errors(site, cfg)
    assert "device 'nosuch' is not installed" in out
    assert "toy.level above 5" not in out  # plugin validation runs only once the axes resolve
    cfg.write_text("toy:\n  level: 9\n  mode: careful\n")
    assert "toy.level above 5 is not allowed" in setup_errors(site, cfg)


def test_broken_plugins_are_reported_and_the_core_keeps_working(site):
    out = probe(site)
    broken = out["infos"]["broken"]
    assert broken["status"] == "failed" and broken["distribution"] == "torchbay-broken"
    assert "this_module_does_not_exist" in broken["error"]
    bad = out["infos"]["badregistry"]
    assert bad["status"] == "failed" and "registry exploded" in bad["error"]
    assert "ddp" in out["registries"]["strategies"] and "toystrategy" in out["registries"]["strategies"]


def test_a_failed_plugin_is_named_when_its_name_is_selected(site):
    out = setup_errors(site, strategy="broken")
    assert "strategy 'broken' is not installed" in out
    assert "plugins that failed to load:" in out
    assert "broken (torchbay-broken: ModuleNotFoundError: No module named 'this_module_does_not_exist')" in out


def test_autoload_can_be_disabled_and_plugins_named(site):
    out = probe(site, env={"TORCHBAY_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert out["infos"]["toy"]["status"] == "not autoloaded"
    assert "toydev" not in out["registries"]["devices"]
    out = probe(site, env={"TORCHBAY_DISABLE_PLUGIN_AUTOLOAD": "1", "TORCHBAY_PLUGINS": "toy"})
    assert out["infos"]["toy"]["status"] == "loaded" and out["infos"]["broken"]["status"] == "not autoloaded"
    assert "toydev" in out["registries"]["devices"]


def test_blocking_a_plugin(site):
    out = probe(site, env={"TORCHBAY_BLOCK_PLUGINS": "toy,broken"})
    assert out["infos"]["toy"]["status"] == "blocked" and out["infos"]["broken"]["status"] == "blocked"
    assert "toydev" not in out["registries"]["devices"]


def test_required_plugins(site, tmp_path):
    cfg = tmp_path / "req.yaml"
    cfg.write_text("plugins:\n  required: [toy, torchbay-nosuch, broken]\n")
    out = setup_errors(site, cfg)
    assert "required plugin 'torchbay-nosuch' is not installed: pip install torchbay-nosuch" in out
    assert "required plugin 'broken' is failed" in out
    assert "'toy'" not in out


def test_plugin_commands_and_cli_options_reach_the_cli(site):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    full_env["PYTHONPATH"] = site
    proc = subprocess.run([sys.executable, "-m", "torchbay.cli.main", "toy-hello"], capture_output=True, text=True,
                          env=full_env, timeout=60)
    assert proc.returncode == 0 and "hello from toy" in proc.stdout


def test_dash_p_loads_and_blocks_plugins_like_pytest(site, tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    base["PYTHONPATH"] = site + os.pathsep + str(tmp_path)
    (tmp_path / "my_module_plugin.py").write_text(
        "from torchbay import hookimpl\n\n@hookimpl\ndef torchbay_add_commands(subparsers):\n"
        "    subparsers.add_parser('module-hello').set_defaults(func=lambda a: print('hello from module') or 0)\n")

    def cli(*args, env=None):
        return subprocess.run([sys.executable, "-m", "torchbay.cli.main", *args], capture_output=True, text=True,
                              env={**base, **(env or {})}, timeout=60)

    assert cli("-p", "no:toy", "toy-hello").returncode == 2  # blocked: the command is gone
    off = {"TORCHBAY_DISABLE_PLUGIN_AUTOLOAD": "1"}
    assert cli("toy-hello", env=off).returncode == 2
    assert "hello from toy" in cli("-p", "toy", "toy-hello", env=off).stdout
    assert "hello from module" in cli("-pmy_module_plugin", "module-hello").stdout


# --- isolation of hook implementations (in process) ----------------------------------------------


class _Wrapper:
    def __init__(self, where, exc=RuntimeError):
        self.where, self.exc, self.calls = where, exc, 0

    @hookimpl(wrapper=True)
    def torchbay_validate(self, context):
        self.calls += 1
        if self.where == "before":
            raise self.exc("before")
        result = yield
        if self.where == "after":
            raise self.exc("after")
        return result


class _Plain:
    @hookimpl
    def torchbay_validate(self, context):
        return ["prepared"]


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_failing_wrapper_is_disabled_and_the_call_goes_on(where, caplog):
    pm = PluginManager(autoload=False, builtins=False)
    wrapper = _Wrapper(where, SystemExit)
    pm.register_plugin(_Plain(), "plain")
    pm.register_plugin(wrapper, "wrap")
    assert pm.hook.torchbay_validate(context=None) == [["prepared"]]
    assert pm.infos["wrap"].status == "failed" and pm.infos["wrap"].hook == "torchbay_validate"
    assert pm.infos["plain"].status == "loaded"
    assert pm.hook.torchbay_validate(context=None) == [["prepared"]]
    assert wrapper.calls == 1, "a failed plugin's hooks do nothing afterwards"
    assert sum("plugin 'wrap'" in r.getMessage() for r in caplog.records) == 1


def test_deliberate_errors_and_ctrl_c_are_not_plugin_failures():
    from torchbay.errors import CheckpointError, PluginError

    pm = PluginManager(autoload=False, builtins=False)
    pm.register_plugin(_Wrapper("before", CheckpointError), "wrap")
    with pytest.raises(CheckpointError):
        pm.hook.torchbay_validate(context=None)
    assert pm.infos["wrap"].status == "loaded"
    pm = PluginManager(autoload=False, builtins=False)
    pm.register_plugin(_Wrapper("after", KeyboardInterrupt), "wrap")
    with pytest.raises(KeyboardInterrupt):
        pm.hook.torchbay_validate(context=None)
    # a plugin the run depends on stops the run with its message
    pm = PluginManager(autoload=False, builtins=False)
    pm.register_plugin(_Wrapper("before"), "wrap")
    pm.selected = {"wrap"}
    with pytest.raises(PluginError, match="plugin 'wrap' .* failed in torchbay_validate: RuntimeError: before"):
        pm.hook.torchbay_validate(context=None)


def test_registries_are_collected_builtins_first():
    from torchbay.builtin.cpu import CPUBackend

    class Impostor(CPUBackend):
        name = "cpu"

    class Plugin:
        @hookimpl
        def torchbay_register_devices(self):
            return [Impostor]

    pm = PluginManager(autoload=False)
    pm.register_plugin(Plugin(), "impostor")
    assert pm.registries()["devices"]["cpu"] is CPUBackend
    assert pm.infos["impostor"].status == "failed"
    assert "it registers device 'cpu', which the built-in plugin 'cpu' already provides" in pm.infos["impostor"].message
