"""The ``fsdp`` strategy: FSDP2 (``fully_shard``) by default, FSDP1 as ``fsdp.version: 1``.

``torch.distributed.fsdp`` and ``torch.distributed.checkpoint`` are imported when a
strategy object is built or used, never when this module is imported (the plugin is
loaded in every torchbay process, most of which never select it).
"""

from __future__ import annotations

import contextlib
import gc
import json
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchbay.errors import CheckpointError, TorchbayError
from torchbay.strategy import MemoryEstimate, Strategy, optimizer_owners

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.checkpoint_io import CheckpointIO
    from torchbay.context import RunContext

#: the file save_checkpoint writes next to the sharded state (read by ``torchbay merge-weights``)
INFO_FILE = "fsdp_checkpoint.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def model_dir(i: int) -> str:
    return f"fsdp_model_{i}"


def optimizer_dir(i: int) -> str:
    return f"fsdp_optimizer_{i}"


class FSDPStrategy(Strategy):
    """Shard parameters, gradients and optimizer state across the processes."""

    name = "fsdp"
    handles_accumulation = False
    needs_process_group = True  # the device mesh needs one, even for one process
    parallel_dims = ("dp_replicate", "dp_shard", "cp", "tp")  # the parallelism section (docs/parallelism.md)

    # -- validation (no process group, no fsdp import) --------------------------------
    @classmethod
    def check(cls, context: RunContext) -> list[str]:
        from torchbay_fsdp import parallel

        problems = super().check(context)
        s = context.config.fsdp
        device = context.device_backend_cls.torch_type() if context.device_backend_cls else "cpu"
        problems += parallel.check(context.config, context.cluster.world_size(), device)
        if s.version == 1 and device == "cpu":
            problems.append("fsdp.version 1 (FullyShardedDataParallel) needs an accelerator (cuda, xpu, npu, hpu...) "
                            "and this run uses device 'cpu'; use fsdp.version: 2 (fully_shard runs on cpu/gloo), "
                            "or install and select an accelerator's device plugin")
        if s.version == 2 and s.backward_prefetch in ("BACKWARD_POST", "NO_PREFETCH"):
            problems.append(f"fsdp.backward_prefetch {s.backward_prefetch} exists only in FSDP1; FSDP2 always prefetches "
                            f"the next block in backward: unset fsdp.backward_prefetch (or set BACKWARD_PRE), "
                            f"or use fsdp.version: 1")
        if s.cpu_offload and device == "cpu":
            problems.append("fsdp.cpu_offload moves shards to CPU memory but this run already uses device 'cpu'; "
                            "set fsdp.cpu_offload: false")
        if s.activation_checkpointing and s.wrap_policy == "none":
            problems.append("fsdp.activation_checkpointing recomputes the wrapped blocks, but fsdp.wrap_policy is "
                            "'none' (no blocks); set fsdp.wrap_policy: transformer (with "
                            "fsdp.transformer_layer_cls_to_wrap) or size")
        if s.transformer_layer_cls_to_wrap and s.wrap_policy != "transformer":
            problems.append(f"fsdp.transformer_layer_cls_to_wrap is set but fsdp.wrap_policy is '{s.wrap_policy}'; "
                            f"set fsdp.wrap_policy: transformer or remove the class list")
        if (context.config.mixed_precision, s.param_dtype) in (("fp16", "bfloat16"), ("bf16", "float16")):
            problems.append(f"fsdp.param_dtype {s.param_dtype} disagrees with mixed_precision "
                            f"{context.config.mixed_precision}; set fsdp.param_dtype: auto")
        return problems

    # -- process group ------------------------------------------------------------------
    def __init__(self, context: RunContext):
        super().__init__(context)
        self.settings = context.config.fsdp
        self._param_map: dict[int, tuple[Any, torch.nn.Parameter]] = {}
        self._optimizers: list[Any] = []  # raw optimizers seen by setup, remapped on later prepares
        self._roots: list[torch.nn.Module] = []
        self._mesh = None
        self._flat: dict[str, Any] = {}
        from torchbay_fsdp.parallel import sizes_of

        self.sizes = sizes_of(context.config.parallelism, self.world_size)
        self.tp_plans: list[dict] = []  # per wrapped model: module name -> style applied
        self._accelerate_plugin = None  # accelerator.state.fsdp_plugin, built when first asked

    @classmethod
    def estimate_memory(cls, config, world_size: int, counts: dict[str, int]) -> MemoryEstimate:
        """fp32 weights, gradients and Adam's two moments per rank: sharded over dp_shard x cp,
        and the tensor-parallel share (``counts["tp_split"]``: parameters the plan splits,
        all of them when unknown) further divided by tp_size. Replicas (dp_replicate) hold a copy each."""
        from torchbay_fsdp.parallel import sizes_of

        sizes = sizes_of(getattr(config, "parallelism", None), max(world_size, 1))
        shard, tp = sizes["dp_shard"] * sizes["cp"], sizes["tp"]
        n, trainable = counts["parameters"], counts.get("trainable", counts["parameters"])
        split = min(counts.get("tp_split", n), n) if tp > 1 else 0

        def per_rank(numel: int, nbytes: int) -> int:
            split_part = min(split, numel)
            return (-(-(numel - split_part) // shard) + -(-split_part // (shard * tp))) * nbytes

        note = ""
        if tp > 1 and "tp_split" not in counts:
            note = "no tp plan known: every parameter counted as tp-split, a lower bound"
        factor = shard * tp if split == n else shard
        return MemoryEstimate(parameters=per_rank(n, 4), gradients=per_rank(trainable, 4),
                              optimizer=per_rank(trainable, 8), sharding_factor=factor, note=note)

    @classmethod
    def memory_counts(cls, config, model: torch.nn.Module) -> dict[str, int]:
        """``tp_split``: parameters of ``model`` the tensor-parallel plan splits (tp_size > 1)."""
        from torchbay_fsdp.tensor_parallel import model_plan, resolve_plan, style_kind

        tp = config.parallelism.tp_size
        if tp == 1:
            return {}
        plan, where = config.parallelism.tp_plan, "parallelism.tp_plan"
        if not plan:
            plan, where = model_plan(model), f"{type(model).__name__}.tp_plan"
        if not plan:
            return {}
        resolved = resolve_plan(model, plan, tp, where)
        modules = dict(model.named_modules())
        split = 0
        for name, style in resolved.items():
            kind = style_kind(style)
            for pname, p in modules[name].named_parameters(recurse=False):
                # colwise splits weight and bias; rowwise the weight (its bias is added after the all-reduce)
                split += p.numel() if kind == "colwise" or (kind == "rowwise" and pname == "weight") else 0
        return {"tp_split": split}

    # -- the N-D mesh -------------------------------------------------------------------------
    def setup_environment(self, timeout_s: float | None = None) -> None:
        super().setup_environment(timeout_s)
        if self.distributed:
            self.device_mesh  # noqa: B018 (built now: accelerator.torch_device_mesh right after Accelerator())

    @property
    def device_mesh(self):
        """The named mesh: dp_replicate, dp_shard, cp, tp (those > 1) and the flattened dp, dp_shard_cp, dp_cp."""
        if self._mesh is None:
            from torchbay_fsdp.parallel import build_mesh

            self._mesh, self._flat = build_mesh(self.device_backend.torch_type(), self.sizes)
        return self._mesh

    @property
    def mesh(self):
        """The mesh FSDP shards over: (dp_replicate, dp_shard_cp) for HSDP, else dp_shard_cp."""
        from torchbay_fsdp.parallel import sub_mesh

        root = self.device_mesh
        if self.sizes["cp"] == 1:  # dp_shard_cp is dp_shard: slice the root by its own dimensions
            return sub_mesh(root, [n for n in ("dp_replicate", "dp_shard") if n in root.mesh_dim_names])
        if self.sizes["dp_replicate"] == 1:
            return self._flat["dp_shard_cp"]
        return sub_mesh(root, ["dp_replicate", "dp_shard_cp"])

    @property
    def is_fully_sharded_v2(self) -> bool:
        """Accelerate's ``is_fsdp2`` (``fully_shard``: fsdp.version 2)."""
        return self.settings.version == 2

    @property
    def data_parallel_size(self) -> int:
        return self.sizes["dp_replicate"] * self.sizes["dp_shard"]

    @property
    def data_parallel_rank(self) -> int:
        rank, mesh = 0, self.device_mesh
        for name in ("dp_replicate", "dp_shard"):  # dp = dp_replicate x dp_shard, replicate outermost
            if name in mesh.mesh_dim_names:
                rank = rank * self.sizes[name] + mesh.get_local_rank(name)
        return rank

    @property
    def parallelism_config(self):
        from torchbay.parallelism_config import ParallelismConfig

        config = ParallelismConfig.from_section(self.context.config.parallelism)
        if all(v == 1 for v in config.sizes.values()):
            config = ParallelismConfig(dp_shard_size=self.sizes["dp_shard"])
        config.device_mesh = self._mesh
        return config

    def context_parallel(self, buffers: list | None = None, buffer_seq_dims: list | None = None,
                         no_restore_buffers: set | None = None):
        """torch's ``context_parallel`` on the ``cp`` dimension (checked before training: not on CPU)."""
        if self.sizes["cp"] == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(self.context.config.parallelism.cp_comm_strategy)
        return context_parallel(self.device_mesh["cp"], buffers=buffers or [], buffer_seq_dims=buffer_seq_dims or [],
                                no_restore_buffers=no_restore_buffers)

    # -- precision ----------------------------------------------------------------------
    def grad_scaler(self, **kwargs):
        """fp16: the loss scaler must agree on inf/nan across ranks (each holds only a shard)
        and unscale DTensor gradients: torch's ShardedGradScaler does both."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=self.device_backend.torch_type(), **kwargs)

    def _mixed_precision_dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        s = self.settings
        param = _DTYPES.get(s.param_dtype) if s.param_dtype != "auto" else _PRECISION_DTYPES.get(
            self.context.config.mixed_precision)
        if s.reduce_dtype != "auto":
            reduce = _DTYPES[s.reduce_dtype]
        else:
            reduce = torch.float32 if param in (torch.bfloat16, torch.float16) else None
        return param, reduce

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
        import sys

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
        from torchbay_fsdp.tensor_parallel import apply_tensor_parallel, model_plan

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
        import functools

        from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, FullyShardedDataParallel, MixedPrecision,
                                            ShardingStrategy)
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        s = self.settings
        param_dtype, reduce_dtype = self._mixed_precision_dtypes()
        block_ids = {id(b) for b in blocks}
        kwargs: dict[str, Any] = {
            "sharding_strategy": ShardingStrategy.FULL_SHARD if s.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP,
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

    # -- every step -----------------------------------------------------------------------
    def no_sync(self, model: Any):
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        if isinstance(model, FullyShardedDataParallel):
            return model.no_sync()
        if isinstance(model, FSDPModule):
            return _gradient_sync_off(model)
        return contextlib.nullcontext()

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        params = [p for p in parameters if p.grad is not None]
        if self.settings.version == 1:
            return self._clip_fsdp1(params, max_norm, norm_type)
        from torch.distributed.tensor import DTensor

        # tensor parallel leaves gradients on two meshes ((dp, tp) and dp): one norm per mesh and layout
        groups: dict[Any, list] = {}
        for p in params:
            g = p.grad
            key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(p)
        norms = []
        with _quiet_redistribute():
            for group in groups.values():
                norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)
                norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # partial: reduce over shards
        if not norms:
            return torch.tensor(0.0)
        total = norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm(norms, norm_type)
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    def _clip_fsdp1(self, params, max_norm, norm_type):
        ids = {id(p) for p in params}
        for root in self._roots:
            if ids <= {id(p) for p in root.parameters()}:
                return root.clip_grad_norm_(max_norm, norm_type)
        raise TorchbayError("fsdp.version 1 clips the gradients of one whole prepared model: pass model.parameters()")

    # -- state --------------------------------------------------------------------------
    def model_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        """The full state dict on rank 0 (CPU tensors), empty elsewhere; every rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # -- Accelerate's FSDP surface (accelerator.state.fsdp_plugin, save_fsdp_model and friends) -------------
    def accelerate_state_objects(self) -> dict[str, Any]:
        """``accelerator.state.fsdp_plugin``: the user's ``FullyShardedDataParallelPlugin`` (its unset fields
        filled from the ``fsdp`` section), or one built from the section."""
        from torchbay_fsdp.compat import FullyShardedDataParallelPlugin

        if self._accelerate_plugin is None:
            given = self.context.plugin_objects.get("fsdp_plugin")
            if isinstance(given, FullyShardedDataParallelPlugin):
                given.fill_from(self.settings)
                self._accelerate_plugin = given
            else:
                self._accelerate_plugin = FullyShardedDataParallelPlugin.from_settings(self.settings)
        return {"fsdp_plugin": self._accelerate_plugin}

    def _accelerate_files(self):
        from torchbay_fsdp.accelerate_files import AccelerateFiles

        return AccelerateFiles(self)

    def save_accelerate_model(self, plugin, model, output_dir, index: int = 0, **kwargs) -> None:
        """Accelerate's ``save_fsdp_model`` files (FULL_STATE_DICT or SHARDED_STATE_DICT); collective."""
        self._accelerate_files().save_model(plugin, model, output_dir, index, **kwargs)

    def load_accelerate_model(self, plugin, model, input_dir, index: int = 0, **kwargs) -> Any:
        """Read Accelerate's ``save_fsdp_model`` files into the sharded model; collective."""
        return self._accelerate_files().load_model(plugin, model, input_dir, index, **kwargs)

    def save_accelerate_optimizer(self, plugin, optimizer, model, output_dir, index: int = 0, **kwargs) -> None:
        """Accelerate's ``save_fsdp_optimizer`` files; collective."""
        self._accelerate_files().save_optimizer(plugin, optimizer, model, output_dir, index, **kwargs)

    def load_accelerate_optimizer(self, plugin, optimizer, model, input_dir, index: int = 0, **kwargs) -> None:
        """Read Accelerate's ``save_fsdp_optimizer`` files; collective."""
        self._accelerate_files().load_optimizer(plugin, optimizer, model, input_dir, index, **kwargs)

    @staticmethod
    def _owner(j: int, models: list, owners: list[int | None] | None, optimizers: list) -> torch.nn.Module:
        index = (owners or optimizer_owners(models, optimizers))[j]
        if index is None:
            raise CheckpointError("an optimizer's parameters do not all belong to one prepared model; fsdp "
                                  "checkpoints each optimizer with its model: use one optimizer per model")
        return models[index]

    def save_checkpoint(self, directory: Path, models: list, optimizers: list, io: CheckpointIO, *,
                        owners: list[int | None] | None = None) -> list[str]:
        """Every rank writes its own shards of each model and optimizer (torch.distributed.checkpoint)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from torchbay.builtin.checkpoint_io import dcp_files_of_rank

        written: list[str] = []
        for i, model in enumerate(models):
            dcp.save(get_model_state_dict(model), checkpoint_id=str(directory / model_dir(i)))
            written += dcp_files_of_rank(directory, model_dir(i))
        for j, opt in enumerate(optimizers):
            raw = getattr(opt, "optimizer", opt)
            state = get_optimizer_state_dict(self._owner(j, models, owners, optimizers), raw)
            dcp.save(state, checkpoint_id=str(directory / optimizer_dir(j)))
            written += dcp_files_of_rank(directory, optimizer_dir(j))
        return written + self._write_info(directory, models, optimizers)

    def _write_info(self, directory: Path, models: list, optimizers: list) -> list[str]:
        if self.rank != 0:
            return []
        info = {"format": "torch.distributed.checkpoint", "fsdp_version": self.settings.version,
                "world_size": self.world_size, "mesh": {n: v for n, v in self.sizes.items() if v > 1}, "models": [model_dir(i) for i in range(len(models))],
                "optimizers": [optimizer_dir(j) for j in range(len(optimizers))]}
        (directory / INFO_FILE).write_text(json.dumps(info, indent=2))
        return [INFO_FILE]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_checkpoint_groups", None)  # process groups of this process: they do not pickle
        return state

    def can_start_checkpoint(self) -> bool:
        return self.settings.version == 2  # save_state(blocking=False): DCP's async_save

    def start_checkpoint(self, directory: Path, models: list, optimizers: list, io: CheckpointIO, *,
                         owners: list[int | None] | None = None):
        """``dcp.async_save`` of each model and optimizer: DCP copies this rank's shards to host memory
        in the call and writes them in its own thread per save, whose collectives run on a gloo group
        of that save's own (created once, by every rank, on the main thread), never the training's."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from torchbay.builtin.checkpoint_io import dcp_files_of_rank

        groups = self.__dict__.setdefault("_checkpoint_groups", {})

        def group(stem: str):  # one per DCP save: the saves run at once, each in its own thread
            if stem not in groups:
                groups[stem] = dist.new_group(backend="gloo")
            return groups[stem]

        started = []
        for i, model in enumerate(models):
            started.append((model_dir(i), dcp.async_save(get_model_state_dict(model), checkpoint_id=str(
                directory / model_dir(i)), process_group=group(model_dir(i)))))
        for j, opt in enumerate(optimizers):
            state = get_optimizer_state_dict(self._owner(j, models, owners, optimizers), getattr(opt, "optimizer", opt))
            started.append((optimizer_dir(j), dcp.async_save(state, checkpoint_id=str(directory / optimizer_dir(j)),
                                                             process_group=group(optimizer_dir(j)))))

        def finish() -> list[str]:
            written: list[str] = []
            errors = []
            for stem, future in started:  # every write is waited for, even after one failed
                try:
                    future.result()
                    written += dcp_files_of_rank(directory, stem)
                except Exception as exc:
                    errors.append(f"{stem}: {type(exc).__name__}: {exc}")
            if errors:
                raise CheckpointError(f"the asynchronous DCP save failed: {'; '.join(errors)}")
            return written + self._write_info(directory, models, optimizers)

        return finish

    def load_checkpoint(self, directory: Path, models: list, optimizers: list, io: CheckpointIO,
                        read: Any = None, *, owners: list[int | None] | None = None) -> None:
        """Load sharded state written by any number of processes (DCP reshards on load).

        A checkpoint written by a strategy that saves full weights (single, ddp) loads its
        model weights too; its optimizer state cannot be mapped onto shards.
        """
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_model_state_dict,
                                                             set_optimizer_state_dict)

        from torchbay.safe_load import dcp_load

        sharded = [(directory / model_dir(i) / ".metadata").exists() for i in range(len(models))]
        for i, is_sharded in enumerate(sharded):  # check every part before changing anything
            if not is_sharded and not io.exists(directory, f"model_{i}"):
                raise CheckpointError(f"model {i}: neither {model_dir(i)}/ (sharded) nor model_{i} weights are in "
                                      f"{directory}")
        for j in range(len(optimizers)):
            if not (directory / optimizer_dir(j) / ".metadata").exists():
                hint = (" (the checkpoint was saved by a strategy that does not shard: its optimizer state is keyed "
                        "by position and cannot be resharded)" if (directory / f"optimizer_{j}.pt").exists() else "")
                raise CheckpointError(f"optimizer {j}: {optimizer_dir(j)}/ is missing from {directory}{hint}")
        for i, model in enumerate(models):
            try:
                if sharded[i]:
                    state = dcp_load(get_model_state_dict(model), directory / model_dir(i), trusted=io.trusted)
                    set_model_state_dict(model, state)
                else:
                    full = io.load_state_dict(directory, f"model_{i}", device="cpu") if self.rank == 0 else {}
                    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                              broadcast_from_rank0=True))
            except Exception as exc:
                raise CheckpointError(f"model {i} in {directory} does not fit the prepared model: "
                                      f"{type(exc).__name__}: {exc}") from exc
        for j, opt in enumerate(optimizers):
            path = directory / optimizer_dir(j)
            raw = getattr(opt, "optimizer", opt)
            owner = self._owner(j, models, owners, optimizers)
            try:
                state = dcp_load(get_optimizer_state_dict(owner, raw), path, trusted=io.trusted)
                set_optimizer_state_dict(owner, raw, state)
            except Exception as exc:
                raise CheckpointError(f"optimizer {j} could not be restored from {path}: "
                                      f"{type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def _quiet_redistribute():
    """Reducing a norm over a 2-D (dp, tp) mesh takes two all-reduces, about which torch warns on
    every rank at every step; one scalar per step is not worth the noise."""
    import logging

    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _gradient_sync_off(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
