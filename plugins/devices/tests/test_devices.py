"""The device plugins under plugins/devices on a CPU-only machine without any vendor runtime.

Each plugin must install and import without its runtime, say why it is not available
(``torchbay env``), refuse selection with the install or hardware hint, and map config to
worker environment and collective backend as documented. The XLA and HPU step deltas are
checked against stand-in runtime modules.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from torchbay import Accelerator, IncompatibleSetupError
from torchbay.registry.manager import PluginManager
from torchbay.registry.resolve import resolve_config

ROOT = Path(__file__).resolve().parents[3]
DEVICES = ("cuda", "xpu", "npu", "mlu", "xla", "mps", "hpu")
RUNTIMES = ("torch_npu", "torch_mlu", "torch_xla", "habana_frameworks", "intel_extension_for_pytorch")
#: what each plugin says when it cannot be used on this machine
REASONS = {
    "cuda": "no CUDA device",
    "xpu": "built without XPU support",
    "npu": "runtime 'torch_npu' is not installed",
    "mlu": "runtime 'torch_mlu' is not installed",
    "xla": "runtime 'torch_xla' is not installed",
    "mps": "built without MPS",
    "hpu": "runtime 'habana_frameworks.torch' is not installed",
}
HINTS = {
    "cuda": "install a CUDA or ROCm build of torch",
    "xpu": "download.pytorch.org/whl/xpu",
    "npu": "pip install torchbay-npu[runtime]",
    "mlu": "torch_mlu",
    "xla": "pip install torchbay-xla[tpu]",
    "mps": "Apple silicon",
    "hpu": "Intel Gaudi software",
}
BACKENDS = {"cuda": "nccl", "npu": "hccl", "mlu": "cncl", "hpu": "hccl", "xla": "xla", "mps": "gloo"}
VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES", "xpu": "ZE_AFFINITY_MASK", "npu": "ASCEND_RT_VISIBLE_DEVICES",
           "mlu": "MLU_VISIBLE_DEVICES", "hpu": "HABANA_VISIBLE_MODULES"}


def plugin(name):
    return importlib.import_module(f"torchbay_{name}.plugin")


def backend(name):
    return next(iter(plugin(name).torchbay_register_devices()))


@pytest.fixture(scope="module")
def pm():
    return PluginManager()


def config_for(pm, device, **sections):
    return resolve_config(args={"device": device, **sections}, environ={}, pm=pm).config


def test_every_plugin_is_a_distribution_with_an_entry_point():
    import configparser
    import importlib.metadata as md

    for name in DEVICES:
        cfg = configparser.ConfigParser()
        cfg.read(ROOT / "plugins" / "devices" / name / "setup.cfg")
        assert cfg["metadata"]["name"] == f"torchbay-{name}"
        requires = [r.partition(">=")[0] for r in cfg["options"]["install_requires"].split()]  # bounds: test_release.py
        assert requires == ["torchbay"], "vendor runtimes belong in extras"
        assert f"{name} = torchbay_{name}.plugin" in cfg["options.entry_points"]["torchbay"]
        assert (ROOT / "plugins" / "devices" / name / "pyproject.toml").exists()
        eps = [ep for ep in md.entry_points(group="torchbay") if ep.name == name]
        assert eps and eps[0].value == f"torchbay_{name}.plugin", f"torchbay-{name} is not installed in this venv"


def test_importing_every_plugin_imports_no_runtime():
    code = ("import sys, importlib\n"
            f"for n in {DEVICES!r}: importlib.import_module(f'torchbay_{{n}}.plugin')\n"
            "from torchbay.registry.manager import PluginManager\n"
            "pm = PluginManager(); pm.registries()\n"
            f"print([m for m in {RUNTIMES!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", DEVICES)
def test_registered_and_not_available_here(pm, name):
    info = pm.infos[name]
    assert info.status == "loaded", info.error
    assert info.distribution == f"torchbay-{name}"
    cls = pm.registries()["devices"][name]
    assert cls is backend(name)
    reason = cls.unavailable_reason()
    assert reason and REASONS[name] in reason and HINTS[name] in reason, reason
    assert not cls.is_available() and cls.device_count() == 0
    assert isinstance(cls.priority, int) and cls.priority > 0


def test_report_env_says_not_available_with_reason(pm):
    lines = {}
    for found in pm.hook.torchbay_report_env():
        lines.update(found or {})
    for name in DEVICES:
        assert lines[name].startswith("not available: "), lines[name]
        assert REASONS[name] in lines[name]


@pytest.mark.parametrize("name", DEVICES)
def test_selecting_it_gives_the_install_or_hardware_hint(name):
    with pytest.raises(IncompatibleSetupError) as err:
        Accelerator(device=name)
    text = str(err.value)
    assert f"device '{name}' cannot be used here" in text
    assert HINTS[name] in text


def test_auto_still_picks_cpu_with_every_plugin_installed(pm):
    from torchbay.registry.selection import select_device

    problems = []
    assert select_device("auto", pm.registries()["devices"], pm, problems).name == "cpu" and not problems
    priorities = [backend(n).priority for n in DEVICES]
    assert len(set(priorities)) == len(priorities), "priorities must not tie (auto would depend on load order)"


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_dist_backend(name):
    assert backend(name).dist_backend() == BACKENDS[name]


def test_xpu_backend_is_xccl_when_torch_has_it(monkeypatch):
    import torch.distributed as dist

    cls = backend("xpu")
    monkeypatch.setattr(dist, "is_xccl_available", lambda: True, raising=False)
    assert cls.dist_backend() == "xccl"
    monkeypatch.setattr(dist, "is_xccl_available", lambda: False, raising=False)
    assert cls.dist_backend() == "ccl"


def core_validate(pm, cls, config, per_machine, world=None):
    """The device class's own check (``DeviceBackend.check``) of a job on ``cls``."""
    cluster = SimpleNamespace(local_world_size=lambda: per_machine, world_size=lambda: world or per_machine)
    return cls.check(SimpleNamespace(device_backend_cls=cls, config=config, cluster=cluster))


@pytest.mark.parametrize("name", sorted(VISIBLE))
def test_visible_devices_reach_the_workers_through_the_core_setting(pm, name):
    cls = backend(name)
    env = cls.worker_env(config_for(pm, name, visible_devices="2,3"), 2)
    assert env[VISIBLE[name]] == "2,3"
    assert VISIBLE[name] not in cls.worker_env(config_for(pm, name), 2)
    assert not hasattr(plugin(name), "torchbay_config_sections") or name == "hpu"  # no per-plugin copy of it


def test_only_the_selected_devices_variable_is_set(pm):
    env = backend("npu").worker_env(config_for(pm, "npu", visible_devices="4,5"), 2)
    assert env == {"ASCEND_RT_VISIBLE_DEVICES": "4,5"}


def test_bad_visible_devices_is_a_config_error(pm):
    from torchbay.errors import ConfigError

    with pytest.raises(ConfigError, match="visible_devices"):
        config_for(pm, "npu", visible_devices="0, 1; rm")


def test_cuda_on_rocm_uses_hip_visible_devices(pm, monkeypatch):
    mod = plugin("cuda")
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    assert mod.CUDABackend.visible_devices_variable() == "HIP_VISIBLE_DEVICES"
    env = mod.CUDABackend.worker_env(config_for(pm, "cuda", visible_devices="1"), 1)
    assert env["HIP_VISIBLE_DEVICES"] == "1" and "CUDA_VISIBLE_DEVICES" not in env
    assert mod.CUDABackend.dist_backend() == "nccl"  # RCCL answers to nccl


def test_cuda_turns_the_flight_recorder_on_unless_the_user_set_it(pm, monkeypatch):
    cls = plugin("cuda").CUDABackend
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    env = cls.launch_env(2, config_for(pm, "cuda"))
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE", 0))) > 0
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")  # the user's choice stays
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    assert cls.launch_env(2, config_for(pm, "cuda")) == {}


def test_cuda_counts_without_a_context_and_validates_processes_per_gpu(pm, monkeypatch):
    mod = plugin("cuda")
    cls = mod.CUDABackend
    monkeypatch.setattr(torch.version, "cuda", "12.8", raising=False)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("device_count() would initialise CUDA"))
    assert cls.device_count() == 2 and cls.unavailable_reason() is None
    problems = core_validate(pm, cls, config_for(pm, "cuda"), per_machine=4)
    assert problems and "4 processes per machine but only 2 device(s) visible; nccl" in problems[0]
    assert not core_validate(pm, cls, config_for(pm, "cuda"), per_machine=2)
    assert core_validate(pm, cls, config_for(pm, "cuda", visible_devices="0"), per_machine=2)  # the mask counts
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cls.unavailable_reason().startswith("no CUDA device: no NVIDIA GPU is visible (CUDA_VISIBLE_DEVICES='')")


@pytest.mark.parametrize("name", ["npu", "mlu", "xpu", "hpu"])
def test_more_processes_than_devices_is_refused_before_launch(pm, monkeypatch, name):
    cls = backend(name)
    monkeypatch.setattr(cls, "device_count", classmethod(lambda c: 2))
    problems = core_validate(pm, cls, config_for(pm, name), per_machine=3)
    assert problems and "3 processes per machine but only 2" in problems[0]
    assert not core_validate(pm, cls, config_for(pm, name), per_machine=2)


def test_xpu_uses_ipex_only_when_versions_match(monkeypatch):
    mod = plugin("xpu")
    monkeypatch.setattr(mod.importlib.util, "find_spec", lambda name: object() if name == mod.IPEX else None)
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    monkeypatch.setattr(mod.importlib.metadata, "version", lambda dist: f"{major_minor}.10+xpu")
    assert mod.ipex_status() == (True, f"intel-extension-for-pytorch {major_minor}.10+xpu")
    monkeypatch.setattr(mod.importlib.metadata, "version", lambda dist: "1.13.0")
    usable, text = mod.ipex_status()
    assert not usable and "does not match torch" in text and "not used" in text


def test_mps_is_single_process(pm):
    mod = plugin("mps")
    assert mod.MPSBackend.multi_process is False
    problems = core_validate(pm, mod.MPSBackend, config_for(pm, "mps"), per_machine=2)
    assert "runs one process per machine" in problems[0]
    config = config_for(pm, "mps", mps={"cpu_fallback": True})
    assert mod.MPSBackend.launch_env(1, config) == {"PYTORCH_ENABLE_MPS_FALLBACK": "1"}


def test_hpu_lazy_mode_env_and_mark_steps(pm, monkeypatch):
    mod = plugin("hpu")
    config = config_for(pm, "hpu", hpu={"lazy_mode": False})
    assert mod.HPUBackend.launch_env(8, config) == {"PT_HPU_LAZY_MODE": "0"}
    marks = []
    core = types.SimpleNamespace(mark_step=lambda: marks.append("mark"))
    hpu = object.__new__(mod.HPUBackend)
    hpu._core = core  # lazy mode
    optimizer = types.SimpleNamespace(step=lambda: marks.append("step"))
    hpu.optimizer_step(optimizer)
    hpu.after_step()
    assert marks == ["mark", "step", "mark"]
    hpu._core = None  # eager mode: nothing marked
    marks.clear()
    hpu.optimizer_step(optimizer)
    hpu.after_step()
    assert marks == ["step"]
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    assert mod.HPUBackend.lazy_mode() is True
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    assert mod.HPUBackend.lazy_mode() is False


def test_hpu_rng_and_memory_go_through_the_runtime(monkeypatch):
    mod = plugin("hpu")
    state = {"rng": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    random = types.SimpleNamespace(get_rng_state=lambda: state["rng"].clone(),
                                   set_rng_state=lambda s: state.update(rng=s.clone()),
                                   manual_seed=lambda seed: state.update(rng=torch.tensor([seed], dtype=torch.uint8)))
    fake = types.SimpleNamespace(random=random, memory_stats=lambda index: {"InUse": 10, "MaxInUse": 30, "Limit": 100})
    monkeypatch.setattr(mod, "_hpu", lambda: fake)
    hpu = object.__new__(mod.HPUBackend)
    hpu.index = 0
    saved = hpu.get_rng_state()
    hpu.manual_seed(9)
    hpu.set_rng_state(saved)
    assert torch.equal(state["rng"], torch.tensor([1, 2, 3], dtype=torch.uint8))
    assert hpu.memory_stats() == {"allocated": 10, "peak_allocated": 30, "reserved": 10, "free": 90, "total": 100}
    assert hpu.mem_get_info() == (90, 100)


@pytest.fixture
def fake_torch_xla(monkeypatch):
    """Stand-in torch_xla modules recording what the backend asks of them."""
    calls = []
    torch_xla = types.ModuleType("torch_xla")
    torch_xla.sync = lambda: calls.append("sync")
    torch_xla.device = lambda: torch.device("xla", 0)
    xm = types.ModuleType("torch_xla.core.xla_model")
    seed = {"value": 5}
    xm.optimizer_step = lambda opt, optimizer_args=None: calls.append(("xm.optimizer_step", optimizer_args))
    xm.get_rng_state = lambda device=None: seed["value"]
    xm.set_rng_state = lambda value, device=None: seed.update(value=value)
    xm.wait_device_ops = lambda: calls.append("wait")
    xm.get_memory_info = lambda device: {"bytes_used": 40, "bytes_limit": 100, "peak_bytes_used": 60}
    loader_mod = types.ModuleType("torch_xla.distributed.parallel_loader")
    loader_mod.MpDeviceLoader = lambda loader, device: ("MpDeviceLoader", loader, device)
    modules = {"torch_xla": torch_xla, "torch_xla.core": types.ModuleType("torch_xla.core"),
               "torch_xla.core.xla_model": xm, "torch_xla.distributed": types.ModuleType("torch_xla.distributed"),
               "torch_xla.distributed.parallel_loader": loader_mod}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return SimpleNamespace(calls=calls, seed=seed)


def test_xla_step_loader_rng_and_memory(fake_torch_xla):
    mod = plugin("xla")
    xla = mod.XLABackend(0)
    assert xla.device == torch.device("xla", 0)
    optimizer = types.SimpleNamespace(step=lambda: fake_torch_xla.calls.append("plain step"))
    xla.optimizer_step(optimizer)  # no torch.distributed group: XLA reduces and steps
    xla.after_step()
    assert fake_torch_xla.calls == [("xm.optimizer_step", {}), "sync"]
    assert xla.wrap_dataloader("loader") == ("MpDeviceLoader", "loader", xla.device)
    states = xla.get_rng_state()
    assert states[0].dtype == torch.int64 and states[0].device.type == "cpu"
    xla.manual_seed(123)
    xla.set_rng_state(states)
    assert fake_torch_xla.seed["value"] == 5
    assert xla.memory_stats() == {"allocated": 40, "peak_allocated": 60, "reserved": 40, "free": 60, "total": 100}
    assert mod.XLABackend.supports_autocast(torch.bfloat16)


def test_xla_detection_never_imports_the_runtime(pm, monkeypatch):
    mod = plugin("xla")
    cls = mod.XLABackend
    monkeypatch.setattr(cls, "runtime_installed", classmethod(lambda c: True))
    monkeypatch.setattr(cls, "load_runtime", classmethod(lambda c: pytest.fail("detection imported torch_xla")))
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(mod, "tpu_chip_count", lambda: 0)
    assert "no TPU found" in cls.unavailable_reason()
    monkeypatch.setattr(mod, "tpu_chip_count", lambda: 4)
    assert cls.unavailable_reason() is None and cls.device_count() == 4
    assert cls.launch_env(1, config_for(pm, "xla")) == {"PJRT_DEVICE": "TPU"}
    assert not cls.supports_autocast(torch.float16)
    config = config_for(pm, "xla", xla={"pjrt_device": "CPU"})
    assert cls.launch_env(1, config)["PJRT_DEVICE"] == "CPU"


def test_runtime_devices_import_their_runtime_only_when_probed(monkeypatch):
    for name, runtime in (("npu", "torch_npu"), ("mlu", "torch_mlu")):
        cls = backend(name)
        assert cls.runtime_module == runtime and cls.visible_devices_env == VISIBLE[name]
        assert cls.device_count() == 0  # not installed: counted without importing anything
