"""Small utilities with Accelerate's names: environment patching, version checks, memory.

Re-exported by :mod:`torchbay.utils`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import gc
import inspect
import logging
import operator
import os
import platform
import re
from typing import Any, Callable

import torch

from torchbay.config.flags import str_to_bool
from torchbay.data.operations import find_batch_size, recursively_apply
from torchbay.errors import ConfigError, TorchbayError
from torchbay.process.current import current, peek
from torchbay.process.state import AcceleratorState, PartialState

logger = logging.getLogger(__name__)


class RNGType(str, enum.Enum):
    """Generators ``synchronize_rng_states`` knows: the CPU one, a user's, or a device's by name."""

    TORCH = "torch"
    GENERATOR = "generator"


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    return bool(str_to_bool(os.environ.get(key, str(default)), to_bool=True))


def parse_choice_from_env(key: str, default: str = "no") -> str:
    return os.environ.get(key, str(default))


_OPS = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<=": operator.le,
        "<": operator.lt}


def compare_versions(library_or_version: Any, operation: str, requirement_version: str) -> bool:
    """``compare_versions("torch", ">=", "2.1")``: compare an installed library's (or a given) version."""
    from importlib.metadata import version as installed

    from packaging.version import parse

    if operation not in _OPS:
        raise ValueError(f"operation must be one of {sorted(_OPS)}, not {operation!r}")
    if isinstance(library_or_version, str) and not library_or_version[:1].isdigit():
        library_or_version = installed(library_or_version)
    return _OPS[operation](parse(str(library_or_version)), parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    from packaging.version import parse

    return _OPS[operation](parse(parse(torch.__version__).base_version), parse(version))


def merge_dicts(source: dict, destination: dict) -> dict:
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def get_pretty_name(obj: Any) -> str:
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", str(obj))


_MIN_KERNEL = (5, 5, 0)


def check_os_kernel() -> None:
    """Warn (main process) when the Linux kernel is older than 5.5.0: older ones can hang distributed runs."""
    info = platform.uname()
    found = re.search(r"(\d+)\.(\d+)\.(\d+)", info.release) if info.system == "Linux" else None
    if found is None or tuple(map(int, found.groups())) >= _MIN_KERNEL:
        return
    run = peek()
    if run is not None and not run.is_main_process:
        return
    logger.warning(f"Detected kernel version {found.group(0)}, which is below the recommended minimum of "
                   f"{'.'.join(map(str, _MIN_KERNEL))}; this can cause the process to hang. Upgrade the kernel "
                   f"to that version or higher.")


def get_model_tp_size(model: Any) -> int | None:
    """The tensor-parallel degree a ``transformers`` model was sharded with, or ``None``.

    ``transformers<5`` keeps it as ``model.tp_size``; ``transformers>=5`` in ``model.config.distributed_config``
    (an object, or a dict after a JSON round trip) and leaves ``model.tp_size`` as ``None``.
    """
    if getattr(model, "tp_size", None) is not None:
        return model.tp_size
    distributed = getattr(getattr(model, "config", None), "distributed_config", None)
    if isinstance(distributed, dict):
        return distributed.get("tp_size")
    return getattr(distributed, "tp_size", None)


def wait_for_everyone() -> None:
    PartialState().wait_for_everyone()


def save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """``torch.save`` (or safetensors) on the main process (of each node with ``save_on_each_node``)."""
    state = PartialState()
    if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
        return
    if safe_serialization:
        from safetensors.torch import save_file

        from torchbay.big_modeling.offload import clean_state_dict_for_safetensors

        kept = clean_state_dict_for_safetensors(obj)  # safetensors refuses tensors that share memory
        removed = [name for name in obj if name not in kept]
        if removed:
            logger.warning(f"Removed shared tensor {removed} while saving (they share memory with a tensor saved "
                           f"under another name); reloading ties them again only if the model ties them")
        save_file(kept, f, metadata={"format": "pt"})
    else:
        torch.save(obj, f)


def extract_model_from_parallel(model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
                                recursive: bool = False) -> Any:
    """The user's module inside DDP/other wrappers (``torch.compile``'s kept unless ``keep_torch_compile=False``)."""
    from torchbay.distributed.unwrap import unwrap

    return unwrap(model, keep_fp32_wrapper, keep_torch_compile)


def release_memory(*objects: Any) -> list[None]:
    """Drop the given references (returns ``None`` for each) and empty the device cache."""
    objects = [None] * len(objects)
    gc.collect()

    run = peek()
    if run is not None:
        run.strategy.device_backend.empty_cache()
    return objects


def _is_out_of_memory(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and (
        "out of memory" in text.lower() or "DefaultCPUAllocator: can't allocate memory" in text))


class BatchSizeArgumentError(TorchbayError, TypeError):
    """The function decorated by ``find_executable_batch_size`` was called with its batch size."""


class NoExecutableBatchSizeError(TorchbayError, RuntimeError):
    """Every batch size down to zero ran out of memory (a RuntimeError, as Accelerate's)."""


def _takes_size(fn: Callable) -> bool:
    """Whether a user's ``reduce_batch_size_fn`` takes the current size (torchbay's form) or nothing (Accelerate's)."""
    try:
        inspect.signature(fn).bind(1)
    except TypeError:
        return False
    return True


def find_executable_batch_size(function: Callable | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[..., int] | None = None):
    """Call ``function(batch_size, ...)``, shrinking ``batch_size`` to 90% (rounded down) after each
    out-of-memory error, as Accelerate does.

    ``function``'s first parameter must be the batch size; call the decorated function without it. As in
    Accelerate, the size found is kept: a second call starts from it. ``reduce_batch_size_fn`` returns the next
    size; it takes no argument (Accelerate's form) or the current size.
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size

    def shrink() -> int:
        if reduce_batch_size_fn is None:
            return int(batch_size * 0.9)
        return reduce_batch_size_fn(batch_size) if _takes_size(reduce_batch_size_fn) else reduce_batch_size_fn()

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any):
        nonlocal batch_size
        name = getattr(function, "__name__", repr(function))
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            passed = ", ".join(f"{p}={v!r}" for p, v in zip(params[1:], args[1:]))
            raise BatchSizeArgumentError(f"find_executable_batch_size: the batch size was passed into `{name}` as "
                                         f"its first argument; the decorator passes it for you: call "
                                         f"`{name}({passed})`")
        while True:
            if batch_size <= 0:
                raise NoExecutableBatchSizeError(
                    f"find_executable_batch_size: no executable batch size found, reached zero ({name} ran out of "
                    f"memory at every size from {starting_batch_size}); reduce the model or the sequence length")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not _is_out_of_memory(exc):
                    raise
                gc.collect()
                release_memory()
                batch_size = shrink()

    return run


# -- small structure and environment helpers (Accelerate's names) ---------------------------
class PrecisionType(str, enum.Enum):
    """The ``mixed_precision`` values."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


@dataclasses.dataclass
class TensorInformation:
    shape: torch.Size
    dtype: torch.dtype


def is_tensor_information(value: Any) -> bool:
    return isinstance(value, TensorInformation)


def is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def is_compiled_module(module: Any) -> bool:
    return hasattr(torch, "_dynamo") and isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def is_peft_model(model: Any) -> bool:
    return type(model).__module__.startswith("peft.")


def is_port_in_use(port: int | None = None) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("localhost", int(port or 29500))) == 0


def get_int_from_env(env_keys: list[str], default: int) -> int:
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


def get_data_structure(data: Any) -> Any:
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def initialize_tensors(data_structure: Any) -> Any:
    return recursively_apply(lambda info: torch.empty(*info.shape, dtype=info.dtype), data_structure,
                             test_type=is_tensor_information)


def ignorant_find_batch_size(data: Any) -> int | None:
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def recursive_getattr(obj: Any, attr: str) -> Any:
    return functools.reduce(getattr, [obj, *attr.split(".")])


def convert_bytes(size: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def dtype_byte_size(dtype: torch.dtype) -> float:
    if dtype == torch.bool:
        return 1 / 8
    return (torch.finfo(dtype).bits if dtype.is_floating_point or dtype.is_complex else torch.iinfo(dtype).bits) / 8


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only=True``: torchbay never unpickles arbitrary classes."""
    if kwargs.pop("weights_only", True) is not True:

        raise ConfigError("torchbay.utils.load refuses weights_only set to False: torchbay never unpickles arbitrary "
                          "classes from a file. Save tensors and plain data, or call torch.load yourself for a "
                          "file you trust")
    return torch.load(f, map_location=map_location, weights_only=True, **kwargs)


def _current_backend():
    return current().strategy.device_backend


def get_current_device_type() -> str:
    """The torch device type of this process's device (answered by its device plugin)."""
    return _current_backend().device.type


def get_grad_scaler(distributed_type: Any = None, **kwargs: Any) -> Any:
    """A loss scaler for this process's device (from its device plugin)."""
    return _current_backend().grad_scaler(**kwargs)


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs: Any = None):
    """The autocast context of the current ``mixed_precision`` (a null context for ``no``)."""
    precision = AcceleratorState().mixed_precision
    if not native_amp or precision not in ("fp16", "bf16"):
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    enabled = getattr(autocast_kwargs, "enabled", True)
    cache = getattr(autocast_kwargs, "cache_enabled", None)
    return _current_backend().autocast(dtype, enabled=enabled, cache_enabled=cache)


def model_has_dtensor(model: Any) -> bool:
    """Whether any parameter of ``model`` (or the model it wraps) is a DTensor (sharded by FSDP2 or tensor
    parallel)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in getattr(model, "module", model).parameters())
