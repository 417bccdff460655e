"""The prepared model of a pipeline-parallel run: this rank's stages, under the model's own names.

:class:`PipelineModel` holds, at their original dotted paths, the modules of the stages this rank
runs (``named_parameters``/``state_dict`` give ``layers.3.mlp.up.weight`` as the user's model
does, so DCP checkpoints, optimizers and ``get_state_dict`` see the model's names), and the torch
schedule that runs them. :meth:`PipelineModel.loss` is what ``accelerator.pipeline_loss`` calls:
one training step (forward and backward over the micro-batches) or, in eval mode or under
``torch.no_grad()``, forward only; it returns the batch's loss on every rank of the pipeline.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from torchbay.errors import ConfigError, TorchbayError
from torchbay_fsdp.pipeline.reduction import reduction_deferred


class PipelineModel(nn.Module):
    """This rank's pipeline stages (see the module docstring). Calling it directly is refused: the batch runs
    through every stage's rank at once, so the loop calls ``accelerator.pipeline_loss(model, inputs, target,
    loss_fn)``."""

    def __init__(self, stages: list, torch_stages: list, schedule_name: str, n_microbatches: int,
                 group: Any, last_stage_group_rank: int, plan: Any):
        super().__init__()
        self._stage_modules = stages  # StageModule objects (FSDP roots), not submodules: names stay the model's
        self.torch_stages = torch_stages
        self.schedule_name = schedule_name
        self.n_microbatches = n_microbatches
        self.group = group
        self.last_stage_group_rank = last_stage_group_rank
        self.plan = plan
        self._loss_fn: Callable | None = None
        self._scale = 1.0
        self._reduce = True  # False inside accelerator.accumulate's non-final steps (gradient_sync_off)
        self.schedule = None  # built by the strategy once the stages exist
        self.eval_schedule = None  # forward only, where the schedule's own eval cannot run
        self.state_order: list[str] = []  # the user's model's state-dict keys, in its order (set by the strategy)
        for stage in stages:
            for name, module in _held_modules(stage.module, plan, stage.index):
                _set_path(self, name, module)

    @property
    def stage_indices(self) -> list[int]:
        return [s.index for s in self._stage_modules]

    @property
    def holds_last_stage(self) -> bool:
        return any(s.index == s.num_stages - 1 for s in self._stage_modules)

    def train(self, mode: bool = True):
        super().train(mode)
        for stage in self._stage_modules:  # also the parameter-free modules no stage shows under its name
            stage.train(mode)
        return self

    def forward(self, *args, **kwargs):
        raise TorchbayError("a pipeline-parallel model (parallelism.pp_size > 1) is not called directly: each rank "
                            "holds some of its stages; compute the loss with accelerator.pipeline_loss(model, inputs, "
                            "target, loss_fn) (docs/parallelism.md, 'Pipeline parallel')")

    @contextlib.contextmanager
    def gradient_sync_off(self) -> Iterator[None]:
        """The strategy's ``no_sync``: training steps run inside keep their gradients unsharded and accumulated
        (:mod:`.reduction`); the next step outside reduces the window's sum once."""
        self._reduce = False
        try:
            yield
        finally:
            self._reduce = True

    def scheduled_loss(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        """The schedule's loss function: the user's, divided by the micro-batches and the accumulation steps."""
        return self._loss_fn(output, target) * self._scale

    def loss(self, inputs: tuple, input_kwargs: dict, target: Any, loss_fn: Callable, scale: float = 1.0):
        """Run the batch through the pipeline; the mean micro-batch loss, on every rank of the pipeline."""
        batch = _batch_size(inputs, input_kwargs)
        if batch % self.n_microbatches:
            raise ConfigError(f"parallelism.pp_microbatches {self.n_microbatches}: the batch of {batch} samples does "
                              f"not split into {self.n_microbatches} equal micro-batches; make the per-process batch "
                              f"size a multiple of pp_microbatches (or change pp_microbatches)")
        train = self.training and torch.is_grad_enabled()
        # each micro-batch's share of the step's gradient (the schedule does not scale them: build_schedule)
        self._loss_fn, self._scale = loss_fn, (scale / self.n_microbatches if train else 1.0)
        losses: list[torch.Tensor] = []
        kwargs = {"inputs": tuple(inputs), "input_kwargs": dict(input_kwargs or {})}
        try:
            if train:
                with contextlib.nullcontext() if self._reduce else reduction_deferred(self.torch_stages):
                    self.schedule.step(target=target, losses=losses, return_outputs=False, **kwargs)
            else:
                (self.eval_schedule or self.schedule).eval(target=target, losses=losses, **kwargs)
        except Exception as exc:  # the launcher's failure report shows the note with the traceback
            stages = ", ".join(str(i) for i in self.stage_indices)
            exc.add_note(f"torchbay: inside the pipeline schedule {self.schedule_name} "
                         f"({'training step' if train else 'forward only'}), on the rank holding pipeline "
                         f"stage(s) {stages} of {self.plan.num_stages}")
            raise
        finally:
            self._loss_fn = None
        device = self.torch_stages[0].device
        if losses:
            value = torch.stack([loss.detach().float() for loss in losses]).mean() / self._scale
        else:
            value = torch.zeros((), device=device)
        value = value.to(device)
        if dist.get_world_size(self.group) > 1:
            dist.broadcast(value, group=self.group, group_src=self.last_stage_group_rank)
        return value


def _batch_size(inputs: tuple, kwargs: dict) -> int:
    for value in list(inputs) + list((kwargs or {}).values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise TorchbayError("accelerator.pipeline_loss: the inputs hold no batched tensor to cut into micro-batches")


def _held_modules(model: nn.Module, plan: Any, stage: int) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that stage ``stage`` holds, by dotted name: its blocks, and its pre/post modules
    and parameter-holding glue."""
    out = []
    start, stop = plan.ranges[stage]
    blocks = model.get_submodule(plan.blocks)
    out += [(f"{plan.blocks}.{i}", blocks[i]) for i in range(start, stop)]
    for name in (plan.pre if stage == 0 else ()) + (plan.post if stage == plan.num_stages - 1 else ()):
        out.append((name, model.get_submodule(name)))
    for name, module in model.named_modules():  # glue with its own parameters or persistent buffers
        if not name or name == plan.blocks or name.startswith(plan.blocks + ".") or \
                any(name == p or name.startswith(p + ".") for p in plan.pre + plan.post):
            continue
        if next(module.parameters(recurse=False), None) is not None or module._buffers:
            out.append((name, module))
    return out


def _set_path(root: nn.Module, name: str, module: nn.Module) -> None:
    parent = root
    parts = name.split(".")
    for part in parts[:-1]:
        child = parent._modules.get(part)
        if child is None:
            child = nn.Module()
            parent.add_module(part, child)
        parent = child
    if parts[-1] not in parent._modules:
        parent.add_module(parts[-1], module)
