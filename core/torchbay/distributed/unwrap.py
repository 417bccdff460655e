"""What ``unwrap_model`` and ``extract_model_from_parallel`` take off a model: ``torch.compile``'s wrapper
(kept around the result unless asked otherwise), the strategy's wrapper, a user's own ``DataParallel`` or
``DistributedDataParallel``, and with ``keep_fp32_wrapper=False`` the mixed-precision forward, as Accelerate does."""

from __future__ import annotations

from typing import Any, Callable

import torch

#: containers a user may wrap a model in before (or instead of) prepare
_PARALLEL_CONTAINERS = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)


def _compiled_wrapper(model: Any) -> tuple[Any, Any]:
    """``(wrapper, inner)`` for a ``torch.compile`` result or Accelerate-style regional copy, else ``(None, model)``."""
    if hasattr(torch, "_dynamo") and isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return model, model._orig_mod
    if isinstance(model, torch.nn.Module) and isinstance(model.__dict__.get("_orig_mod"), torch.nn.Module):
        return model, model.__dict__["_orig_mod"]
    return None, model


def _rewrap(wrapper: Any, inner: Any) -> Any:
    """Put the unwrapped module back inside the compiled wrapper (as Accelerate does, on the same object)."""
    if isinstance(wrapper, torch._dynamo.eval_frame.OptimizedModule):
        wrapper._orig_mod = inner
    else:
        wrapper.__dict__["_orig_mod"] = inner
    return wrapper


def remove_fp32_wrapper(model: Any) -> None:
    """Restore the forward that mixed precision replaced in ``prepare`` (no-op if it did not).

    A forward wrapped by hand as Accelerate's users do (``model._original_forward = model.forward`` then
    ``model.forward = convert_outputs_to_fp32(model.forward)``) is restored too.
    """
    if hasattr(model, "_torchbay_original_forward"):
        model.forward = model._torchbay_original_forward
        del model._torchbay_original_forward
    original = model.__dict__.pop("_original_forward", None) if hasattr(model, "__dict__") else None
    if original is None:
        return
    if getattr(original, "__self__", None) is model and \
            getattr(original, "__func__", None) is getattr(type(model), "forward", None):
        model.__dict__.pop("forward", None)  # the class's own forward again: the model pickles as it did
    else:
        model.forward = original


def unwrap(model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
           strategy_unwrap: Callable[[Any], Any] | None = None) -> Any:
    """The user's module inside ``model``'s wrappers; see the module docstring."""
    compiled, inner = _compiled_wrapper(model)
    if strategy_unwrap is not None:
        inner = strategy_unwrap(inner)
    while isinstance(inner, _PARALLEL_CONTAINERS) or (
            hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module) and strategy_unwrap is None):
        inner = inner.module
    if not keep_fp32_wrapper:
        remove_fp32_wrapper(inner)
    if compiled is not None and keep_torch_compile:
        return _rewrap(compiled, inner)
    return inner
