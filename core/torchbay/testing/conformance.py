"""The device conformance kit: checks any device plugin runs against its own device.

Two ways to use it:

- as pytest tests, in the plugin's own test file::

      from torchbay.testing.conformance import *  # noqa: F401,F403

      CONFORMANCE_DEVICE = "mydevice"   # the name the plugin registers

  (or override the ``conformance_device`` fixture). Every check becomes one test; a device that is not
  available here makes every test skip with the device's own reason.

- as a function: ``run_conformance("mydevice")`` returns a :class:`ConformanceReport`
  with one :class:`CheckResult` per check (``report.ok``, ``report.failures``,
  ``str(report)``, ``report.raise_for_failures()``).

The checks (see :data:`CHECKS`): detection, plugin import cost, RNG round trip, seeding
determinism, memory queries, autocast dtypes, a 2-process collective test started through
``torchbay launch`` (``torch.distributed.run`` while that command is not installed), a
train / save_state / load_state / resume cycle that must equal the uninterrupted run, and
big-model placement (device capacity per index, a dispatched model split with an offload).
Nothing here names a device: it is the plugin's ``DeviceBackend`` that is tested.
"""



import io
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from torchbay.testing._conformance_base import (  # noqa: F401
    CheckResult,
    ConformanceFailure,
    ConformanceReport,
    ConformanceSkip,
    _device_class,
    _draw,
    _fail,
    _first,
    _require_available,
)
from torchbay.testing._conformance_placement import check_placement
from torchbay.testing._conformance_runs import check_collectives, check_train_resume
from torchbay.utils import set_seed

__all__ = [
    "CHECKS", "CheckResult", "ConformanceReport", "ConformanceFailure", "ConformanceSkip", "run_conformance",
    "run_check", "conformance_device", "conformance_plugin_manager", "conformance_env",
    "test_conformance_detection", "test_conformance_plugin_import", "test_conformance_rng_round_trip",
    "test_conformance_seeding", "test_conformance_memory", "test_conformance_autocast",
    "test_conformance_collectives", "test_conformance_train_resume", "test_conformance_placement",
]


# --- the checks ----------------------------------------------------------------------------


def check_detection(name: str, pm=None, **_: Any) -> str:
    """Registration, class attributes and class-level detection answers."""
    cls = _device_class(name, pm)
    problems = []
    if cls.name != name:
        problems.append(f"class {cls.__qualname__} is registered under '{name}' but its name attribute is '{cls.name}'")
    if not isinstance(cls.priority, int):
        problems.append(f"priority must be an int, got {cls.priority!r}")
    reason = cls.unavailable_reason()
    if reason is not None and (not isinstance(reason, str) or not reason.strip()):
        problems.append(f"unavailable_reason() must return None or a non-empty explanation, got {reason!r}")
    if cls.is_available() != (reason is None):
        problems.append("is_available() disagrees with unavailable_reason()")
    if problems:
        _fail("; ".join(problems))
    if reason is not None:
        raise ConformanceSkip(f"device '{name}' is not available here: {reason}")
    try:  # available: the runtime (if any) is loaded and has registered the type
        torch.device(cls.torch_type())
    except Exception as exc:
        _fail(f"torch_type() '{cls.torch_type()}' is not a torch device type here ({exc}); set device_type, "
              f"or import the runtime that registers it in load_runtime()")
    count = cls.device_count()
    if not isinstance(count, int) or count < 1:
        _fail(f"device '{name}' says it is available but device_count() is {count!r}; it must be >= 1")
    backend = cls.dist_backend()
    if not isinstance(backend, str) or not backend:
        _fail(f"dist_backend() must name a torch.distributed backend, got {backend!r}")
    env = cls.launch_env(2)
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        _fail(f"launch_env(2) must return dict[str, str], got {env!r}")
    instance = cls(0)
    if instance.device.type != cls.torch_type():
        _fail(f"{cls.__qualname__}(0).device is {instance.device} but torch_type() is '{cls.torch_type()}'")
    report = instance.report()
    if not isinstance(report, dict):
        _fail(f"report() must return a dict, got {type(report).__name__}")
    return f"{count} device(s), dist backend {backend}, priority {cls.priority}"


def check_plugin_import(name: str, pm=None, env: dict[str, str] | None = None, **_: Any) -> str:
    """Importing the plugin module must not import the vendor runtime (rule 4)."""
    cls = _device_class(name, pm)
    module = cls.__module__
    runtime = cls.runtime_module
    if not runtime:
        return "no runtime module declared"
    if module == "__main__" or module not in sys.modules or getattr(sys.modules[module], "__file__", None) is None:
        raise ConformanceSkip(f"the class is defined in {module!r}, which a fresh interpreter cannot import")
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            f"print({runtime.split('.')[0]!r} in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        _fail(f"importing the plugin module {module} in a fresh interpreter failed:\n{proc.stderr[-2000:]}")
    if proc.stdout.strip().endswith("True"):
        _fail(f"importing the plugin module {module} imported the runtime '{runtime}': import it only in "
              f"load_runtime() (it runs when the device is selected), never at module level")
    return f"importing {module} leaves '{runtime}' unimported"



def check_rng_round_trip(name: str, pm=None, **_: Any) -> str:
    """get_rng_state / set_rng_state restore the exact stream of the device's generator."""
    cls = _device_class(name, pm)
    _require_available(cls)
    backend = cls(0)
    backend.set_current()
    backend.manual_seed(1234)
    _draw(backend.device)  # move away from the freshly seeded point
    states = backend.get_rng_state()
    if not isinstance(states, list) or not states or not all(isinstance(s, torch.Tensor) for s in states):
        _fail(f"get_rng_state() must return a non-empty list of tensors, got {type(states).__name__}: {states!r:.200}")
    off_host = [str(s.device) for s in states if s.device.type != "cpu"]
    if off_host:
        _fail(f"get_rng_state() returned tensors on {off_host}: states must be CPU tensors so that save_state can "
              f"write them and load_state can read them before the device is used")
    buffer = io.BytesIO()
    torch.save(states, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    expected = _draw(backend.device)
    _draw(backend.device)  # advance further so that a no-op restore is visible
    backend.set_rng_state(saved)
    got = _draw(backend.device)
    if not torch.equal(expected, got):
        _fail(f"RNG round trip on {backend.device}: the draws after set_rng_state(get_rng_state()) differ from the "
              f"draws made right after get_rng_state() (expected {_first(expected)}..., got {_first(got)}...): "
              f"{cls.__qualname__}.set_rng_state does not restore the generator state that get_rng_state returned, so "
              f"load_state would resume with a different random stream")
    backend.set_rng_state(saved)
    again = _draw(backend.device)
    if not torch.equal(expected, again):
        _fail(f"RNG round trip on {backend.device}: restoring the same saved state twice gave different draws "
              f"({_first(expected)}... then {_first(again)}...)")
    return f"{len(states)} generator state(s) restored exactly"


def check_seeding(name: str, pm=None, **_: Any) -> str:
    """manual_seed makes draws reproducible; different seeds give different draws."""
    cls = _device_class(name, pm)
    _require_available(cls)
    backend = cls(0)
    backend.set_current()
    backend.manual_seed(7)
    a = _draw(backend.device)
    backend.manual_seed(7)
    b = _draw(backend.device)
    if not torch.equal(a, b):
        _fail(f"seeding on {backend.device}: manual_seed(7) twice gave different draws ({_first(a)}... vs "
              f"{_first(b)}...): {cls.__qualname__}.manual_seed does not seed the generator torch.rand uses")
    backend.manual_seed(8)
    c = _draw(backend.device)
    if torch.equal(a, c):
        _fail(f"seeding on {backend.device}: manual_seed(7) and manual_seed(8) gave the same draws: "
              "the seed is ignored")
    set_seed(11)
    d = _draw(backend.device)
    set_seed(11)
    e = _draw(backend.device)
    if not torch.equal(d, e):
        _fail(f"seeding on {backend.device}: torchbay.set_seed(11) twice gave different device draws "
              f"({_first(d)}... vs {_first(e)}...): torch.manual_seed does not reach this device's generator")
    return "manual_seed and set_seed reproduce device draws"


MEMORY_KEYS = ("allocated", "peak_allocated", "reserved", "free", "total")


def check_memory(name: str, pm=None, **_: Any) -> str:
    """memory_stats / mem_get_info answer in bytes and see an allocation."""
    cls = _device_class(name, pm)
    _require_available(cls)
    backend = cls(0)
    backend.set_current()
    before = backend.memory_stats()
    if not isinstance(before, dict):
        _fail(f"memory_stats() must return a dict, got {type(before).__name__}")
    missing = [k for k in MEMORY_KEYS if k not in before]
    if missing:
        _fail(f"memory_stats() lacks the keys {missing} (it must give bytes for {list(MEMORY_KEYS)}); "
              f"got {sorted(before)}")
    bad = {k: before[k] for k in MEMORY_KEYS
           if not isinstance(before[k], int) or isinstance(before[k], bool) or before[k] < 0}
    if bad:
        _fail(f"memory_stats() values must be non-negative ints (bytes); these are not: {bad}")
    if before["total"] <= 0 or before["free"] > before["total"]:
        _fail(f"memory_stats(): need 0 <= free <= total and total > 0, "
              f"got free={before['free']} total={before['total']}")
    info = backend.mem_get_info()
    if not (isinstance(info, tuple) and len(info) == 2 and all(isinstance(v, int) for v in info)):
        _fail(f"mem_get_info() must return (free_bytes, total_bytes) as ints, got {info!r}")
    if not 0 <= info[0] <= info[1] or info[1] <= 0:
        _fail(f"mem_get_info() returned free={info[0]} total={info[1]}: need 0 <= free <= total, total > 0")
    size = 64 * 2**20
    block = torch.ones(size // 4, dtype=torch.float32, device=backend.device)
    backend.synchronize()
    during = backend.memory_stats()
    grown = during["allocated"] - before["allocated"]
    if grown < size // 2:
        _fail(f"memory_stats()['allocated'] grew by {grown} bytes after allocating a {size}-byte tensor on "
              f"{backend.device}; it must count the memory tensors of this process hold")
    if during["peak_allocated"] < during["allocated"]:
        _fail(f"memory_stats(): peak_allocated ({during['peak_allocated']}) < allocated ({during['allocated']})")
    del block
    backend.empty_cache()
    backend.reset_peak_memory()
    backend.synchronize()
    return f"total {before['total']} bytes, allocation of {size} bytes seen (+{grown})"


def check_autocast(name: str, pm=None, **_: Any) -> str:
    """Each dtype the backend declares for autocast really computes in that dtype."""
    cls = _device_class(name, pm)
    _require_available(cls)
    backend = cls(0)
    backend.set_current()
    layer = torch.nn.Linear(16, 16).to(backend.device)
    x = torch.randn(4, 16, device=backend.device)
    done, declined = [], []
    for dtype in (torch.bfloat16, torch.float16):
        if not cls.supports_autocast(dtype):
            declined.append(str(dtype).replace("torch.", ""))
            continue
        try:
            with backend.autocast(dtype):
                y = layer(x)
        except Exception as exc:
            _fail(f"autocast({dtype}) on {backend.device} raised {type(exc).__name__}: {exc}; declare "
                  f"supports_{str(dtype).replace('torch.', '').replace('float16', 'fp16').replace('bfloat16', 'bf16')}"
                  f"_autocast = False or fix autocast()")
        if y.dtype != dtype:
            _fail(f"autocast({dtype}) on {backend.device}: nn.Linear produced {y.dtype}, not {dtype}; the backend "
                  f"declares this dtype but its autocast() does not apply it")
        with backend.autocast(dtype, enabled=False):
            z = layer(x)
        if z.dtype != torch.float32:
            _fail(f"autocast({dtype}, enabled=False) on {backend.device} still produced {z.dtype}")
        if dtype == torch.float16:
            scaler = backend.grad_scaler()
            if not all(hasattr(scaler, m) for m in ("scale", "step", "update", "unscale_", "state_dict")):
                _fail(f"grad_scaler() returned {type(scaler).__name__}, which lacks the GradScaler methods")
        done.append(str(dtype).replace("torch.", ""))
    if not done:
        raise ConformanceSkip(f"device '{name}' declares no autocast dtype (declined: {', '.join(declined)})")
    return f"autocast {', '.join(done)} ok" + (f"; not declared: {', '.join(declined)}" if declined else "")



#: check name -> function(name, pm=..., env=...) returning a short summary
CHECKS: dict[str, Callable[..., str]] = {
    "detection": check_detection,
    "plugin_import": check_plugin_import,
    "rng_round_trip": check_rng_round_trip,
    "seeding": check_seeding,
    "memory": check_memory,
    "autocast": check_autocast,
    "collectives": check_collectives,
    "train_resume": check_train_resume,
    "placement": check_placement,
}


def run_check(check: str, device: str, *, pm=None, env: dict[str, str] | None = None) -> CheckResult:
    """Run one check; never raises for a failing device (the result says why)."""
    if check not in CHECKS:
        raise KeyError(f"unknown conformance check '{check}' (checks: {', '.join(CHECKS)})")
    start = time.monotonic()
    try:
        summary = CHECKS[check](device, pm=pm, env=env)
        status, message = "passed", summary or ""
    except ConformanceSkip as exc:
        status, message = "skipped", str(exc)
    except ConformanceFailure as exc:
        status, message = "failed", str(exc)
    except Exception as exc:  # an unexpected error is a failure, with where it happened
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        status, message = "failed", (f"{type(exc).__name__}: {exc} (at {Path(tb.filename).name}:{tb.lineno} "
                                     f"in {tb.name})")
    return CheckResult(check, status, message, time.monotonic() - start)


def run_conformance(device: str, *, checks: Iterable[str] | None = None, pm=None,
                    env: dict[str, str] | None = None) -> ConformanceReport:
    """Run the conformance checks (all by default) against the registered device ``device``.

    :param pm: the plugin manager that has the device (default: the process-wide one); an
        in-process plugin registered with ``pm.register_plugin`` is seen by every in-process
        check, but the 2-process check needs the plugin installed (entry point).
    :param env: extra environment for the subprocesses (e.g. ``PYTHONPATH``).
    """
    report = ConformanceReport(device)
    for check in (list(checks) if checks is not None else list(CHECKS)):
        report.results.append(run_check(check, device, pm=pm, env=env))
    return report


# --- pytest face ---------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # pragma: no cover - the function API works without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="module")
    def conformance_device(request) -> str:
        """The device name under test: the test module's ``CONFORMANCE_DEVICE``."""
        name = getattr(request.module, "CONFORMANCE_DEVICE", None)
        if not name:
            pytest.fail(f"set CONFORMANCE_DEVICE = '<device>' in {request.module.__name__} (or override the "
                        f"conformance_device fixture) to run the torchbay device conformance tests")
        return name

    @pytest.fixture(scope="module")
    def conformance_plugin_manager():
        """The plugin manager the checks use; ``None`` means the process-wide one."""
        return None

    @pytest.fixture(scope="module")
    def conformance_env() -> dict[str, str]:
        """Extra environment for the subprocesses the checks start."""
        return {}

    def _as_test(check: str):
        def test(conformance_device, conformance_plugin_manager, conformance_env):
            result = run_check(check, conformance_device, pm=conformance_plugin_manager, env=conformance_env)
            if result.status == "skipped":
                pytest.skip(result.message)
            if result.status == "failed":
                raise ConformanceFailure(f"device '{conformance_device}' fails conformance check '{check}': "
                                         f"{result.message}")
        test.__name__ = f"test_conformance_{check}"
        test.__doc__ = CHECKS[check].__doc__
        test.__module__ = __name__
        return test

    test_conformance_detection = _as_test("detection")
    test_conformance_plugin_import = _as_test("plugin_import")
    test_conformance_rng_round_trip = _as_test("rng_round_trip")
    test_conformance_seeding = _as_test("seeding")
    test_conformance_memory = _as_test("memory")
    test_conformance_autocast = _as_test("autocast")
    test_conformance_collectives = _as_test("collectives")
    test_conformance_train_resume = _as_test("train_resume")
    test_conformance_placement = _as_test("placement")
else:  # pragma: no cover
    __all__ = [n for n in __all__ if not n.startswith(("test_", "conformance_"))]
