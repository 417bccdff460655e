"""The device conformance kit: the cpu device passes it, broken devices fail it precisely.

Broken devices are in-process plugins (subclasses of the cpu device with one thing wrong),
registered on a plugin manager of their own; the kit's in-process checks see them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from torchbay.builtin.cpu import CPUBackend
from torchbay.registry.manager import PluginManager, hookimpl
from torchbay.testing.conformance import CHECKS, run_check, run_conformance

try:
    from torchbay_cuda.plugin import CUDABackend
except ImportError:  # pragma: no cover - torchbay-cuda not installed
    CUDABackend = None


class NoOpRestoreBackend(CPUBackend):
    """RNG restore that does nothing (the bug huggingface/accelerate#3937 had for HPU)."""

    name = "broken_rng"

    def set_rng_state(self, states):
        pass


class IgnoredSeedBackend(CPUBackend):
    name = "broken_seed"

    def manual_seed(self, seed):
        torch.manual_seed(0)


class WrongMemoryBackend(CPUBackend):
    name = "broken_memory"

    def memory_stats(self):
        stats = super().memory_stats()
        del stats["free"]
        return stats


class FakeAutocastBackend(CPUBackend):
    """Declares bf16 autocast but its autocast() does nothing."""

    name = "broken_autocast"

    def autocast(self, dtype, enabled=True, cache_enabled=None):
        return torch.autocast("cpu", enabled=False)


class DeviceRNGStatesBackend(CPUBackend):
    """Returns its RNG state as a non-list (save_state could not write it per device)."""

    name = "broken_state_type"

    def get_rng_state(self):
        return torch.get_rng_state()


class ConsumingSaveBackend(CPUBackend):
    """Reading the RNG state draws a number: saving a checkpoint changes the run."""

    name = "broken_save"

    def get_rng_state(self):
        torch.rand(1)
        return [torch.get_rng_state()]


class BrokenPlugin:
    @hookimpl
    def torchbay_register_devices(self):
        return [NoOpRestoreBackend, IgnoredSeedBackend, WrongMemoryBackend, FakeAutocastBackend,
                DeviceRNGStatesBackend, ConsumingSaveBackend]


@pytest.fixture(scope="module")
def broken_pm():
    pm = PluginManager()
    pm.register_plugin(BrokenPlugin(), "broken-devices")
    return pm


@pytest.mark.multiprocess
def test_cpu_device_passes_the_whole_kit():
    report = run_conformance("cpu")
    assert report.ok, str(report)
    assert [r.name for r in report.results] == list(CHECKS)
    statuses = {r.name: r.status for r in report.results}
    assert statuses == {name: "passed" for name in CHECKS}, str(report)
    assert "bf16" in report["train_resume"].message  # the resume cycle ran with autocast too
    assert "torchbay launch" in report["collectives"].message


def test_noop_rng_restore_fails_with_a_precise_message(broken_pm):
    report = run_conformance("broken_rng", checks=["detection", "rng_round_trip"], pm=broken_pm)
    assert report["detection"].passed
    rng = report["rng_round_trip"]
    assert rng.status == "failed"
    assert "NoOpRestoreBackend.set_rng_state does not restore the generator state that get_rng_state returned" \
        in rng.message
    assert "load_state would resume with a different random stream" in rng.message
    assert not report.ok
    with pytest.raises(AssertionError, match="FAILED"):
        report.raise_for_failures()


def test_rng_state_read_that_moves_the_stream_fails_the_resume_cycle(broken_pm):
    assert run_check("rng_round_trip", "broken_save", pm=broken_pm).passed  # the round trip alone cannot see it
    result = run_check("train_resume", "broken_save", pm=broken_pm)
    assert result.status == "failed"
    assert "resume (no): save_state changed the device random stream" in result.message
    assert "get_rng_state() must not consume random numbers" in result.message


def test_ignored_seed_fails(broken_pm):
    result = run_check("seeding", "broken_seed", pm=broken_pm)
    assert result.status == "failed"
    assert "manual_seed(7) and manual_seed(8) gave the same draws: the seed is ignored" in result.message


def test_missing_memory_key_fails(broken_pm):
    result = run_check("memory", "broken_memory", pm=broken_pm)
    assert result.status == "failed"
    assert "memory_stats() lacks the keys ['free']" in result.message


def test_declared_but_inactive_autocast_fails(broken_pm):
    result = run_check("autocast", "broken_autocast", pm=broken_pm)
    assert result.status == "failed"
    assert "autocast(torch.bfloat16) on cpu: nn.Linear produced torch.float32, not torch.bfloat16" in result.message


def test_rng_state_must_be_a_list_of_cpu_tensors(broken_pm):
    result = run_check("rng_round_trip", "broken_state_type", pm=broken_pm)
    assert result.status == "failed"
    assert "get_rng_state() must return a non-empty list of tensors, got Tensor" in result.message


def test_unregistered_device_fails_detection():
    result = run_check("detection", "nosuchdevice")
    assert result.status == "failed"
    assert "device 'nosuchdevice' is not registered (registered: " in result.message


def test_unavailable_device_skips_every_check_with_its_reason():
    report = run_conformance("npu", checks=[c for c in CHECKS if c != "plugin_import"])
    assert report.ok
    for result in report.results:
        assert result.status == "skipped", str(report)
        assert "device 'npu' is not available here: runtime 'torch_npu' is not installed" in result.message


def test_plugin_import_check_catches_a_runtime_imported_at_module_level(tmp_path, broken_pm):
    (tmp_path / "eager_vendor_runtime.py").write_text("IMPORTED = True\n")
    (tmp_path / "eager_plugin.py").write_text(textwrap.dedent("""
        import eager_vendor_runtime  # the mistake: a module-level runtime import
        from torchbay.builtin.cpu import CPUBackend
        from torchbay.registry.manager import hookimpl

        class EagerBackend(CPUBackend):
            name = "eager"
            runtime_module = "eager_vendor_runtime"

        @hookimpl
        def torchbay_register_devices():
            return [EagerBackend]
    """))
    sys.path.insert(0, str(tmp_path))
    try:
        import eager_plugin

        pm = PluginManager()
        pm.register_plugin(eager_plugin, "eager")
        result = run_check("plugin_import", "eager", pm=pm, env={"PYTHONPATH": str(tmp_path)})
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("eager_plugin", None)
        sys.modules.pop("eager_vendor_runtime", None)
    assert result.status == "failed"
    assert "importing the plugin module eager_plugin imported the runtime 'eager_vendor_runtime'" in result.message


def test_the_pytest_face_skips_fails_and_names_the_check(tmp_path):
    (tmp_path / "test_kit_broken.py").write_text(textwrap.dedent("""
        import pytest
        from torchbay.testing.conformance import *  # noqa: F403 (the kit's tests)
        from torchbay.registry.manager import PluginManager
        from test_conformance import BrokenPlugin

        CONFORMANCE_DEVICE = "broken_rng"

        @pytest.fixture(scope="module")
        def conformance_plugin_manager():
            pm = PluginManager()
            pm.register_plugin(BrokenPlugin(), "broken-devices")
            return pm
    """))
    (tmp_path / "test_kit_unavailable.py").write_text(
        "from torchbay.testing.conformance import *  # noqa: F403\nCONFORMANCE_DEVICE = 'npu'\n")
    tests_dir = str(__import__("pathlib").Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path),
                           "-k", "detection or rng_round_trip or seeding"],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**__import__("os").environ, "PYTHONPATH": tests_dir})
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "1 failed, 2 passed, 3 skipped" in out, out
    assert "device 'broken_rng' fails conformance check 'rng_round_trip'" in out
    assert "device 'npu' is not available here" in out


@pytest.mark.skipif(CUDABackend is None or not CUDABackend.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("check", list(CHECKS))
def test_cuda_device_passes_the_kit(check):
    result = run_check(check, "cuda")
    assert result.status != "failed", str(result)
    if check in ("detection", "rng_round_trip", "seeding", "memory", "autocast", "train_resume"):
        assert result.status == "passed", str(result)
