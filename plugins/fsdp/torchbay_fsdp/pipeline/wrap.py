"""The fsdp strategy's pipeline-parallel part (``parallelism.pp_size`` > 1), a mixin of
:class:`~torchbay_fsdp.strategy.FSDPStrategy`: cut the prepared model into this rank's stages, shard
each stage with FSDP2 over the data-parallel part of the mesh, hand the stages to torch's
``PipelineStage`` and schedule, and make the strategy's every-step methods pipeline-aware (the
loss, backward, the global gradient norm, the full state dict)."""

from __future__ import annotations

import copy
import math
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from torchbay.errors import ConfigError
from torchbay_fsdp.parallel import sub_mesh
from torchbay_fsdp.pipeline.model import PipelineModel
from torchbay_fsdp.pipeline.schedule import build_eval_schedule, build_schedule, microbatches, stage_indices
from torchbay_fsdp.pipeline.split import plan_split
from torchbay_fsdp.pipeline.stage import Shadow, Stop, cut, materialize

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.plugin import DeviceBackend, RunContext


def check_pipeline_combination(config: Any, world_size: int) -> list[str]:
    """What pipeline parallel cannot be combined with (no process group, no model)."""
    section, s = config.parallelism, config.fsdp
    if section.pp_size == 1:
        return []
    problems = []
    where = f"parallelism.pp_size {section.pp_size}"
    if s.version == 1:
        problems.append(f"{where} needs fsdp.version 2 (each stage is sharded with fully_shard); set fsdp.version: 2")
    if section.cp_size > 1:
        problems.append(f"{where} with cp_size > 1 is not supported yet; combine pp with dp_shard, dp_replicate or "
                        f"tp, or set pp_size 1")
    for name, what in (("sp_size", "Ulysses sequence parallel"), ("ep_size", "expert parallel")):
        if (getattr(section, name, 1) or 1) > 1:
            problems.append(f"{where} with {name} {getattr(section, name)} ({what}) is not supported yet: the "
                            f"pipeline stages run the model's blocks without the all-to-all it needs; set {name} 1 "
                            f"or pp_size 1")
    if s.cpu_ram_efficient_loading:
        problems.append(f"{where} with fsdp.cpu_ram_efficient_loading: each rank already builds only its stage (build "
                        f"the model under torch.device('meta')); set cpu_ram_efficient_loading: false")
    if config.mixed_precision == "fp16":
        problems.append(f"{where} with mixed_precision fp16: the loss scaler cannot scale the losses inside the "
                        f"pipeline schedule; use bf16 (or no mixed precision)")
    return problems


class PipelineWrapping:
    """Pipeline-parallel wrapping and every-step methods (see the module docstring)."""

    context: RunContext
    device_backend: DeviceBackend
    sizes: dict[str, int]
    device_mesh: Any
    settings: Any
    rank: int
    mesh: Any  # the mesh FSDP shards each stage over
    _param_map: dict
    _roots: list
    _optimizers: list
    _blocks: Callable[[torch.nn.Module], list]  # FSDPWrapping's: the blocks that become FSDP units
    _wrap_fsdp2: Callable[[torch.nn.Module, list], torch.nn.Module]
    _apply_tensor_parallel: Callable[[torch.nn.Module], None]

    @property
    def pipeline_enabled(self) -> bool:
        return self.sizes.get("pp", 1) > 1

    def _pp_state(self) -> dict:
        return self.__dict__.setdefault("_pipeline", {"dropped": {}, "ran": False})

    # -- wrapping ------------------------------------------------------------------------------
    def wrap_pipeline(self, model: torch.nn.Module) -> PipelineModel:
        section = self.context.config.parallelism
        pp = self.sizes["pp"]
        pp_mesh = sub_mesh(self.device_mesh, ["pp"])
        pp_rank, group = pp_mesh.get_local_rank(), pp_mesh.get_group()
        indices = stage_indices(section.pp_schedule, pp_rank, pp, section.pp_virtual_stages)
        num_stages = pp * len(indices)
        plan = plan_split(model, num_stages, list(section.pp_split_points) or None)
        before = dict(model.named_parameters())
        order = list(model.state_dict(keep_vars=True))
        models = [model] + [copy.deepcopy(model) for _ in indices[1:]]  # copies of the untouched model
        device = self.device_backend.device
        stages = [cut(m, plan, index, copy_model=False) for m, index in zip(models, indices)]
        for stage in stages:
            materialize(stage, device)
            stage.to(device)
            if self.sizes["tp"] > 1:  # the plan's patterns match this stage's blocks (the others are stand-ins)
                self._apply_tensor_parallel(stage.module)
            blocks = [b for b in self._blocks(stage.module) if not isinstance(b, (Shadow, Stop))]
            if self.settings.activation_checkpointing:
                from torch.distributed._composable import checkpoint

                for block in blocks:
                    checkpoint(block)
            if self.mesh.size() > 1:  # a stage without data parallel needs no FSDP units
                self._wrap_fsdp2(stage, blocks)
                if "ZeroBubble" in section.pp_schedule:  # a weight-gradient step can come after the next forward:
                    stage.set_reshard_after_forward(False)  # its weights stay gathered until the step's reduction
            self._roots.append(stage)
        from torch.distributed.pipelining import PipelineStage

        torch_stages = [PipelineStage(stage, index, num_stages, device, group=group)
                        for stage, index in zip(stages, indices)]
        last = num_stages - 1
        last_rank = next(r for r in range(pp) if last in stage_indices(section.pp_schedule, r, pp,
                                                                        section.pp_virtual_stages))
        n_micro = microbatches(section)
        wrapped = PipelineModel(stages, torch_stages, section.pp_schedule, n_micro, group, last_rank, plan)
        wrapped.schedule = build_schedule(section.pp_schedule, torch_stages, n_micro, wrapped.scheduled_loss)
        wrapped.eval_schedule = build_eval_schedule(section.pp_schedule, pp, section.pp_virtual_stages, torch_stages,
                                                    n_micro, wrapped.scheduled_loss)
        wrapped.train(model.training)
        wrapped.state_order = order
        after = dict(wrapped.named_parameters())
        dropped = self._pp_state()["dropped"]
        for name, old in before.items():
            new = after.get(name)
            if new is None:
                dropped[id(old)] = weakref.ref(old)
            elif new is not old:
                self._param_map[id(old)] = (weakref.ref(old), new)
        return wrapped

    def drop_foreign_parameters(self, optimizer: Any) -> None:
        """Remove from an optimizer built on the whole model the parameters of the stages other ranks hold."""
        dropped = self._pp_state()["dropped"]
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if not (id(p) in dropped and dropped[id(p)]() is p)]

    # -- every step ----------------------------------------------------------------------------
    def pipeline_loss(self, model: Any, inputs: tuple, kwargs: dict, target: Any, loss_fn: Any,
                      accumulation_steps: int = 1) -> torch.Tensor:
        if not isinstance(model, PipelineModel):
            return super().pipeline_loss(model, inputs, kwargs, target, loss_fn, accumulation_steps)
        train = model.training and torch.is_grad_enabled()
        loss = model.loss(inputs, kwargs, target, loss_fn, scale=1.0 / accumulation_steps if train else 1.0)
        self._pp_state()["ran"] = train
        return loss

    def backward(self, loss: torch.Tensor, model: Any = None, *, sync_gradients: bool = True, **kwargs) -> None:
        state = self._pp_state()
        if state["ran"]:  # the schedule ran the backward of the loss accelerator.pipeline_loss returned
            state["ran"] = False
            return
        if self.pipeline_enabled and not loss.requires_grad:
            raise ConfigError("accelerator.backward: under parallelism.pp_size > 1 the loss comes from "
                              "accelerator.pipeline_loss(model, inputs, target, loss_fn), which also runs the "
                              "backward; call it once per accelerator.backward")
        super().backward(loss, model, sync_gradients=sync_gradients, **kwargs)

    def pipeline_total_norm(self, total: torch.Tensor, norm_type: float) -> torch.Tensor:
        """This rank's gradient norm made the pipeline's: combined over the ``pp`` ranks (which hold
        different parameters)."""
        if not self.pipeline_enabled:
            return total
        group = sub_mesh(self.device_mesh, ["pp"]).get_group()
        total = total.detach().float().to(self.device_backend.device)
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
            return total
        powered = total ** norm_type
        dist.all_reduce(powered, group=group)
        return powered ** (1.0 / norm_type)

    # -- state -------------------------------------------------------------------------------------
    def pipeline_state_dict(self, model: PipelineModel) -> dict[str, torch.Tensor]:
        """The full state dict on rank 0 (CPU tensors; every stage's, under the model's names), empty
        elsewhere; every rank must call it."""
        from torch.distributed.tensor import DTensor

        local = {}
        for name, value in model.state_dict().items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            local[name] = value.detach().cpu()
        mesh = self.device_mesh
        first_of_data = all(mesh.get_local_rank(n) == 0 for n in mesh.mesh_dim_names if n != "pp")
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(local if first_of_data else None, gathered, dst=0)
        if self.rank != 0:
            return {}
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part or {})
        ordered = {name: merged.pop(name) for name in model.state_order if name in merged}
        return {**ordered, **merged}

    # -- the strategy's methods, pipeline-aware ----------------------------------------------------
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.pipeline_enabled and not isinstance(model, PipelineModel):
            return self.wrap_pipeline(model)
        return super().wrap_model(model)

    def setup(self, models: list, optimizers: list, schedulers: list) -> tuple[list, list, list]:
        out = super().setup(models, optimizers, schedulers)
        if self.pipeline_enabled:
            for opt in self._optimizers:
                self.drop_foreign_parameters(opt)
        return out

    def is_wrapped(self, model: Any) -> bool:
        return isinstance(model, PipelineModel) or super().is_wrapped(model)

    def model_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        if isinstance(model, PipelineModel):
            return self.pipeline_state_dict(model)
        return super().model_state_dict(model)
