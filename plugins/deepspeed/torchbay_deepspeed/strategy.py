"""The ``deepspeed`` strategy: one DeepSpeed engine per prepared model.

deepspeed is imported when this strategy is built (in ``setup_environment``), never when
the plugin is loaded.

Per step: ``accelerator.backward(loss)`` tells the engine whether this micro-batch ends an
accumulation window (torchbay's ``accumulate`` decides, as for DDP), then runs
``engine.backward(loss)`` (DeepSpeed divides by the accumulation steps) and ``engine.step()``
(DeepSpeed reduces, clips, updates and zeroes the gradients on the window's last micro-batch).
The prepared optimizer's ``step``/``zero_grad`` then do nothing.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from torchbay.errors import CheckpointError, ConfigError, IncompatibleSetupError, TorchbayError
from torchbay.precision import Precision
from torchbay.strategy import MemoryEstimate, Strategy

from torchbay_deepspeed import config as dsconfig
from torchbay_deepspeed.objects import DeepSpeedSchedulerWrapper, DummyOptim, DummyScheduler, EngineOptimizer, \
    PendingEngine

log = logging.getLogger("torchbay.deepspeed")

#: torch device type -> DeepSpeed accelerator name (DS_ACCELERATOR)
DS_ACCELERATORS = {"cpu": "cpu", "cuda": "cuda", "xpu": "xpu", "npu": "npu", "mps": "mps", "hpu": "hpu",
                   "mlu": "mlu", "sdaa": "sdaa"}
CHECKPOINT_TAG = "ds"


def ds_accelerator_env(torch_type: str) -> dict[str, str]:
    name = DS_ACCELERATORS.get(torch_type)
    return {"DS_ACCELERATOR": name} if name else {}


def import_deepspeed(torch_type: str, log_level: str = "warning"):
    """Import deepspeed with its accelerator matching torchbay's device."""
    for key, value in ds_accelerator_env(torch_type).items():
        os.environ.setdefault(key, value)
    import deepspeed

    level = getattr(logging, log_level.upper())
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(level)
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(level)
    except Exception:  # pragma: no cover
        pass
    return deepspeed


class DeepSpeedPrecision(Precision):
    """Takes the place of the selected plain precision (no/fp16/bf16): DeepSpeed does that
    mode itself (module conversion, loss scaler, from the ``bf16``/``fp16`` sections torchbay
    writes into its config), so no autocast or scaler runs here. An engine precision (fp8) is
    refused by :meth:`DeepSpeedStrategy.check` before it gets here."""

    def __init__(self, context, replaced: Precision):
        super().__init__(context)
        self.replaced = replaced
        self.name = replaced.name  # type: ignore[misc]

    def optimizer_step(self, optimizer, step, **kwargs) -> bool:
        step(optimizer, **kwargs)
        return optimizer.step_applied() if isinstance(optimizer, EngineOptimizer) else True

    def describe(self) -> str:
        return f"deepspeed {self.name}"


@dataclass
class EngineRecord:
    """One prepared model and what DeepSpeed built for it."""

    index: int
    module: torch.nn.Module
    engine: Any = None
    optimizer: Optional[EngineOptimizer] = None
    pending: Optional[PendingEngine] = None
    config: dict = field(default_factory=dict)
    report: list = field(default_factory=list)
    param_ids: set = field(default_factory=set)
    has_optimizer: bool = False
    #: ZeRO stage 0 in fp32 keeps no norm: measured here before the step when clipping is on
    measure_norm: bool = False
    last_norm: Optional[float] = None

    @property
    def trains(self) -> bool:
        return self.engine is not None and self.has_optimizer


def _param_ids(obj) -> set:
    if isinstance(obj, torch.nn.Module):
        return {id(p) for p in obj.parameters()}
    return {id(p) for group in obj.param_groups for p in group["params"]}


class DeepSpeedStrategy(Strategy):
    """DeepSpeed ZeRO stages 0-3 with offload; each model its own engine and config."""

    name = "deepspeed"
    handles_accumulation = True
    needs_process_group = True  # DeepSpeed wants a process group even for one process

    @classmethod
    def launch_env(cls, local_world_size: int, config: Any, device_cls: Any) -> dict[str, str]:
        return ds_accelerator_env(device_cls.torch_type())

    # -- validation (no deepspeed import) ---------------------------------------------
    @classmethod
    def estimate_memory(cls, config, world_size: int, counts: dict[str, int]) -> MemoryEstimate:
        """Weights, gradients and optimizer state per process for the configured ZeRO stage and offload."""
        if config.mixed_precision == "fp8":
            raise IncompatibleSetupError([dsconfig.FP8_REFUSAL])
        section = config.deepspeed
        stage = section.zero_stage if section.zero_stage is not None else 2
        world = max(world_size, 1)
        half = config.mixed_precision in ("bf16", "fp16")
        n, trainable = counts["parameters"], counts.get("trainable", counts["parameters"])
        weight_bytes = 2 if half else 4
        params = n * weight_bytes / (world if stage >= 3 else 1)
        grads = trainable * weight_bytes / (world if stage >= 2 else 1)
        optimizer = trainable * (12 if half else 8) / (world if stage >= 1 else 1)  # fp32 master copy + Adam
        if section.offload_optimizer_device in ("cpu", "nvme"):
            optimizer = 0
        if section.offload_param_device in ("cpu", "nvme"):
            params = 0
        return MemoryEstimate(parameters=int(params), gradients=int(grads), optimizer=int(optimizer),
                              sharding_factor=world if stage >= 1 else 1, note=f"ZeRO-{stage}")

    @classmethod
    def check(cls, context) -> list[str]:
        problems = super().check(context)
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            problems.append("strategy 'deepspeed' needs the deepspeed library: pip install deepspeed")
        torch_type = context.device_backend_cls.torch_type()
        wanted = DS_ACCELERATORS.get(torch_type)
        if wanted is None:
            problems.append(f"strategy 'deepspeed' has no DeepSpeed accelerator for device '{torch_type}' "
                            f"(known: {', '.join(sorted(DS_ACCELERATORS))})")
        elif os.environ.get("DS_ACCELERATOR", wanted) != wanted:
            problems.append(f"DS_ACCELERATOR is '{os.environ['DS_ACCELERATOR']}' but torchbay's device is "
                            f"'{torch_type}'; unset DS_ACCELERATOR (torchbay sets it) or choose device: "
                            f"{os.environ['DS_ACCELERATOR']}")
        base, _, found = dsconfig.base_config(context.resolved, context.cluster.world_size())
        if not found:
            found = dsconfig.device_problems(base, context.device_backend_cls)
        return problems + found

    def __init__(self, context):
        super().__init__(context)
        self.section: dsconfig.DeepSpeedSection = context.config.deepspeed
        self._loader_micro_batch: tuple[int, str] | None = None
        #: Accelerate's DeepSpeedPlugin given to Accelerator(...), or the one made when first asked for
        self._plugin = getattr(context, "plugin_objects", {}).get("deepspeed_plugin")
        #: whether the plugin is the user's (Accelerate's semantics for its config) or made from torchbay's config
        self._plugin_given = self._plugin is not None
        if self._plugin is not None:  # as Accelerate's AcceleratorState does with it
            self._plugin.set_mixed_precision(context.config.mixed_precision)
            self._plugin.select(_from_accelerator_state=True)
        base, origins, problems = dsconfig.base_config(context.resolved, self.world_size, self._plugin_config())
        if problems:
            raise ConfigError(problems, header="invalid DeepSpeed configuration")
        if self.section.load_universal:
            base.setdefault("checkpoint", {})["load_universal"] = True
        self.base_config = base
        self.origins = origins
        self.records: list[EngineRecord] = []
        self._unbound: list[EngineOptimizer] = []
        self._ds = None

    # -- Accelerate's DeepSpeedPlugin (accelerator.state.deepspeed_plugin) ---------------------------
    def _plugin_config(self) -> dict | None:
        """The plugin's DeepSpeed config as it is now (transformers' Trainer completes it after the
        Accelerator exists, and may give the plugin a new config object), or None without a plugin."""
        if self._plugin is None:
            return None
        config = getattr(self._plugin, "deepspeed_config", None)
        if not isinstance(config, dict):
            raise ConfigError("accelerator.state.deepspeed_plugin.deepspeed_config must be the DeepSpeed config "
                              "(a dict); build the plugin with DeepSpeedPlugin(hf_ds_config=...)")
        return config

    def accelerate_state_objects(self) -> dict[str, Any]:
        """``accelerator.state.deepspeed_plugin``: the user's ``DeepSpeedPlugin``, or for a run configured in
        torchbay's config one made from it (its config is this run's, "auto" values still open)."""
        if self._plugin is None:
            from torchbay_deepspeed.compat import DeepSpeedPlugin

            config = copy.deepcopy(self.base_config)
            config.pop("zero_allow_untested_optimizer", None)
            self._plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=self.section.zero3_init)
        if not self._plugin.selected:
            self._plugin.select(_from_accelerator_state=True)
        return {"deepspeed_plugin": self._plugin}

    def _current_base(self) -> dict:
        """The base config now: read again from the plugin's config when there is one."""
        live = self._plugin_config()
        if live is None:
            return self.base_config
        base, _, problems = dsconfig.base_config(self.context.resolved, self.world_size, live,
                                                 from_user_plugin=self._plugin_given)
        if problems:
            raise ConfigError(problems, header="invalid DeepSpeed configuration")
        if self.section.load_universal:
            base.setdefault("checkpoint", {})["load_universal"] = True
        return base

    @property
    def deepspeed(self):
        if self._ds is None:
            self._ds = import_deepspeed(self.device_backend.torch_type(), self.section.log_level)
        return self._ds

    # -- process group -------------------------------------------------------------------
    def setup_environment(self, timeout_s: float | None = None) -> None:
        for key, value in ds_accelerator_env(self.device_backend.torch_type()).items():
            os.environ.setdefault(key, value)
        backend = self.context.config.process_group_backend or self.device_backend.dist_backend()
        if self.world_size <= 1:
            self.cluster.export_torch_env()  # DeepSpeed reads RANK / LOCAL_RANK / WORLD_SIZE even for one process
        super().setup_environment(timeout_s)
        ds = self.deepspeed
        if self.device_backend.torch_type() == "cpu" and not self.section.cpu_shm_comm:
            import deepspeed.ops

            # the shared-memory op serves inference all-reduce only and costs minutes to compile
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        ds.init_distributed(dist_backend=backend, auto_mpi_discovery=False, dist_init_required=False)

    def teardown(self, barrier: bool = True) -> None:
        for rec in self.records:
            if rec.engine is not None:
                with contextlib.suppress(Exception):
                    rec.engine.destroy()
        if self.owns_process_group and dist.is_initialized() and self._ds is not None:
            if barrier:  # not at interpreter exit: a dying rank must not wait for stuck peers
                with contextlib.suppress(Exception):
                    dist.barrier()
            import deepspeed.comm

            deepspeed.comm.destroy_process_group()  # also drops DeepSpeed's cached groups
            self.owns_process_group = False
        super().teardown(barrier=barrier)

    def adapt_precision(self, precision):
        if getattr(precision, "engine", None) is not None:  # check() refuses this set-up; never run it silently
            raise ConfigError(f"strategy deepspeed cannot run precision {precision.describe()}; use "
                              f"mixed_precision bf16 or fp16")
        return DeepSpeedPrecision(self.context, precision)

    # -- ZeRO-3 construction -----------------------------------------------------------
    def zero_init(self, enabled: bool | None = None):
        """Context to build models in: under ZeRO-3 with ``deepspeed.zero3_init`` (or
        ``enabled=True``), parameters are partitioned as they are created."""
        enabled = self.section.zero3_init if enabled is None else enabled
        if not enabled:
            return contextlib.nullcontext()
        if dsconfig.get_path(self.base_config, ("zero_optimization", "stage")) != 3:
            raise ConfigError("deepspeed.zero3_init needs ZeRO stage 3 (deepspeed.zero_stage: 3)")
        cfg, _, _ = dsconfig.fill_auto(self.base_config, micro_batch=self._micro_batch(), world_size=self.world_size,
                                       model=torch.nn.Module(), has_optimizer=True)
        cfg = {k: v for k, v in cfg.items() if k not in ("optimizer", "scheduler")}
        return self.deepspeed.zero.Init(config_dict_or_path=cfg)

    # -- wrapping ------------------------------------------------------------------------
    def _micro_batch(self) -> tuple[int, str] | None:
        return self._loader_micro_batch

    def connect_dataloader(self, dataloader: Any) -> None:
        """The first prepared data loader's per-process batch size is DeepSpeed's micro batch."""
        if self._loader_micro_batch is None and getattr(dataloader, "batch_size", None):
            split = self.context.config.dataloader.split_batches
            size = dataloader.batch_size // self.world_size if split else dataloader.batch_size
            self._loader_micro_batch = (size, "the prepared data loader's per-process batch size")

    def setup(self, models: list, optimizers: list, schedulers: list) -> tuple[list, list, list]:
        proxies = [self._proxy(o) for o in optimizers]
        dummy_scheds = {id(s.optimizer): s for s in schedulers if isinstance(s, DummyScheduler)}
        out_models = []
        for model in models:
            rec = EngineRecord(index=len(self.records), module=model, param_ids=_param_ids(model))
            self.records.append(rec)
            proxy = self._match_optimizer(rec)
            cfg = dsconfig.model_config(self._current_base(), self.section, rec.index, model)
            trainable = any(p.requires_grad for p in model.parameters())
            if proxy is not None or not trainable or "optimizer" in cfg:
                self._build(rec, proxy, dummy_scheds)
                out_models.append(rec.engine)
            else:
                rec.pending = PendingEngine(model)
                out_models.append(rec.pending)
        for proxy in list(self._unbound):  # optimizers whose model was prepared earlier
            rec = next((r for r in self.records if r.pending is not None and r.engine is None
                        and _param_ids(proxy.user_optimizer) <= r.param_ids), None)
            if rec is not None:
                self._build(rec, proxy, dummy_scheds)
                object.__setattr__(rec.pending, "engine", rec.engine)
        out_scheds = []
        for sched in schedulers:
            if isinstance(sched, DummyScheduler):
                rec = next((r for r in self.records if r.optimizer is not None
                            and r.optimizer.user_optimizer is sched.optimizer), None)
                if rec is None or rec.engine is None:
                    raise TorchbayError("a DummyScheduler was prepared without its DummyOptim and model; prepare "
                                        "them in the same call")
                out_scheds.append(DeepSpeedSchedulerWrapper(rec.engine.lr_scheduler, [rec.optimizer],
                                                            engine=rec.engine))
            else:
                out_scheds.append(sched)  # stepped by torchbay, on the user's optimizer, as under DDP
        return out_models, proxies, out_scheds

    def _proxy(self, optimizer) -> EngineOptimizer:
        proxy = EngineOptimizer(optimizer)
        self._unbound.append(proxy)
        return proxy

    def _match_optimizer(self, rec: EngineRecord) -> EngineOptimizer | None:
        for proxy in self._unbound:
            ids = _param_ids(proxy.user_optimizer)
            if ids and ids <= rec.param_ids:
                return proxy
        return None

    def _build(self, rec: EngineRecord, proxy: EngineOptimizer | None, dummy_scheds: dict) -> None:
        ds = self.deepspeed
        model = rec.module
        live = self._plugin_config()
        cfg = dsconfig.model_config(self._current_base(), self.section, rec.index, model)
        user_opt = proxy.user_optimizer if proxy is not None else None
        dummy = isinstance(user_opt, DummyOptim)
        if dummy and "optimizer" not in cfg:
            raise ConfigError("a DummyOptim was prepared but the DeepSpeed config has no 'optimizer' section; "
                              "prepare a torch optimizer or add the section")
        if user_opt is not None and not dummy and "optimizer" in cfg:
            raise ConfigError("the DeepSpeed config defines an 'optimizer' and a torch optimizer was prepared too; "
                              "prepare torchbay_deepspeed.DummyOptim(model.parameters()) or remove the section")
        has_opt = user_opt is not None or "optimizer" in cfg
        offload = dsconfig.get_path(cfg, ("zero_optimization", "offload_optimizer", "device"))
        if user_opt is not None and not dummy and offload in ("cpu", "nvme"):
            cfg.setdefault("zero_force_ds_cpu_optimizer", False)  # the user's own optimizer is offloaded as is
        sched = dummy_scheds.get(id(user_opt)) if user_opt is not None else None
        opt_hint = dict(user_opt.defaults) if dummy else None
        early: list[str] = []
        if live is not None and self._plugin_given:  # what Accelerate fills itself for a DeepSpeedPlugin's config
            early = dsconfig.accelerate_fills(cfg, optimizer=user_opt if dummy else None, scheduler=sched,
                                              num_processes=self.world_size,
                                              split_batches=self.context.config.dataloader.split_batches)
        filled, report, problems = dsconfig.fill_auto(
            cfg, micro_batch=self._micro_batch(), world_size=self.world_size, model=model,
            optimizer_hint=opt_hint, scheduler_hint=sched.params if sched is not None else None,
            has_optimizer=has_opt)
        report = early + report
        if problems:
            raise ConfigError(problems, header=f"DeepSpeed config of model {rec.index} cannot be completed")
        if live is not None:
            dsconfig.write_back(live, filled)  # as Accelerate fills the plugin's config in place
        kwargs: dict[str, Any] = {"model": model, "config": filled, "dist_init_required": False}
        if user_opt is not None and not dummy:
            kwargs["optimizer"] = user_opt
        elif has_opt:
            kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
        if sched is not None and sched.lr_scheduler_callable is not None:
            kwargs["lr_scheduler"] = sched.lr_scheduler_callable
        engine, _, _, _ = ds.initialize(**kwargs)
        from torchbay_deepspeed.safe_checkpoint import install_safe_loader

        # engine.load_checkpoint called directly (transformers' Trainer does) reads through torchbay's safe loader
        install_safe_loader(engine, self.context.config.checkpoint.allow_unsafe_pickle)
        rec.engine, rec.config, rec.report, rec.has_optimizer = engine, filled, report, has_opt
        rec.measure_norm = (has_opt and not engine.zero_optimization() and bool(engine.gradient_clipping())
                            and not (engine.fp16_enabled() or engine.bfloat16_enabled()))
        if proxy is not None:
            proxy.engine = engine
            rec.optimizer = proxy
            if proxy in self._unbound:
                self._unbound.remove(proxy)
        elif has_opt:
            rec.optimizer = EngineOptimizer(None)
            rec.optimizer.engine = engine
        if self.rank == 0:
            lines = [f"DeepSpeed engine for model {rec.index} ({type(model).__name__}), ZeRO stage "
                     f"{dsconfig.get_path(filled, ('zero_optimization', 'stage'))}"]
            lines += [f"  filled {line}" for line in report]
            lines.append("  config: " + json.dumps(filled, sort_keys=True, default=str))
            log.info("\n".join(lines))

    def wrap_model(self, model):  # pragma: no cover - setup does the work
        return self.setup([model], [], [])[0][0]

    def _record(self, model: Any) -> EngineRecord:
        for rec in self.records:
            if model is rec.engine or model is rec.pending or model is rec.module:
                return rec
        raise TorchbayError(f"{type(model).__name__} was not prepared by this accelerator")

    def is_wrapped(self, model: Any) -> bool:
        return any(model is rec.engine or model is rec.pending for rec in self.records if model is not None)

    def unwrap_model(self, model):
        for rec in self.records:
            if model is rec.engine or model is rec.pending:
                return rec.module
        return model

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

    # -- state -------------------------------------------------------------------------------
    def _zero3(self, rec: EngineRecord) -> bool:
        return rec.engine is not None and rec.engine.zero_optimization_partition_weights()

    def model_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        """Full weights on the main process (gathered layer by layer under ZeRO-3); ``{}`` elsewhere."""
        rec = self._record(model)
        if self._zero3(rec):
            state = rec.engine._zero3_consolidated_16bit_state_dict()
            return dict(state) if state is not None else {}
        return rec.module.state_dict()

    def save_checkpoint(self, directory: Path, models: list, optimizers: list, io, *,
                        owners: list[int | None] | None = None) -> list[str]:
        """Every rank writes its part of each engine's DeepSpeed checkpoint to ``deepspeed_model_<i>``."""
        written: list[str] = []
        engine_dirs = []
        for i, model in enumerate(models):
            rec = self._record(model)
            if not rec.trains:  # a frozen model (or one never given an optimizer): its full weights
                state = self.model_state_dict(model)
                if self.rank == 0:
                    written += io.save_state_dict(state, directory, f"model_{i}")
                continue
            rec.engine.save_checkpoint(str(directory / f"deepspeed_model_{i}"), tag=CHECKPOINT_TAG,
                                       client_state={"torchbay_model_index": i}, save_latest=False)
            engine_dirs.append(directory / f"deepspeed_model_{i}")
        self.barrier()  # every rank's DeepSpeed files are written; rank 0 lists them all
        if self.rank != 0:
            return written
        return written + sorted(str(p.relative_to(directory)) for d in engine_dirs for p in d.rglob("*")
                                if p.is_file())

    def load_checkpoint(self, directory: Path, models: list, optimizers: list, io, read: Any = None, *,
                        owners: list[int | None] | None = None) -> None:
        from torchbay.checkpoint_dir import read_manifest

        from torchbay_deepspeed.safe_checkpoint import install_safe_loader

        saved_world = read_manifest(directory).get("world_size")
        for i, model in enumerate(models):
            rec = self._record(model)
            sub = directory / f"deepspeed_model_{i}"
            if not rec.trains:
                self._load_full_weights(rec, io.load_state_dict(directory, f"model_{i}", device="cpu"), i)
                continue
            if not (sub / CHECKPOINT_TAG).is_dir():
                raise CheckpointError(f"model {i}: {sub / CHECKPOINT_TAG} is missing; was the checkpoint written "
                                      f"with strategy deepspeed?")
            if not self.section.load_universal and saved_world is not None and saved_world != self.world_size:
                raise CheckpointError(
                    f"{directory} was written by {saved_world} processes and this run has {self.world_size}: "
                    f"DeepSpeed cannot re-partition its ZeRO state by itself. Set deepspeed.load_universal: true "
                    f"to convert it to DeepSpeed's universal checkpoint (in a temporary directory next to it) "
                    f"and load that; by hand: python -m deepspeed.checkpoint.ds_to_universal --input_folder "
                    f"{sub / CHECKPOINT_TAG} --output_folder OUTPUT")
            install_safe_loader(rec.engine, io.trusted)
            with self._universal_copy(sub, io.trusted) if self.section.load_universal else \
                    contextlib.nullcontext((sub, CHECKPOINT_TAG)) as (load_dir, tag):
                try:
                    path, _ = rec.engine.load_checkpoint(str(load_dir), tag=tag, load_module_strict=True,
                                                         load_optimizer_states=rec.engine.optimizer is not None,
                                                         load_lr_scheduler_states=True)
                except CheckpointError:
                    raise
                except Exception as exc:
                    raise CheckpointError(f"model {i}: DeepSpeed could not load {sub}: "
                                          f"{type(exc).__name__}: {exc}") from exc
            if path is None:
                raise CheckpointError(f"model {i}: DeepSpeed found no checkpoint in {sub / CHECKPOINT_TAG}")

    @contextlib.contextmanager
    def _universal_copy(self, sub: Path, trusted: bool):
        """DeepSpeed's universal form of ``sub/ds`` in a temporary directory (rank 0 converts, all load).

        Written beside the checkpoint (every node sees it), never inside it, and removed after loading.
        """
        import shutil
        import subprocess
        import sys
        import tempfile

        from torchbay_deepspeed.safe_checkpoint import check_every_file

        workdir, error = "", ""
        if self.rank == 0:
            try:
                check_every_file(sub / CHECKPOINT_TAG, trusted)  # the converter unpickles freely
                workdir = tempfile.mkdtemp(prefix=f".{sub.parent.name}.universal-", dir=sub.parent.parent)
                cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                       str(sub / CHECKPOINT_TAG), "--output_folder", str(Path(workdir) / "universal"),
                       "--num_extract_workers", "1", "--num_merge_workers", "1"]
                env = {**os.environ, **ds_accelerator_env(self.device_backend.torch_type())}
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    error = (f"converting {sub / CHECKPOINT_TAG} to a universal checkpoint failed "
                             f"({' '.join(cmd)}):\n{(proc.stdout + proc.stderr)[-3000:]}")
            except Exception as exc:
                error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        workdir, error = self.broadcast_object((workdir, error))
        try:
            if error:
                raise CheckpointError(error)
            yield Path(workdir), "universal"
        finally:
            self.barrier()
            if self.rank == 0 and workdir:
                shutil.rmtree(workdir, ignore_errors=True)  # made by mkdtemp above: torchbay's own

    def _load_full_weights(self, rec: EngineRecord, state: dict, index: int) -> None:
        if not self._zero3(rec):
            try:
                rec.module.load_state_dict(state)
            except Exception as exc:
                raise CheckpointError(f"model {index} does not fit the saved weights: {exc}") from exc
            return
        names = dict(rec.module.named_parameters())
        missing = sorted(set(names) - set(state))
        if missing:
            raise CheckpointError(f"model {index}: the checkpoint lacks {', '.join(missing[:5])}")
        for name, param in names.items():  # one full parameter at a time
            with self.deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if self.rank == 0:
                    param.data.copy_(state[name])
        for name, buf in rec.module.named_buffers():
            if name in state:
                buf.data.copy_(state[name])


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
