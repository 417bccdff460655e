"""One pipeline stage cut out of the user's model, without rewriting its ``forward``.

The stage keeps the user's module object (or, for the second and later stages of a rank, a copy
of it) with the modules it does not hold replaced by parameter-free stand-ins, so its parameter
names stay the model's own (``layers.3.mlp.up.weight``):

- modules before the stage (embeddings, earlier blocks) become :class:`Shadow` stand-ins, which
  run their module on the meta device to learn the shape of its output and hand on zeros of that
  shape; the one just before the stage's first block hands on the activation received from the
  previous stage instead (so that every glue computation of the model's forward, such as rotary
  embeddings or attention masks, still runs from the real inputs, which every stage receives);
- the first block after the stage becomes a :class:`Stop`, which ends the forward with its input
  (the activation sent to the next stage); later modules are never reached.

:class:`StageModule` is what torch's ``PipelineStage`` runs (and FSDP's root unit of the stage).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils._pytree import tree_map

from torchbay_fsdp.pipeline.split import SplitPlan


class _StageDone(Exception):
    def __init__(self, value: torch.Tensor):
        super().__init__("pipeline stage finished")
        self.value = value


def _first_tensor(args, kwargs) -> torch.Tensor:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError("a pipeline block was called without a tensor argument")


class Stop(nn.Module):
    """Stands for the first block after the stage: ends the stage's forward with its input."""

    def forward(self, *args, **kwargs):
        raise _StageDone(_first_tensor(args, kwargs))


class Shadow(nn.Module):
    """Stands for a module before the stage: zeros shaped as the module's output (its meta copy tells the
    shape), or, as the module just before the stage, the activation received from the previous stage."""

    def __init__(self, module: nn.Module, inject: bool = False):
        super().__init__()
        object.__setattr__(self, "_meta", [module.to("meta")])  # not a submodule: no parameters, no state
        self.inject = inject
        self.received: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        device = _first_tensor(args, kwargs).device
        to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
        with torch.no_grad():
            out = self._meta[0](*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        placed = [False]

        def realise(t):
            if not isinstance(t, torch.Tensor):
                return t
            if self.inject and not placed[0]:
                placed[0] = True
                return self.received
            return torch.zeros(t.shape, dtype=t.dtype, device=device)

        return tree_map(realise, out)


def model_output(out) -> torch.Tensor:
    """The tensor the last stage hands to the loss function: the output itself, a model output's ``logits``,
    or the first tensor of a tuple or mapping."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    values = out.values() if isinstance(out, dict) else out
    return next(v for v in values if isinstance(v, torch.Tensor))


class StageModule(nn.Module):
    """Runs the user's (stand-in carrying) model as pipeline stage ``index``: the first stage from the batch's
    inputs, the others from the received activation (the batch's inputs come too, as keyword ``inputs``)."""

    def __init__(self, model: nn.Module, index: int, num_stages: int, inject: Shadow | None):
        super().__init__()
        self.module = model
        self.index, self.num_stages = index, num_stages
        object.__setattr__(self, "_inject", inject)

    def forward(self, *received, inputs=(), input_kwargs=None):
        if self._inject is not None:
            self._inject.received = received[0]
        try:
            out = model_output(self.module(*inputs, **(input_kwargs or {})))
        except _StageDone as done:
            out = done.value
        finally:
            if self._inject is not None:
                self._inject.received = None
        # a view would lose FSDP2's pre-backward hook to any in-place op on it (torch warns): hand on a tensor
        return out.clone() if out._is_view() else out


def cut(model: nn.Module, plan: SplitPlan, index: int, copy_model: bool) -> StageModule:
    """Stage ``index`` of ``model`` (a copy of it when ``copy_model``: a rank's further stages); the modules
    it does not hold are moved to the meta device (their memory freed) and replaced by stand-ins."""
    if copy_model:
        model = _copy_structure(model)
    start, stop = plan.ranges[index]
    blocks = model.get_submodule(plan.blocks)
    last = index == plan.num_stages - 1
    inject = None
    if index > 0:
        for name in plan.pre:
            _replace(model, name, Shadow(model.get_submodule(name)))
        for i in range(start):
            shadow = Shadow(blocks[i], inject=i == start - 1)
            blocks[i] = shadow
            inject = shadow if i == start - 1 else inject
    if not last:
        for i in range(stop, plan.num_blocks):
            blocks[i].to("meta")
            blocks[i] = Stop()
        for name in plan.post:
            _replace(model, name, Stop())
    return StageModule(model, index, plan.num_stages, inject)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    old = model.get_submodule(name)
    if not isinstance(new, Shadow):
        old.to("meta")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _copy_structure(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are its own (deep copy)."""
    return copy.deepcopy(model)


def materialize(stage: StageModule, device: torch.device) -> None:
    """A stage built on the meta device: allocate its own parameters and buffers on ``device`` and initialise
    each module with its ``reset_parameters`` (or the model's ``init_weights``/``_init_weights`` where it has
    one), so that each rank only ever holds its stage."""
    model = stage.module
    if not any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        return
    model.to_empty(device=device)
    init = getattr(model, "_init_weights", None)
    for module in model.modules():
        if isinstance(module, (Shadow, Stop)):
            continue
        if callable(init) and module is not model:
            init(module)
        elif hasattr(module, "reset_parameters") and module is not model:
            module.reset_parameters()
    rope_init = [m for m in model.modules() if hasattr(m, "rope_init_fn") and hasattr(m, "inv_freq")]
    for rope in rope_init:  # Hugging Face rotary embeddings: a non-persistent buffer computed at init
        inv_freq, scaling = rope.rope_init_fn(rope.config, device)
        rope.inv_freq = inv_freq
        rope.original_inv_freq = inv_freq
        rope.attention_scaling = scaling
