"""The training step under DeepSpeed: the engine's backward and step, told whether this micro-batch synchronises."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from torchbay.errors import ConfigError, TorchbayError
from torchbay_deepspeed.engine import EngineRecord


class DeepSpeedStep:
    """Every step of a DeepSpeed run goes through its engine: backward (which also steps at the end of an accumulation
    window), no_sync, the optimizer step and gradient clipping; a mixin of
    :class:`~torchbay_deepspeed.strategy.DeepSpeedStrategy`."""

    # -- every step ------------------------------------------------------------------------
    def _record_for_backward(self, loss: torch.Tensor, model: Any) -> EngineRecord:
        if model is not None:
            rec = self._record(model)
            if not rec.trains:
                raise TorchbayError(f"model {rec.index} has no optimizer in DeepSpeed; prepare its optimizer")
            return rec
        training = [r for r in self.records if r.trains]
        if len(training) == 1:
            return training[0]
        if not training:
            pending = [r for r in self.records if r.pending is not None and r.engine is None]
            hint = " (a model is waiting for its optimizer: prepare it)" if pending else ""
            raise TorchbayError(f"accelerator.backward: no DeepSpeed engine has an optimizer{hint}")
        leaves = _graph_leaves(loss)
        hit = [r for r in training if r.param_ids & leaves]
        if len(hit) == 1:
            return hit[0]
        names = ", ".join(f"{r.index} ({type(r.module).__name__})" for r in (hit or training))
        raise TorchbayError(f"accelerator.backward: the loss reaches several trained models ({names}); pass "
                            f"model=<the one to update> to accelerator.backward")

    def backward(self, loss: torch.Tensor, model: Any = None, *, sync_gradients: bool = True, **kwargs) -> None:
        rec = self._record_for_backward(loss, model)
        engine = rec.engine
        sync = sync_gradients
        engine.set_gradient_accumulation_boundary(sync)
        if set(kwargs) - {"retain_graph", "scale_wrt_gas"}:
            raise TorchbayError(f"accelerator.backward under DeepSpeed takes retain_graph, scale_wrt_gas and model "
                                f"only, not {', '.join(sorted(set(kwargs) - {'retain_graph', 'scale_wrt_gas'}))}")
        engine.backward(loss, retain_graph=bool(kwargs.get("retain_graph", False)),
                        scale_wrt_gas=bool(kwargs.get("scale_wrt_gas", True)))
        if rec.measure_norm and sync:  # gradients are all-reduced by now; the step clips and zeroes them
            grads = [p.grad for p in rec.module.parameters() if p.grad is not None]
            rec.last_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        engine.step()

    def no_sync(self, model: Any):
        return contextlib.nullcontext()  # DeepSpeed knows the accumulation boundary from backward

    def optimizer_step(self, optimizer: Any, **kwargs) -> Any:
        return optimizer.step(**kwargs)  # EngineOptimizer.step: the engine already stepped

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        ids = {id(p) for p in params}
        rec = next((r for r in self.records if r.trains and r.param_ids & ids), None)
        if rec is None:
            raise TorchbayError("clip_grad_norm_: these parameters belong to no trained DeepSpeed engine")
        clip = rec.engine.gradient_clipping()
        if norm_type != 2.0 or not clip or abs(clip - max_norm) > 1e-9 * max(1.0, abs(max_norm)):
            raise ConfigError(
                f"under strategy deepspeed, gradients are clipped inside DeepSpeed's step (L2 norm only): set "
                f"deepspeed.gradient_clipping: {max_norm} (it is {clip or 'not set'}); clip_grad_norm_ then returns "
                f"the norm DeepSpeed measured")
        norm = rec.last_norm if rec.measure_norm else rec.engine.get_global_grad_norm()
        return torch.tensor(float("nan") if norm is None else float(norm))

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        raise ConfigError("clip_grad_value_ is not available under strategy deepspeed; use deepspeed.gradient_clipping "
                          "(norm clipping)")


def _graph_leaves(loss: torch.Tensor) -> set:
    """ids of the leaf tensors (parameters) the loss's autograd graph accumulates into."""
    ids: set = set()
    seen: set = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            ids.add(id(var))
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return ids
