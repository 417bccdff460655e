"""Collectives over nested structures of tensors, with Accelerate's free-function signatures.

``gather(t)``, ``reduce(t, "sum")``, ``broadcast(t)``... act on the current process group
through the strategy that ``PartialState`` holds (the latest ``Accelerator``'s, or its own);
the ``Accelerator`` methods call the ``_``-prefixed forms with its own strategy. In debug mode
(``PartialState().debug = True``) the shapes are compared across processes first and a
mismatch raises :class:`DistributedOperationException`.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Mapping

import torch

from torchbay.errors import TorchbayError
from torchbay.process.current import current


class DistributedOperationException(TorchbayError):
    """A collective was called with tensors that do not match across processes."""


class CannotPadNestedTensorWarning(UserWarning):
    """pad_across_processes met a nested tensor and left it as it is."""


def is_torch_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _is_namedtuple(data: Any) -> bool:
    return isinstance(data, tuple) and hasattr(data, "_fields")


def honor_type(obj: Any, generator) -> Any:
    return type(obj)(*list(generator)) if _is_namedtuple(obj) else type(obj)(generator)


def recursively_apply(func: Callable, data: Any, *args: Any, test_type: Callable = is_torch_tensor,
                      error_on_other_type: bool = False, **kwargs: Any) -> Any:
    """Apply ``func`` to every object passing ``test_type`` inside lists, tuples and mappings."""
    if isinstance(data, (tuple, list)):
        return honor_type(data, (recursively_apply(func, o, *args, test_type=test_type,
                                                   error_on_other_type=error_on_other_type, **kwargs) for o in data))
    if isinstance(data, Mapping):
        return type(data)({k: recursively_apply(func, v, *args, test_type=test_type,
                                                error_on_other_type=error_on_other_type, **kwargs)
                           for k, v in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        # Accelerate's wording, which callers match
        raise TypeError(f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', func)}`. Only nested "
                        f"list/tuple/dicts of objects that are valid for `{getattr(test_type, '__name__', test_type)}` "
                        f"should be passed.")
    return data


def send_to_device(tensor: Any, device: Any, non_blocking: bool = False, skip_keys: Any = None) -> Any:
    """Move every tensor (and object with ``.to``) in a nested structure to ``device``."""
    if isinstance(skip_keys, str):
        skip_keys = [skip_keys]
    if isinstance(tensor, (tuple, list)):
        return honor_type(tensor, (send_to_device(t, device, non_blocking, skip_keys) for t in tensor))
    if isinstance(tensor, Mapping):
        return type(tensor)({k: v if skip_keys and k in skip_keys
                             else send_to_device(v, device, non_blocking, skip_keys)
                             for k, v in tensor.items()})
    if hasattr(tensor, "to"):  # (no callable(): torch.compile cannot trace it on a bound method)
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:
            return tensor.to(device)
    return tensor


def _strategy():
    return current().strategy


def _debug() -> bool:
    return bool(current().debug)


def get_shape(data: Any) -> Any:
    return recursively_apply(lambda t: list(t.shape), data)


def _verified(function: Callable) -> Callable:
    """Compare shapes across processes before the collective, in debug mode."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any):
        strategy = _strategy()
        if strategy.world_size > 1 and _debug():
            data = kwargs["tensor"] if "tensor" in kwargs else args[0]
            shapes = strategy.all_gather_object(get_shape(data))
            if any(s != shapes[0] for s in shapes):
                listing = "\n  - ".join(f"process {i}: {s}" for i, s in enumerate(shapes))
                raise DistributedOperationException(
                    f"{function.__name__}: the tensors differ in shape across processes; every process must pass "
                    f"the same shapes:\n  - {listing}")
        return function(*args, **kwargs)

    return wrapper


# -- forms that take the strategy (used by the Accelerator) ------------------------------
def gather_with(strategy, data: Any) -> Any:
    """``gather`` through ``strategy``'s collectives (the Accelerator's; the free function uses the current run's)."""
    # collectives do not carry gradients; a tensor that requires grad is gathered as its data
    return recursively_apply(lambda t: strategy.all_gather(t.detach()), data, error_on_other_type=True)


def reduce_with(strategy, data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """``reduce`` through ``strategy``'s collectives."""
    if reduction not in ("sum", "mean", "none", "max", "min", "product"):
        raise TorchbayError(f"reduce: reduction must be 'sum', 'mean' or 'none', not {reduction!r}")

    def one(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone() if reduction == "none" else strategy.all_reduce(tensor, op=reduction)
        return out * scale if scale != 1.0 else out

    return recursively_apply(one, data, error_on_other_type=True)


def pad_across_processes_with(strategy, data: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """``pad_across_processes`` through ``strategy``'s collectives."""
    def pad(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_nested:  # its sizes differ per item: nothing tells which one to pad to
            warnings.warn("pad_across_processes: cannot pad a nested tensor without more information; it is "
                          "returned as it is", CannotPadNestedTensorWarning, stacklevel=2)
            return tensor
        if dim >= tensor.ndim or dim < -tensor.ndim:
            return tensor
        here = dim % tensor.ndim
        size = torch.tensor(tensor.shape, device=tensor.device)[None]
        sizes = strategy.all_gather(size)
        biggest = int(sizes[:, here].max())
        if biggest == tensor.shape[here]:
            return tensor
        shape = list(tensor.shape)
        shape[here] = biggest
        out = tensor.new_zeros(shape) + pad_index
        index = [slice(None)] * tensor.ndim
        index[here] = slice(biggest - tensor.shape[here], biggest) if pad_first else slice(0, tensor.shape[here])
        out[tuple(index)] = tensor
        return out

    return recursively_apply(pad, data, error_on_other_type=True)


# -- Accelerate's free functions ---------------------------------------------------------
@_verified
def gather(tensor: Any) -> Any:
    """Concatenate ``tensor`` (or each tensor of a nested structure) from every process along dim 0."""
    return gather_with(_strategy(), tensor)


def gather_object(object: Any) -> list[Any]:  # noqa: A002 (Accelerate's name)
    """Gather picklable objects from every process; lists are concatenated, as Accelerate does."""
    parts = _strategy().all_gather_object(object)
    return [x for part in parts for x in (part if isinstance(part, (list, tuple)) else [part])]


@_verified
def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Every process gets ``from_process``'s tensors (in place, returned too)."""
    strategy = _strategy()
    return recursively_apply(lambda t: strategy.broadcast(t, src=from_process), tensor, error_on_other_type=True)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace the items of ``object_list`` by ``from_process``'s, in place, and return it."""
    strategy = _strategy()
    if strategy.world_size > 1:
        object_list[:] = strategy.broadcast_object(list(object_list), src=from_process)
    return object_list


@_verified
def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """``sum`` or ``mean`` of ``tensor`` over the processes (``none`` returns a copy), times ``scale``."""
    return reduce_with(_strategy(), tensor, reduction, scale)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad ``tensor`` along ``dim`` to the largest size any process has, with ``pad_index``."""
    strategy = _strategy()
    if strategy.world_size > 1 and _debug():
        ndims = strategy.all_gather_object(recursively_apply(lambda t: t.ndim, tensor))
        if any(n != ndims[0] for n in ndims):
            raise DistributedOperationException(
                f"pad_across_processes: the tensors have different numbers of dimensions across processes: {ndims}")
    try:
        return pad_across_processes_with(strategy, tensor, dim, pad_index, pad_first)
    except DistributedOperationException:
        raise
    except Exception as exc:
        if strategy.world_size > 1:
            raise DistributedOperationException(f"pad_across_processes failed: {exc}") from exc
        raise


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Send the main process's tensor to every process (the others pass ``None``)."""
    strategy = _strategy()
    meta = strategy.broadcast_object((tuple(tensor.shape), tensor.dtype) if tensor is not None else None)
    if tensor is None:
        tensor = torch.empty(meta[0], dtype=meta[1], device=strategy.device_backend.device)
    return strategy.broadcast(tensor.to(strategy.device_backend.device))


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """Concatenate a list of batches (nested lists/tuples/dicts of tensors); a single batch comes back as it is."""
    if isinstance(data[0], (tuple, list)):
        return honor_type(data[0], (concatenate([d[i] for d in data], dim=dim) for i in range(len(data[0]))))
    if isinstance(data[0], Mapping):
        return type(data[0])({k: concatenate([d[k] for d in data], dim=dim) for k in data[0]})
    if torch.is_tensor(data[0]):
        return torch.cat(data, dim=dim)
    if len(data) == 1:
        return data[0]
    raise TypeError(f"concatenate: can only concatenate tensors, not {type(data[0]).__name__} (found in "
                    f"{len(data)} batches)")


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Pad each tensor with zeros along ``dim`` from ``batch_size`` to the next multiple of ``num_processes``.

    A batch of at least one item per process remains (a batch of 1 over 6 processes becomes 6 rows), so that
    it splits evenly across the processes.
    """
    target = max(num_processes, -(-batch_size // num_processes) * num_processes)

    def pad(t: torch.Tensor) -> torch.Tensor:
        shape = list(t.shape)
        shape[dim] = target
        out = t.new_zeros(shape)
        out.narrow(dim, 0, t.shape[dim]).copy_(t)
        return out

    return recursively_apply(pad, tensor, error_on_other_type=True)


def find_batch_size(data: Any) -> int:
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"cannot find the batch size of an empty {type(data).__name__}")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        return find_batch_size(next(iter(data.values())))
    if not torch.is_tensor(data):
        raise TypeError(f"can only find the batch size of tensors, not {type(data).__name__}")
    return data.shape[0]


def find_device(data: Any) -> torch.device | None:
    if torch.is_tensor(data):
        return data.device
    values = data.values() if isinstance(data, Mapping) else data if isinstance(data, (tuple, list)) else ()
    for value in values:
        device = find_device(value)
        if device is not None:
            return device
    return None


def slice_tensors(data: Any, tensor_slice: slice, process_index: int | None = None,
                  num_processes: int | None = None) -> Any:
    return recursively_apply(lambda t: t[tensor_slice], data)


def listify(data: Any) -> Any:
    return recursively_apply(lambda t: t.tolist() if t.ndim else t.item(), data)


_HALF = (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor: Any) -> Any:
    """Cast every fp16/bf16 tensor of a nested structure to fp32 (others unchanged)."""
    if type(tensor) is torch.Tensor:  # the common case, every step: no recursion
        return tensor.float() if tensor.dtype in _HALF else tensor
    return recursively_apply(lambda t: t.float(), tensor,
                             test_type=lambda t: torch.is_tensor(t) and t.dtype in (torch.float16, torch.bfloat16))


class ConvertOutputsToFp32:
    """Wrap a forward so that its half-precision outputs come back as fp32 (picklable)."""

    def __init__(self, model_forward: Callable):
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self):
        raise pickle_error()


def pickle_error() -> Exception:
    import pickle

    return pickle.PicklingError("a model prepared with mixed precision cannot be pickled with its fp32 output "
                                "wrapper: pickle accelerator.unwrap_model(model, keep_fp32_wrapper=False)")


def convert_outputs_to_fp32(model_forward: Callable) -> Callable:
    return ConvertOutputsToFp32(model_forward)


def truncate(data: Any, length: int) -> Any:
    return recursively_apply(lambda t: t[:length] if t.ndim else t, data)
