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
import importlib.util
import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from torchbay.errors import ConfigError, IncompatibleSetupError, TorchbayError
from torchbay.plugin import MemoryEstimate, Strategy
from torchbay_deepspeed import auto_values
from torchbay_deepspeed import config as dsconfig
from torchbay_deepspeed.checkpoint import DeepSpeedCheckpoint
from torchbay_deepspeed.compat import DeepSpeedPlugin
from torchbay_deepspeed.engine import DS_ACCELERATORS, EngineRecord, _param_ids, ds_accelerator_env, import_deepspeed
from torchbay_deepspeed.objects import (
    DeepSpeedSchedulerWrapper,
    DummyOptim,
    DummyScheduler,
    EngineOptimizer,
    PendingEngine,
)
from torchbay_deepspeed.precision import DeepSpeedPrecision
from torchbay_deepspeed.safe_checkpoint import install_safe_loader
from torchbay_deepspeed.step import DeepSpeedStep

log = logging.getLogger("torchbay.deepspeed")


class DeepSpeedStrategy(DeepSpeedStep, DeepSpeedCheckpoint, Strategy):
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
        if config.mixed_precision in dsconfig.FP8_MODES:
            raise IncompatibleSetupError([dsconfig.FP8_REFUSAL.replace("fp8", config.mixed_precision, 1)])
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
            found = [*dsconfig.device_problems(base, context.device_backend_cls),
                     *dsconfig.checkpoint_writer_problems(base)]
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
        cfg, _, _ = auto_values.fill_auto(self.base_config, micro_batch=self._micro_batch(), world_size=self.world_size,
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
            early = auto_values.accelerate_fills(cfg, optimizer=user_opt if dummy else None, scheduler=sched,
                                              num_processes=self.world_size,
                                              split_batches=self.context.config.dataloader.split_batches)
        filled, report, problems = auto_values.fill_auto(
            cfg, micro_batch=self._micro_batch(), world_size=self.world_size, model=model,
            optimizer_hint=opt_hint, scheduler_hint=sched.params if sched is not None else None,
            has_optimizer=has_opt)
        report = early + report
        if problems:
            raise ConfigError(problems, header=f"DeepSpeed config of model {rec.index} cannot be completed")
        if live is not None:
            auto_values.write_back(live, filled)  # as Accelerate fills the plugin's config in place
        kwargs: dict[str, Any] = {"model": model, "config": filled, "dist_init_required": False}
        if user_opt is not None and not dummy:
            kwargs["optimizer"] = user_opt
        elif has_opt:
            kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
        if sched is not None and sched.lr_scheduler_callable is not None:
            kwargs["lr_scheduler"] = sched.lr_scheduler_callable
        engine, _, _, _ = ds.initialize(**kwargs)
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
