"""A faulty third-party plugin, really installed, fails where ``FAULTY_MODE`` says: the real
``torchbay`` command, in a subprocess, disables it with one warning naming the plugin, its
distribution, the hook and the error, and keeps working; a run that selected something of
the plugin stops with that same message."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = str(TESTS / "scripts" / "cli_ranks.py")
WARNING = "plugin 'faulty' (distribution torchbay-faulty 0.0.7) failed"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    src = tmp_path_factory.mktemp("src") / "faulty_plugin"
    shutil.copytree(TESTS / "fixtures" / "faulty_plugin", src)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, capture_output=True)
    return str(target)


def cli(site, mode, *args, only=True, code=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    env.update(PYTHONPATH=site, FAULTY_MODE=mode)
    if only:  # the faulty plugin alone (the built-ins always load): quicker, and the warning is its own
        env.update(TORCHBAY_DISABLE_PLUGIN_AUTOLOAD="1", TORCHBAY_PLUGINS="faulty")
    argv = [sys.executable, "-m", "torchbay.cli.main", *args] if code is None else [sys.executable, "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=str(TESTS))


# mode: (where it failed, the error)
FAULTS = {
    "import-exit": ("while loading", "SystemExit('faulty: cannot find my license file')"),
    "import-error": ("while loading", "ImportError: faulty needs libfaulty.so"),
    "cli-options": ("in torchbay_add_cli_options", "RuntimeError: faulty broke in cli-options"),
    "commands": ("in torchbay_add_commands", "RuntimeError: faulty broke in commands"),
    "config-sections": ("in torchbay_config_sections", "RuntimeError: faulty broke in config-sections"),
    "registry": ("in torchbay_register_devices", "RuntimeError: faulty broke in registry"),
    "device-cpu": ("in torchbay_register_devices",
                   "it registers device 'cpu', which the built-in plugin 'cpu' already provides"),
    "strategy-ddp": ("in torchbay_register_strategies",
                     "it registers strategy 'ddp', which the built-in plugin 'strategies' already provides"),
    "section-core": ("in torchbay_config_sections", "its config section 'seed' clashes with the core key 'seed'"),
    "section-type": ("in torchbay_config_sections",
                     "returned {'faulty': <class 'dict'>}, not a mapping of section name to pydantic model"),
}


def one_warning(stderr: str, mode: str) -> str:
    where, error = FAULTS[mode]
    lines = [line for line in stderr.splitlines() if WARNING in line]
    assert len(lines) == 1, stderr
    assert f"{WARNING} {where}: {error}" in lines[0], lines[0]
    assert "-p no:faulty" in lines[0] and "pip uninstall torchbay-faulty" in lines[0]
    assert "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("mode", sorted(FAULTS))
def test_plugins_lists_the_failed_plugin(site, mode):
    result = cli(site, mode, "plugins")
    assert result.returncode == 0, result.stderr
    one_warning(result.stderr, mode)
    row = next(line for line in result.stdout.splitlines() if line.startswith("faulty "))
    assert " failed" in row
    assert FAULTS[mode][1] in result.stdout
    assert "cpu " in result.stdout and "device:cpu" in result.stdout  # the built-ins are intact


@pytest.mark.parametrize("mode", ["import-exit", "cli-options", "commands", "config-sections"])
def test_env_help_and_launch_keep_working(site, mode):
    for args in (["env"], ["--help"], ["launch", "--dry-run", "--num-processes", "2", SCRIPT]):
        result = cli(site, mode, *args)
        assert result.returncode == 0, (args, result.stderr)
        one_warning(result.stderr, mode)
        if args == ["--help"]:
            assert "plugins that failed and are disabled for this run: faulty (torchbay-faulty" in result.stdout
        if args == ["env"]:
            assert "faulty (torchbay-faulty 0.0.7): failed" in result.stdout


def test_clashing_names_leave_the_builtins_selectable(site):
    result = cli(site, "device-cpu", "launch", "--dry-run", "--device", "cpu", SCRIPT)
    assert result.returncode == 0 and "device cpu" in result.stdout, result.stderr
    one_warning(result.stderr, "device-cpu")
    result = cli(site, "strategy-ddp", "launch", "--dry-run", "--num-processes", "2", "--strategy", "ddp", SCRIPT)
    assert result.returncode == 0 and "strategy ddp" in result.stdout, result.stderr
    one_warning(result.stderr, "strategy-ddp")


def test_a_run_that_selects_the_failed_plugin_stops_with_its_message(site):
    # the plugin failed in a hook after registering the device the run selects
    result = cli(site, "validate", "launch", "--dry-run", "--device", "faultydev", SCRIPT)
    assert result.returncode == 2, result.stderr
    assert f"{WARNING} in torchbay_validate: RuntimeError: faulty broke in validate" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("torchbay launch: error:")
    assert "Traceback" not in result.stderr
    # not selected: the same failure only disables the plugin
    result = cli(site, "validate", "launch", "--dry-run", SCRIPT)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(WARNING) == 1 and "in torchbay_validate" in result.stderr
    # its registration failed: the device it would have added is named with the failure
    result = cli(site, "registry", "launch", "--dry-run", "--device", "faultydev", SCRIPT)
    assert result.returncode == 2
    assert "device 'faultydev' is not installed" in result.stderr
    assert "faulty (torchbay-faulty: RuntimeError: faulty broke in registry)" in result.stderr


@pytest.mark.parametrize("mode, hook, error",
                         [("validate", "torchbay_validate", "RuntimeError: faulty broke in validate"),
                          ("state-extra", "torchbay_state_extra", "SystemExit(3)")])
def test_a_plugin_failing_in_a_per_run_hook_is_shown_failed_by_plugins_and_env(site, mode, hook, error, tmp_path):
    fix = "block it with -p no:faulty or TORCHBAY_BLOCK_PLUGINS=faulty, or pip uninstall torchbay-faulty"
    result = cli(site, mode, "plugins")
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("faulty "))
    assert " failed " in row and row.split()[-1] == "-", row  # what it registered is dropped
    assert f"    error: in {hook}: {error}\n    fix: {fix}" in result.stdout
    assert result.stderr.count(WARNING) == 1 and "Traceback" not in result.stderr
    table = json.loads(cli(site, mode, "plugins", "--format", "json").stdout)
    assert next(r for r in table if r["name"] == "faulty")["fix"] == fix
    result = cli(site, mode, "env")
    assert result.returncode == 0, result.stderr
    assert f"faulty (torchbay-faulty 0.0.7): failed in {hook}: {error} ({fix})" in result.stdout
    assert "faultydev" not in result.stdout  # its device is not offered
    # a run that does not select it keeps working: two real processes
    result = cli(site, mode, "launch", "--num-processes", "2", SCRIPT, str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(json.loads((tmp_path / f"rank{r}.json").read_text())["sum"] for r in range(2)) == [1.0, 1.0]


def test_a_selected_plugin_failing_during_the_run_stops_it(site):
    # save_state reports it as the failed save (every rank agrees on it), naming the plugin
    code = ("import tempfile\nfrom torchbay import Accelerator, CheckpointError\n"
            "try:\n    Accelerator(device='{}').save_state(tempfile.mkdtemp() + '/ck')\n"
            "except CheckpointError as e:\n    print('STOPPED', e)\nelse:\n    print('RAN')\n")
    result = cli(site, "state-extra", code=code.format("faultydev"))
    assert "STOPPED save_state failed: PluginError: " + WARNING + " in torchbay_state_extra: SystemExit(3); this run " \
        "uses it" in result.stdout, result.stderr
    result = cli(site, "state-extra", code=code.format("cpu"))  # not selected: disabled, the run goes on
    assert "RAN" in result.stdout and WARNING + " in torchbay_state_extra: SystemExit(3)" in result.stderr


def test_every_installed_plugin_with_a_faulty_one(site):
    """Autoload on: every plugin of this environment plus the faulty one; still one warning."""
    result = cli(site, "commands", "plugins", only=False)
    assert result.returncode == 0, result.stderr
    one_warning(result.stderr, "commands")
