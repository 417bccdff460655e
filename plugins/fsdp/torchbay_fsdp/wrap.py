"""Wrapping models for FSDP: FSDP2's ``fully_shard`` on the blocks a wrap policy names (FSDP1 where torch
allows), with activation checkpointing, CPU offload and mixed-precision policies, and the optimizers remapped."""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from torchbay.errors import TorchbayError
from torchbay_fsdp.tensor_parallel import apply_tensor_parallel, model_plan

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.plugin import DeviceBackend, RunContext
    from torchbay_fsdp.config import FSDPConfig


class FSDPWrapping:
    """How FSDP wraps the prepared models: FSDP2 ``fully_shard`` per block (or FSDP1), the optimizers remapped onto the
    sharded parameters, rank 0's weights broadcast when only it loaded them; a mixin of
    :class:`~torchbay_fsdp.strategy.FSDPStrategy`."""

    # what wrapping reads of the strategy (the Strategy base's and FSDPStrategy's own, made in its __init__)
    context: RunContext
    settings: FSDPConfig
    device_backend: DeviceBackend
    rank: int
    world_size: int
    sizes: dict[str, int]  # the parallel dimensions' sizes
    device_mesh: Any  # the named DeviceMesh
    mesh: Any  # the mesh FSDP shards over
    tp_plans: list[dict]
    _param_map: dict[int, tuple[Any, torch.nn.Parameter]]  # id of an original parameter -> its module, sharded one
    _optimizers: list[Any]  # the raw optimizers seen by setup
    _roots: list[torch.nn.Module]  # the wrapped models
    _mixed_precision_dtypes: Callable[[], tuple[torch.dtype | None, torch.dtype | None]]

    # -- wrapping -----------------------------------------------------------------------
    def setup(self, models: list, optimizers: list, schedulers: list) -> tuple[list, list, list]:
        models = [self.wrap_model(m) for m in models]
        self._optimizers += [getattr(o, "optimizer", o) for o in optimizers]
        for opt in self._optimizers:  # also those prepared in an earlier call, before their model
            self._remap_optimizer(opt)
        return models, optimizers, schedulers

    def teardown(self, barrier: bool = True) -> None:
        """Destroy the group, and let go of it in every FSDP unit.

        FSDP2's parameter groups hold the C++ process group (``mesh_info``); still alive at
        interpreter exit, gloo's threads can abort a rank after a successful run (as with
        DDP's reducer). The units cannot communicate once the group is gone anyway.
        """
        super().teardown(barrier)
        for root in self._roots:
            for module in root.modules():
                get_state = getattr(module, "_get_fsdp_state", None)
                state = get_state() if callable(get_state) else None
                for group in getattr(state, "_fsdp_param_groups", None) or []:
                    for info in (getattr(group, "mesh_info", None), getattr(group, "post_forward_mesh_info", None)):
                        for attribute in ("shard_process_group", "replicate_process_group",
                                          "reduce_scatter_process_group"):
                            if info is not None and getattr(info, attribute, None) is not None:
                                setattr(info, attribute, None)
            if hasattr(root, "process_group"):  # FSDP1
                with contextlib.suppress(AttributeError):
                    root.process_group = None
        self._mesh, self._flat = None, {}
        gc.collect()

    def is_wrapped(self, model: Any) -> bool:
        if "torch.distributed.fsdp" not in sys.modules:
            return False
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        return isinstance(model, (FSDPModule, FullyShardedDataParallel))

    def unwrap_model(self, model: Any) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        # FSDP2 shards in place: the prepared model *is* the user's module (its class gains FSDPModule)
        return model.module if isinstance(model, FullyShardedDataParallel) else model

    def compile_targets(self, model: Any, regional: bool = False) -> list[torch.nn.Module]:
        """FSDP2: each sharded block on its own, regional or not (the blocks' all-gather and reshard
        hooks run between the compiled blocks, as torch advises for FSDP2); else the default."""
        from torch.distributed.fsdp import FSDPModule

        if self.settings.version == 2:
            units = [m for m in model.modules() if m is not model and isinstance(m, FSDPModule)]
            if units:
                return units
        return super().compile_targets(model, regional)

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.is_wrapped(model):
            return model
        before = dict(model.named_parameters())
        blocks = self._blocks(model)
        if self.settings.activation_checkpointing:
            if not blocks:
                raise TorchbayError("fsdp.activation_checkpointing: the wrap policy found no blocks in "
                                    f"{type(model).__name__}; set fsdp.transformer_layer_cls_to_wrap")
            from torch.distributed._composable import checkpoint

            for block in blocks:
                checkpoint(block)  # keeps parameter names, unlike checkpoint_wrapper
        if self.sizes["tp"] > 1:
            self._apply_tensor_parallel(model)
        if self.settings.version == 1:
            wrapped = self._wrap_fsdp1(model, blocks)
        else:
            wrapped = self._wrap_fsdp2(model, blocks)
        after = dict(wrapped.named_parameters())
        for name, old in before.items():
            new = after.get(name)
            if new is not None and new is not old and old.device.type != "meta":
                self._param_map[id(old)] = (weakref.ref(old), new)
        self._roots.append(wrapped)
        return wrapped

    def _apply_tensor_parallel(self, model: torch.nn.Module) -> None:
        """The user's plan (parallelism.tp_plan), else the model's own tp_plan / _tp_plan."""
        plan, where = self.context.config.parallelism.tp_plan, "parallelism.tp_plan"
        if not plan:
            plan, where = model_plan(model), f"{type(model).__name__}.tp_plan"
        if not plan:
            raise TorchbayError(f"parallelism.tp_size is {self.sizes['tp']} but no tensor parallel plan is known for "
                                f"{type(model).__name__}: set parallelism.tp_plan (e.g. {{'blocks.*.up': 'colwise', "
                                f"'blocks.*.down': 'rowwise'}}) or give the model a tp_plan attribute")
        self.tp_plans.append(apply_tensor_parallel(model, self.device_mesh["tp"], plan, self.sizes["tp"], where))

    def _blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The submodules that become FSDP units, in pre-order (wrap them in reverse: bottom-up)."""
        s = self.settings
        if s.wrap_policy == "none":
            return []
        if s.wrap_policy == "transformer":
            names = set(s.transformer_layer_cls_to_wrap) or set(getattr(model, "_no_split_modules", None) or [])
            present = {type(m).__name__ for m in model.modules()}
            missing = sorted(set(s.transformer_layer_cls_to_wrap) - present)
            if missing:
                raise TorchbayError(f"fsdp.transformer_layer_cls_to_wrap names {missing}, not found in "
                                    f"{type(model).__name__} (its classes: {', '.join(sorted(present))})")
            return [m for m in model.modules() if m is not model and type(m).__name__ in names]
        # size: bottom-up, a submodule whose not-yet-wrapped parameters reach min_num_params
        chosen: list[torch.nn.Module] = []
        claimed: set[int] = set()

        def visit(module: torch.nn.Module) -> None:
            for child in module.children():
                visit(child)
            if module is model:
                return
            own = [p for p in module.parameters() if id(p) not in claimed]
            if sum(p.numel() for p in own) >= s.min_num_params:
                chosen.append(module)
                claimed.update(id(p) for p in own)

        visit(model)
        order = {id(m): i for i, m in enumerate(model.modules())}
        return sorted(chosen, key=lambda m: order[id(m)])

    def _wrap_fsdp2(self, model: torch.nn.Module, blocks: list[torch.nn.Module]) -> torch.nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        s = self.settings
        device = self.device_backend.device
        param_dtype, reduce_dtype = self._mixed_precision_dtypes()
        kwargs = {
            "mesh": self.mesh,
            "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
            "offload_policy": CPUOffloadPolicy(pin_memory=device.type != "cpu") if s.cpu_offload else OffloadPolicy(),
        }
        full_state, loose_buffers = None, {}
        if s.cpu_ram_efficient_loading:
            full_state, loose_buffers = self._take_rank0_weights(model)
        for block in reversed(blocks):
            fully_shard(block, reshard_after_forward=s.reshard_after_forward, **kwargs)
        # the root is needed first in backward: PyTorch's default (None) keeps it gathered
        root_reshard = None if (blocks and s.reshard_after_forward) else s.reshard_after_forward
        fully_shard(model, reshard_after_forward=root_reshard, **kwargs)
        if s.cpu_ram_efficient_loading:
            self._fill_from_rank0(model, full_state, loose_buffers)
        return model

    def _take_rank0_weights(self, model: torch.nn.Module) -> tuple[dict | None, dict]:
        """Keep rank 0's weights aside and move every rank's model to meta before sharding."""
        persistent = set(model.state_dict().keys())
        full_state = None
        loose = {}
        if self.rank == 0:
            if any(t.device.type == "meta" for t in model.state_dict().values()):
                raise TorchbayError("fsdp.cpu_ram_efficient_loading: rank 0 must build the model with real weights "
                                    "(only the other ranks may use torch.device('meta'))")
            full_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            loose = {k: b.detach().clone() for k, b in model.named_buffers() if k not in persistent}
        model.to("meta")
        return full_state, loose

    def _fill_from_rank0(self, model: torch.nn.Module, full_state: dict | None, loose: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model.to_empty(device=self.device_backend.device)
        set_model_state_dict(model, full_state or {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        persistent = set(model.state_dict().keys())
        for name, buf in model.named_buffers():  # non-persistent buffers are not in any state dict
            if name in persistent:
                continue
            if self.rank == 0:
                buf.copy_(loose[name])
            if self.world_size > 1:
                dist.broadcast(buf, src=0)

    def _wrap_fsdp1(self, model: torch.nn.Module, blocks: list[torch.nn.Module]) -> torch.nn.Module:
        from torch.distributed.fsdp import (
            BackwardPrefetch,
            CPUOffload,
            FullyShardedDataParallel,
            MixedPrecision,
            ShardingStrategy,
        )
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        s = self.settings
        param_dtype, reduce_dtype = self._mixed_precision_dtypes()
        block_ids = {id(b) for b in blocks}
        kwargs: dict[str, Any] = {
            "sharding_strategy": (ShardingStrategy.FULL_SHARD if s.reshard_after_forward
                                  else ShardingStrategy.SHARD_GRAD_OP),
            "cpu_offload": CPUOffload(offload_params=s.cpu_offload),
            "auto_wrap_policy": functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in block_ids)
            if blocks else None,
            "device_id": self.device_backend.device,
            "use_orig_params": True,
            "process_group": self.mesh.get_group(),
        }
        if param_dtype is not None or reduce_dtype is not None:
            kwargs["mixed_precision"] = MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                       buffer_dtype=param_dtype)
        if s.backward_prefetch is not None:
            kwargs["backward_prefetch"] = (None if s.backward_prefetch == "NO_PREFETCH"
                                           else BackwardPrefetch[s.backward_prefetch])
        if s.cpu_ram_efficient_loading:
            kwargs["sync_module_states"] = True
            if self.rank != 0:
                kwargs["param_init_fn"] = lambda m: m.to_empty(device=self.device_backend.device, recurse=False)
        return FullyShardedDataParallel(model, **kwargs)

    def _remap_optimizer(self, optimizer: Any) -> None:
        """Point an optimizer built before sharding at the sharded parameters."""
        changed = False
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                entry = self._param_map.get(id(p))
                if entry is not None and entry[0]() is p:
                    params.append(entry[1])
                    changed = True
                else:
                    params.append(p)
            group["params"] = params
        if changed and optimizer.state:
            raise TorchbayError("an optimizer that already has state (it has stepped) was prepared with a model that "
                                "fsdp then sharded; prepare the model and optimizer before the first step")
