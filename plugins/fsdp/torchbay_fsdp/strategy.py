"""The ``fsdp`` strategy: FSDP2 (``fully_shard``) by default, FSDP1 as ``fsdp.version: 1``.

``torch.distributed.fsdp`` and ``torch.distributed.checkpoint`` (seconds to import) are imported when a
strategy object is built or used, never when this module or the modules it imports are imported: the
strategy's class is checked in processes that never select it (``torchbay_fsdp.compat`` imports it, and
transformers' Trainer imports that). torchbay's own modules are imported at module level.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch

from torchbay.errors import IncompatibleSetupError, TorchbayError
from torchbay.plugin import MemoryEstimate, ParallelismConfig, Strategy
from torchbay_fsdp import parallel
from torchbay_fsdp.checkpoint import FSDPCheckpoint
from torchbay_fsdp.experts import WEIGHTS_ATTRIBUTE, apply_expert_parallel, expert_mesh, gather_experts, shard_experts
from torchbay_fsdp.experts.checkpoint import checkpoint_mesh, fsdp_experts, whole_experts
from torchbay_fsdp.experts.modules import find_experts
from torchbay_fsdp.pipeline.model import PipelineModel
from torchbay_fsdp.pipeline.split import memory_counts as pipeline_memory_counts
from torchbay_fsdp.pipeline.wrap import PipelineWrapping, check_pipeline_combination
from torchbay_fsdp.tensor_parallel import model_plan, resolve_plan, style_kind
from torchbay_fsdp.ulysses import SequenceShardedBatches, apply_ulysses
from torchbay_fsdp.wrap import FSDPWrapping

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.plugin import RunContext

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class FSDPStrategy(PipelineWrapping, FSDPWrapping, FSDPCheckpoint, Strategy):
    """Shard parameters, gradients and optimizer state across the processes."""

    name = "fsdp"
    handles_accumulation = False
    needs_process_group = True  # the device mesh needs one, even for one process
    parallel_dims = ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")  # docs/parallelism.md

    # -- validation (no process group, no fsdp import) --------------------------------
    @classmethod
    def check(cls, context: RunContext) -> list[str]:
        problems = super().check(context)
        s = context.config.fsdp
        device = context.device_backend_cls.torch_type() if context.device_backend_cls else "cpu"
        problems += parallel.check(context.config, context.cluster.world_size(), device)
        problems += check_pipeline_combination(context.config, context.cluster.world_size())
        if s.version == 1 and device == "cpu":
            problems.append("fsdp.version 1 (FullyShardedDataParallel) needs an accelerator (cuda, xpu, npu, hpu...) "
                            "and this run uses device 'cpu'; use fsdp.version: 2 (fully_shard runs on cpu/gloo), "
                            "or install and select an accelerator's device plugin")
        if s.version == 2 and s.backward_prefetch in ("BACKWARD_POST", "NO_PREFETCH"):
            problems.append(f"fsdp.backward_prefetch {s.backward_prefetch} exists only in FSDP1; FSDP2 always "
                            f"prefetches the next block in backward: unset fsdp.backward_prefetch (or set "
                            f"BACKWARD_PRE), or use fsdp.version: 1")
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

    @classmethod
    def built_sizes(cls, config, world_size: int) -> dict[str, int]:
        return parallel.sizes_of(config.parallelism, world_size)  # dp_shard takes the processes no size names

    # -- process group ------------------------------------------------------------------
    def __init__(self, context: RunContext):
        super().__init__(context)
        self.settings = context.config.fsdp
        self._param_map: dict[int, tuple[Any, torch.nn.Parameter]] = {}
        self._optimizers: list[Any] = []  # raw optimizers seen by setup, remapped on later prepares
        self._roots: list[torch.nn.Module] = []
        self._mesh = None
        self._flat: dict[str, Any] = {}
        self._expert_mesh = None  # ([dp_replicate,] dp_shard_mod_ep, ep) under parallelism.ep_size > 1
        self._checkpoint_mesh = None  # ([dp_replicate,] ep, dp_shard_mod_ep): for DCP (experts.checkpoint)
        self._sp_model_wrapped = False  # whether wrap_model has run under parallelism.sp_size > 1
        self.sizes = parallel.sizes_of(context.config.parallelism, self.world_size)
        self.tp_plans: list[dict] = []  # per wrapped model: module name -> style applied
        self._accelerate_plugin = None  # accelerator.state.fsdp_plugin, built when first asked

    @classmethod
    def estimate_memory(cls, config, world_size: int, counts: dict[str, int]) -> MemoryEstimate:
        """fp32 weights, gradients and Adam's two moments per rank: sharded over dp_shard x cp,
        and the tensor-parallel share (``counts["tp_split"]``: parameters the plan splits,
        all of them when unknown) further divided by tp_size. Replicas (dp_replicate) hold a copy each."""
        sizes = parallel.sizes_of(getattr(config, "parallelism", None), max(world_size, 1))
        shard, tp = sizes["dp_shard"] * sizes["cp"], sizes["tp"]
        n, trainable = counts["parameters"], counts.get("trainable", counts["parameters"])
        stage_note = ""
        if sizes["pp"] > 1 and getattr(config, "mixed_precision", "no") == "fp16":
            raise IncompatibleSetupError(["pipeline parallel with fp16: the loss scaler cannot scale inside the "
                                          "schedule; use bf16"])
        if "pp_rank_max" in counts:  # pipeline: the rank holding the most parameters (memory_counts)
            ratio = trainable / n if n else 1.0
            n = counts["pp_rank_max"]
            trainable = int(n * ratio)
            stage_note = "pp: largest stage; per pp rank " + " / ".join(
                f"{counts[f'pp_rank_{r}']:,}" for r in range(sizes["pp"]) if f"pp_rank_{r}" in counts) + " params"
        split = min(counts.get("tp_split", n), n) if tp > 1 else 0

        def per_rank(numel: int, nbytes: int) -> int:
            split_part = min(split, numel)
            return (-(-(numel - split_part) // shard) + -(-split_part // (shard * tp))) * nbytes

        note = ""
        if tp > 1 and "tp_split" not in counts:
            note = "no tp plan known: every parameter counted as tp-split, a lower bound"
        ep = getattr(getattr(config, "parallelism", None), "ep_size", 1) or 1
        if ep > 1 and counts.get("experts"):
            note = (f"ep_size {ep}: sharded state as without ep; a forward gathers {counts['experts'] // ep:,} of the "
                    f"{counts['experts']:,} expert parameters per rank (without ep: all)")
        note = "; ".join(filter(None, (stage_note, note)))
        factor = shard * tp if split == n else shard
        return MemoryEstimate(parameters=per_rank(n, 4), gradients=per_rank(trainable, 4),
                              optimizer=per_rank(trainable, 8), sharding_factor=factor, note=note)

    @classmethod
    def memory_counts(cls, config, model: torch.nn.Module) -> dict[str, int]:
        """``tp_split``: parameters of ``model`` the tensor-parallel plan splits (tp_size > 1); ``experts``: those of
        its expert modules (ep_size > 1)."""
        ep = getattr(config.parallelism, "ep_size", 1) or 1
        experts = {}
        if ep > 1:
            found = find_experts(model, config.parallelism.ep_plan or None, ep)
            experts = {"experts": sum(p.numel() for m in found.values() for p in m.parameters())}
        tp = config.parallelism.tp_size
        if config.parallelism.pp_size > 1:
            return pipeline_memory_counts(config.parallelism, model)  # (pp with tp is refused)
        if tp == 1:
            return experts
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
        return {"tp_split": split, **experts}

    # -- the N-D mesh -------------------------------------------------------------------------
    def setup_environment(self, timeout_s: float | None = None) -> None:
        super().setup_environment(timeout_s)
        if self.distributed:
            self.device_mesh  # noqa: B018 (built now: accelerator.torch_device_mesh right after Accelerator())

    @property
    def device_mesh(self):
        """The named mesh: dp_replicate, dp_shard, cp, tp (those > 1) and the flattened dp, dp_shard_cp, dp_cp."""
        if self._mesh is None:
            self._mesh, self._flat = parallel.build_mesh(self.device_backend.torch_type(), self.sizes)
        return self._mesh

    @property
    def mesh(self):
        """The mesh FSDP shards over: (dp_replicate, dp_shard_cp) for HSDP, else dp_shard_cp."""
        root = self.device_mesh
        if self.sizes["cp"] == 1 and self.sizes["sp"] == 1:  # dp_shard_cp is dp_shard: slice the root
            return parallel.sub_mesh(root, [n for n in ("dp_replicate", "dp_shard") if n in root.mesh_dim_names])
        if self.sizes["dp_replicate"] == 1:
            return self._flat["dp_shard_cp"]
        return parallel.sub_mesh(root, ["dp_replicate", "dp_shard_cp"])

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

    # -- Ulysses sequence parallel (torchbay_fsdp.ulysses) ----------------------------------------
    def wrap_batches(self, batches: Any) -> Any:
        """Under sp, each rank keeps its slice of every batch's sequence."""
        if self.sizes["sp"] == 1:
            return batches
        return SequenceShardedBatches(batches, self.device_mesh.get_local_rank("sp"), self.sizes["sp"],
                                      lambda: self._sp_model_wrapped)

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.is_wrapped(model):
            return model
        if self.sizes["sp"] > 1:
            apply_ulysses(model, self.device_mesh["sp"].get_group(), self.sizes["sp"],
                          self.context.config.parallelism.sp_attn_implementation, tp=self.sizes["tp"])
            self._sp_model_wrapped = True  # the loaders' length: torchbay_fsdp.ulysses.batches
        if self.context.config.parallelism.ep_size > 1:
            self._apply_expert_parallel(model)
        return super().wrap_model(model)

    # -- expert parallel (torchbay_fsdp.experts) ----------------------------------------------------
    def model_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        """Under ep, every expert gathered over the ep group (save_model writes the full model, original names)."""
        names = getattr(getattr(model, "module", model), WEIGHTS_ATTRIBUTE, None)
        if not names:
            return super().model_state_dict(model)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        state = gather_experts(state, names, self._expert_mesh["ep"].get_group())
        return {k: v.cpu() for k, v in state.items()} if self.rank == 0 else {}

    def _for_dcp(self, model: Any, state: dict) -> dict:
        """Under ep, each split expert tensor as this rank's piece of the whole weight (experts.checkpoint)."""
        names = getattr(getattr(model, "module", model), WEIGHTS_ATTRIBUTE, None)
        return whole_experts(state, names, self._checkpoint_mesh) if names else state

    def _from_dcp(self, model: Any, loaded: dict, state: dict) -> dict:
        names = getattr(getattr(model, "module", model), WEIGHTS_ATTRIBUTE, None)
        return fsdp_experts(loaded, state, names) if names else loaded

    def _apply_expert_parallel(self, model: torch.nn.Module) -> None:
        """Split the experts over ep and shard each rank's experts over (dp_replicate,) dp_shard / ep
        (experts.shard_experts); the user's optimizer holds the full expert weights: map them to the shards."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        section, ep = self.context.config.parallelism, self.context.config.parallelism.ep_size
        if self._expert_mesh is None:
            where = (self.device_backend.torch_type(), self.sizes["dp_replicate"], self.sizes["dp_shard"], ep)
            self._expert_mesh, self._checkpoint_mesh = expert_mesh(*where), checkpoint_mesh(*where)
        found, pairs = apply_expert_parallel(model, section.ep_plan or None, self._expert_mesh["ep"].get_group(),
                                             self._expert_mesh.get_local_rank("ep"), ep)
        param_dtype, reduce_dtype = self._mixed_precision_dtypes()
        shard_experts(list(found.values()), self._expert_mesh, MixedPrecisionPolicy(param_dtype, reduce_dtype),
                      self.settings.reshard_after_forward)
        for module, name, old in pairs:
            self._param_map[id(old)] = (weakref.ref(old), getattr(module, name))

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

    # -- every step -----------------------------------------------------------------------
    def no_sync(self, model: Any):
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        if isinstance(model, FullyShardedDataParallel):
            return model.no_sync()
        if isinstance(model, FSDPModule):
            return _gradient_sync_off(model)
        if isinstance(model, PipelineModel):  # its stages reduce once per accumulation window
            return model.gradient_sync_off()
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
        if not norms and not self.pipeline_enabled:
            return torch.tensor(0.0)
        total = (torch.tensor(0.0) if not norms else norms[0] if len(norms) == 1
                 else torch.nn.utils.get_total_norm(norms, norm_type))
        total = self.pipeline_total_norm(total, norm_type)  # pp: over the stages of every pp rank
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    def _clip_fsdp1(self, params, max_norm, norm_type):
        ids = {id(p) for p in params}
        for root in self._roots:
            if ids <= {id(p) for p in root.parameters()}:
                return root.clip_grad_norm_(max_norm, norm_type)
        raise TorchbayError("fsdp.version 1 clips the gradients of one whole prepared model: pass model.parameters()")

@contextlib.contextmanager
def _quiet_redistribute():
    """Reducing a norm over a 2-D (dp, tp) mesh takes two all-reduces, about which torch warns on
    every rank at every step; one scalar per step is not worth the noise."""
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
