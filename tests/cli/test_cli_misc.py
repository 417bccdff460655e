"""``torchbay env``, ``plugins``, ``test``, ``estimate-memory``; the first-failure ordering."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from torchbay.cli.main import main
from torchbay.registry.api_version import API_VERSION
from torchbay.registry.manager import PluginManager, hookimpl, reset_plugin_manager

HERE = Path(__file__).parent


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


class ReportingPlugin:
    @hookimpl
    def torchbay_report_env(self):
        return {"fakelib": "9.9.9", "fake device": "not available: no fake card in this machine"}


def with_plugin(plugin, name="reporting"):
    pm = PluginManager()
    pm.register_plugin(plugin, name)
    reset_plugin_manager(pm)
    return pm


def test_env_block(capsys, tmp_path, monkeypatch):
    with_plugin(ReportingPlugin())
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mixed_precision: bf16\n")
    monkeypatch.setenv("TORCHBAY_SEED", "3")
    code, out, _ = run(capsys, "env", "--config-file", str(cfg))
    assert code == 0
    assert out.startswith("```\ntorchbay env") and out.rstrip().endswith("```")
    for needle in ("python:", "torch: " + torch.__version__, "torchbay:", "pydantic:", "built in (torchbay",
                   "reporting: fakelib: 9.9.9", "cpu: 1 found,", "GiB", "cluster: single",
                   'mixed_precision: "bf16"  # file', "seed: 3  # env"):
        assert needle in out, needle
    code, out, _ = run(capsys, "env", "--format", "json")
    report = json.loads(out)
    assert {d["name"] for d in report["devices"]} >= {"cpu"}


def test_env_names_unavailable_devices(capsys):
    from torchbay.axes.device import DeviceBackend

    class Missing(DeviceBackend):
        name = "clitestdev"
        runtime_module = "clitest_runtime_that_is_not_installed"
        install_hint = "pip install clitest-runtime"

    class Plugin:
        @hookimpl
        def torchbay_register_devices(self):
            return [Missing]

    with_plugin(Plugin(), "clitestdev")
    code, out, _ = run(capsys, "env")
    assert "clitestdev: not available: runtime 'clitest_runtime_that_is_not_installed' is not installed: " \
           "pip install clitest-runtime" in out


def test_plugins_table_and_requirements(capsys):
    with_plugin(ReportingPlugin())
    code, out, _ = run(capsys, "plugins")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["NAME", "DISTRIBUTION", "VERSION", "API", "STATUS", "HOOKS", "REGISTERS"]
    cpu = next(r for r in rows if r.startswith("cpu "))
    assert "builtin" in cpu and "register_devices" in cpu and "device:cpu" in cpu
    assert cpu.split()[3] == ".".join(map(str, API_VERSION))  # the plugin API a built-in speaks: this torchbay's
    assert any(r.startswith("reporting ") and "report_env" in r for r in rows)
    code, out, _ = run(capsys, "plugins", "--requirements")
    assert out.splitlines()[0].startswith("torchbay==")
    assert all("==" in line for line in out.splitlines())
    code, out, _ = run(capsys, "plugins", "--format", "json")
    assert any(r["name"] == "strategies" and "strategy:ddp" in r["registers"] for r in json.loads(out))


def test_plugins_lists_a_broken_plugin(capsys):
    pm = PluginManager()
    from torchbay.registry.info import PluginInfo

    pm.infos["brokenplug"] = PluginInfo("brokenplug", "torchbay-brokenplug", "0.1", "failed",
                                        "ImportError: no module named brokenlib")
    reset_plugin_manager(pm)
    code, out, _ = run(capsys, "plugins")
    assert "brokenplug" in out and "failed" in out and "error: ImportError: no module named brokenlib" in out


def tiny_model():
    return torch.nn.Sequential(torch.nn.Linear(100, 200), torch.nn.Linear(200, 10))


def test_estimate_memory_from_import_path(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    code, out, err = run(capsys, "estimate-memory", "test_cli_misc:tiny_model", "--num-processes", "4",
                         "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    n = 100 * 200 + 200 + 200 * 10 + 10
    assert data["counts"] == {"parameters": n, "trainable": n} and data["world_size"] == 4
    rows = {(r["strategy"], r["precision"]): r for r in data["rows"]}
    assert {p for s, p in rows if s == "ddp"} >= {"no", "fp16", "bf16"}
    # each strategy's own estimate: ddp replicates, fsdp shards by 4, deepspeed (ZeRO-2 by default) is there
    assert rows["ddp", "no"]["parameters"] == n * 4 and rows["ddp", "no"]["optimizer"] == n * 8
    assert rows["fsdp", "no"]["parameters"] == -(-n // 4) * 4 and rows["fsdp", "no"]["sharding_factor"] == 4
    assert rows["deepspeed", "bf16"]["note"] == "ZeRO-2" and rows["deepspeed", "bf16"]["gradients"] == n * 2 // 4
    # a combination the strategy refuses to run is shown as refused, not as an estimate
    assert rows["deepspeed", "fp8"]["estimate"] is None and "parameters" not in rows["deepspeed", "fp8"]
    assert rows["deepspeed", "fp8"]["note"].startswith("refused: mixed_precision fp8 does not run under strategy "
                                                       "deepspeed")
    code, out, _ = run(capsys, "estimate-memory", "test_cli_misc:tiny_model", "--num-processes", "4")
    assert "PARAMETERS" in out and "deepspeed (ZeRO-2)" in out and "fsdp" in out
    lines = out.split("optimizer assumes")[0].splitlines()  # the table
    refused = next(line for line in lines if line.startswith("deepspeed ") and " fp8 " in line)
    assert "refused: mixed_precision fp8" in refused and "MiB" not in refused
    # every row's precision starts in the header's PRECISION column
    column = lines[1].index("PRECISION")
    precisions = ("no", "fp16", "bf16", "fp8", "fp4", "-")
    assert all(line[column:].split()[0] in precisions for line in lines[2:] if "MiB" in line)
    assert refused[column:].startswith("fp8")


def test_estimate_memory_from_safetensors(capsys, tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(10, 20), "b": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    code, out, _ = run(capsys, "estimate-memory", str(tmp_path / "model.safetensors"), "--format", "json")
    assert code == 0 and json.loads(out)["counts"]["parameters"] == 205
    code, out, _ = run(capsys, "estimate-memory", str(tmp_path), "--format", "json")  # a folder of shards
    assert json.loads(out)["counts"]["parameters"] == 205


@pytest.mark.parametrize("model, expected", [
    ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
    ("json:no_such_factory", "has no attribute 'no_such_factory'"),
    ("json:__doc__", "neither an nn.Module nor a callable"),
    ("not-a-path", "neither an existing safetensors file nor a Python path"),
])
def test_estimate_memory_bad_model(capsys, model, expected):
    code, _, err = run(capsys, "estimate-memory", model)
    assert code == 2 and expected in err and "Traceback" not in err


def test_estimate_memory_bad_safetensors(capsys, tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"garbage")
    code, _, err = run(capsys, "estimate-memory", str(bad))
    assert code == 2 and "is not a safetensors file" in err


def test_torchbay_test_runs_every_check_in_two_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, "-m", "torchbay.cli.main", "test", "--num-processes", "2"],
                            capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    for check in ("process group", "collectives", "data sharding", "one optimizer step", "save/load round trip"):
        assert f"PASS  {check}" in result.stdout, result.stdout
    assert "2 process(es), device cpu, strategy ddp" in result.stdout
    assert not list(tmp_path.glob(".torchbay_test_*")), "the test removes its checkpoint"


# --- which rank failed first ----------------------------------------------------------------


def failure(rank, exitcode, *, time_ns=0, consequence=False, timestamp=100, leaving_with=1):
    extra = {"py_callstack": f"Traceback (most recent call last):\n  File \"train.py\", line 1\nError{rank}\n",
             "timestamp": str(timestamp)}
    if time_ns:
        extra.update(torchbay_time_ns=str(time_ns), torchbay_consequence="1" if consequence else "0",
                     torchbay_exit_code=str(leaving_with))
    data = {"message": {"message": f"Error{rank}: x", "extraInfo": extra}} if time_ns else {}
    import signal as sig

    return SimpleNamespace(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file_data=data,
                           timestamp=timestamp, signal_name=lambda: sig.Signals(-exitcode).name if exitcode < 0 else "")


def test_first_failure_is_the_root_cause_not_the_broken_collective():
    from torchbay.launch.failures import describe_failures

    plan = SimpleNamespace(num_machines=1, machine_rank=0)
    # rank 0's collective error is recorded *before* rank 2's own error in the same second is
    # impossible causally, but clocks of a whole second are ties: the consequence flag decides
    failures = {0: failure(0, 1, time_ns=5_000, consequence=True), 2: failure(2, 1, time_ns=6_000),
                1: failure(1, -15)}
    report, code = describe_failures(failures, plan)
    assert report.startswith("torchbay launch: rank 2 failed first (exit code 1: Error2: x")
    assert "Error2" in report.splitlines()[3] and code == 1
    assert "rank 0 (exit code 1: Error0: x, a consequence of the first failure)" in report
    assert "rank 1 (killed by signal SIGTERM, stopped by the launcher)" in report
    # a rank killed without a record comes before the ranks that died of it afterwards
    report, code = describe_failures({0: failure(0, 1, time_ns=5_000, consequence=True), 3: failure(3, -9)}, plan)
    assert report.startswith("torchbay launch: rank 3 failed first (killed by signal SIGKILL") and code == 137


def test_a_failed_rank_stopped_while_leaving_keeps_its_own_exit_code():
    """Seen in CI: rank 1 raised, its peers died of the broken collective and left faster, and
    the launcher stopped rank 1 with SIGTERM while it was still leaving. Its own error and exit
    code are the job's, not the launcher's signal."""
    from torchbay.launch.failures import describe_failures

    plan = SimpleNamespace(num_machines=1, machine_rank=0)
    failures = {0: failure(0, 1, time_ns=7_000, consequence=True), 2: failure(2, 1, time_ns=7_500, consequence=True),
                1: failure(1, -15, time_ns=5_000, leaving_with=3)}
    report, code = describe_failures(failures, plan)
    assert report.startswith("torchbay launch: rank 1 failed first (exit code 3: Error1: x"), report
    assert code == 3
    assert report.endswith("every process of the job was stopped; exit code 3")
    # a rank stopped before it recorded a failure of its own is still reported as stopped
    report, code = describe_failures({0: failure(0, 1, time_ns=5_000), 1: failure(1, -15)}, plan)
    assert "rank 1 (killed by signal SIGTERM, stopped by the launcher)" in report and code == 1
