"""The strategy axis: how the model is replicated or sharded across processes.

A :class:`Strategy` owns the process group. The base class implements everything with
plain ``torch.distributed`` collectives and full-state checkpoints, so a new strategy
overrides only what it changes (wrapping, backward, state dicts). Built-in: ``single``
and ``ddp``; sharded strategies are separate distributions.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterable

import torch
import torch.distributed as dist

from torchbay.axes.full_state import FullStateCheckpoint
from torchbay.compile.compiler import repeated_blocks
from torchbay.distributed.collectives import ProcessCollectives
from torchbay.distributed.parallelism_config import parallel_sizes, validate_sizes
from torchbay.errors import LaunchError

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.axes.context import RunContext


def _attempt_store(world_size: int, timeout_s: float | None):
    """Under torchrun's elastic agent, the store of this restart attempt.

    The agent keeps one store for the whole job and tells every attempt's workers to use it
    (``TORCHELASTIC_USE_AGENT_STORE``) without a per-attempt prefix: after a restart a fast rank
    could read the addresses the previous attempt's ranks published and fail to connect to a
    dead process. A prefix per attempt keeps every attempt to its own keys.
    """
    import os

    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    timeout = datetime.timedelta(seconds=timeout_s or 1800)
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"torchbay/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def _group_did_not_form(rank: int, world_size: int, timeout_s: float | None, exc: Exception):
    waited = f"within process_group_timeout_s={timeout_s:g}" if timeout_s else "in time"
    return LaunchError(
        f"rank {rank} of {world_size}: the process group did not form {waited} ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}). Every one of the {world_size} processes must "
        f"reach Accelerator()/PartialState(); check that all of them were started and that none is stuck or failed "
        f"before it (their logs), that MASTER_ADDR/MASTER_PORT reach rank 0, or give slow starts more time with "
        f"process_group_timeout_s (TORCHBAY_PROCESS_GROUP_TIMEOUT_S)")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per process for one strategy and precision (activations are not included)."""

    parameters: int
    gradients: int
    optimizer: int
    sharding_factor: int = 1
    note: str = ""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def optimizer_owners(models: list, optimizers: list) -> list[int | None]:
    """For each optimizer, the index of the one model that holds all its parameters, or
    ``None`` when its parameters span several models (or none)."""
    model_params = [{id(p) for p in m.parameters()} for m in models]
    owners: list[int | None] = []
    for opt in optimizers:
        ids = {id(p) for g in getattr(opt, "param_groups", None) or [] for p in g.get("params", [])}
        owners.append(next((i for i, params in enumerate(model_params) if ids and ids <= params), None))
    return owners


class Strategy(FullStateCheckpoint):
    """One way of running a model across processes.

    Class attributes: ``name`` (``config.strategy`` value), ``multi_process`` (whether it
    can run with more than one process), ``single_process`` (whether it can run with one).

    The collectives are a :class:`~torchbay.distributed.collectives.ProcessCollectives` the strategy holds
    (``collectives``); the methods of the same names below hand over to it, so a strategy overrides them as any
    other method. The default checkpoint methods come from
    :class:`~torchbay.axes.full_state.FullStateCheckpoint`, which declares what it reads of the strategy.
    """

    name: ClassVar[str] = ""
    multi_process: ClassVar[bool] = True
    single_process: ClassVar[bool] = True
    #: whether one process still needs a (private, one-rank) process group
    needs_process_group: ClassVar[bool] = False
    #: whether the strategy's own backward divides the loss for gradient accumulation
    handles_accumulation: ClassVar[bool] = False
    #: the N-D parallel dimensions (``parallelism.<dim>_size`` > 1; names in
    #: ``torchbay.distributed.parallelism_config.MESH_ORDER`` or the strategy's own) this strategy can build
    parallel_dims: ClassVar[tuple[str, ...]] = ()
    #: whether ``save_state(blocking=False)`` may copy the state in the call and run this strategy's
    #: ``save_checkpoint`` in a background thread on the copy (each model and optimizer replaced by
    #: an object whose ``state_dict()`` is the copy); needs a ``save_checkpoint`` that issues no
    #: collective. Otherwise such a save is synchronous, with a warning.
    async_checkpoint: ClassVar[bool] = False
    #: how many of this strategy's latest collective works are kept referenced (ProcessCollectives.wait)
    held_works: ClassVar[int] = 2

    def __init__(self, context: RunContext):
        self.context = context
        self.cluster = context.cluster
        self.device_backend = context.device_backend
        self.owns_process_group = False
        self.collectives = ProcessCollectives(self, keep=self.held_works)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()  # (the collectives drop their works themselves)

    # -- collectives (no-ops in one process; see torchbay.distributed.collectives) ---------------
    def barrier(self) -> None:
        self.collectives.barrier()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped tensors from every rank along dim 0."""
        return self.collectives.all_gather(tensor)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``op``: sum, mean, max, min or product; returns a new tensor."""
        return self.collectives.all_reduce(tensor, op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self.collectives.broadcast(tensor, src)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank (pickled, as torch's object collectives do)."""
        return self.collectives.broadcast_object(obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        return self.collectives.all_gather_object(obj)

    # -- validation ---------------------------------------------------------------------
    @classmethod
    def check(cls, context: RunContext) -> list[str]:
        """Problems with running this strategy in ``context`` (before any process group)."""
        problems = []
        world = context.cluster.world_size()
        if world > 1 and not cls.multi_process:
            problems.append(f"strategy '{cls.name}' runs one process but this job has {world}; "
                            f"set strategy: ddp (or another multi-process strategy)")
        if world == 1 and not cls.single_process:
            problems.append(f"strategy '{cls.name}' needs several processes; launch with "
                            f"torchbay launch --num-processes N")
        return problems + cls.check_parallel_dims(context)

    @classmethod
    def check_parallel_dims(cls, context: RunContext) -> list[str]:
        """Refuse ``parallelism`` sizes > 1 of dimensions not in ``parallel_dims``, naming the
        installed strategies that offer them; check that the sizes multiply to the world size."""
        sizes = parallel_sizes(context.config)
        if all(size == 1 for size in sizes.values()):
            return []
        wanted = [name for name, size in sizes.items() if size > 1 and name not in cls.parallel_dims]
        if wanted:
            offering = strategies_building(context.pm.registries()["strategies"], wanted)
            settings = ", ".join(f"parallelism.{name}_size {sizes[name]}" for name in wanted)
            fix = (f"select strategy: {' or '.join(offering)}" if offering else
                   "install a strategy plugin that offers them")
            return [f"strategy '{cls.name}' cannot build the parallel dimension(s) {', '.join(wanted)} "
                    f"({settings}); {fix}, or set those sizes to 1"]
        world_size = context.cluster.world_size()
        return validate_sizes(cls.built_sizes(context.config, world_size), world_size)

    @classmethod
    def built_sizes(cls, config: Any, world_size: int) -> dict[str, int]:
        """The mesh sizes this strategy builds for ``config`` on ``world_size`` processes: the ``parallelism``
        section's as given; a strategy that gives the processes left to one dimension (e.g. ``pp_size`` alone, each
        stage sharded over the rest) says so here, and the run's check, ``estimate-memory`` and the launch line use
        it."""
        return parallel_sizes(config)

    @classmethod
    def launch_env(cls, local_world_size: int, config: Any, device_cls: Any) -> dict[str, str]:
        """Environment the launcher gives workers when this strategy is selected (on
        ``device_cls``, the selected device class); computed before any worker starts."""
        return {}

    @classmethod
    def estimate_memory(cls, config: Any, world_size: int, counts: dict[str, int]) -> MemoryEstimate | None:
        """Per-process memory of a model with ``counts`` (``parameters``, ``trainable``) under ``config``.

        The default is a full replica per process: fp32 weights and gradients and Adam's two
        moments. ``None`` means the strategy gives no estimate; a combination the strategy would
        refuse to run (e.g. a precision it cannot do) raises :class:`IncompatibleSetupError`.
        """
        params, trainable = counts["parameters"], counts.get("trainable", counts["parameters"])
        return MemoryEstimate(parameters=params * 4, gradients=trainable * 4, optimizer=trainable * 8)

    @classmethod
    def memory_counts(cls, config: Any, model: torch.nn.Module) -> dict[str, int]:
        """Extra counts of ``model`` (built on the meta device) that this strategy's
        :meth:`estimate_memory` reads (e.g. how many parameters a tensor-parallel plan splits);
        ``torchbay estimate-memory`` merges them into ``counts``. Default: none."""
        return {}

    # -- process group ------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.cluster.world_size()

    @property
    def rank(self) -> int:
        return self.cluster.rank()

    @property
    def local_rank(self) -> int:
        return self.cluster.local_rank()

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    # -- data parallelism (N-D strategies override) ----------------------------------------
    @property
    def data_parallel_size(self) -> int:
        """How many different batches one step reads: the prepared data loaders split each
        global batch this many ways. The world size unless ranks share a batch (tensor or
        context parallel groups of an N-D strategy)."""
        return self.world_size

    @property
    def data_parallel_rank(self) -> int:
        """Which of the ``data_parallel_size`` parts this process reads (ranks of one tensor or
        context parallel group read the same part)."""
        return self.rank

    @property
    def device_mesh(self) -> Any:
        """The named ``torch.distributed.DeviceMesh`` of an N-D strategy (``accelerator.torch_device_mesh``), else
        None."""
        return None

    @property
    def parallelism_config(self) -> Any:
        """The ``ParallelismConfig`` this strategy runs (``accelerator.parallelism_config``), else None."""
        return None

    def context_parallel(self, buffers: list | None = None, buffer_seq_dims: list | None = None,
                         no_restore_buffers: set | None = None):
        """Context in which the sequence dimension of ``buffers`` is sharded across a context
        parallel group (``accelerator.maybe_context_parallel``); default: nothing to do."""
        return contextlib.nullcontext()

    def setup_environment(self, timeout_s: float | None = None) -> None:
        """Join the process group when there are several processes.

        With one process, a strategy that ``needs_process_group`` (a device mesh, a library
        that insists on one) gets a private one-rank group on an in-memory store.
        """
        if self.distributed or (self.world_size <= 1 and not self.needs_process_group):
            return
        kwargs: dict[str, Any] = dict(self.device_backend.process_group_kwargs())
        if timeout_s:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        backend = self.context.config.process_group_backend or self.device_backend.dist_backend()
        if self.world_size <= 1:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
            self.owns_process_group = True
            return
        self.cluster.export_torch_env()
        try:
            store = _attempt_store(self.world_size, timeout_s)
            if store is not None:
                kwargs["store"] = store
            dist.init_process_group(backend=backend, rank=self.rank, world_size=self.world_size, **kwargs)
        except (dist.DistStoreError, dist.DistNetworkError) as exc:
            raise _group_did_not_form(self.rank, self.world_size, timeout_s, exc) from exc
        self.owns_process_group = True

    def teardown(self, barrier: bool = True) -> None:
        """Destroy the process group this strategy created (gloo may abort at exit otherwise).

        ``barrier=False`` at interpreter exit: a rank dying of an exception must not wait for
        ranks stuck in another collective.
        """
        if self.owns_process_group and dist.is_initialized():
            if barrier:
                with contextlib.suppress(Exception):
                    self.collectives.wait(dist.barrier(async_op=True))
            dist.destroy_process_group()
        # the kept works go only now: had gloo's worker thread dropped the last reference to one
        # while this thread, holding the GIL, joined it in the group's destructor, both would wait
        # forever (seen with torch 2.13; see ProcessCollectives.wait)
        self.collectives.release()
        self.owns_process_group = False

    def accelerate_state_objects(self) -> dict[str, Any]:
        """Accelerate's backend objects this strategy shows on ``accelerator.state`` (by attribute name,
        e.g. a sharding plugin's settings object); none by default."""
        return {}

    def adapt_precision(self, precision):
        """Return the precision to use; a strategy with its own mixed precision may replace it."""
        return precision

    def grad_scaler(self, **kwargs):
        """The loss scaler an fp16 precision uses (``kwargs``: ``GradScalerKwargs``); the
        device's own by default, a sharding strategy's where gradients are sharded."""
        return self.device_backend.grad_scaler(**kwargs)

    # -- wrapping -----------------------------------------------------------------------
    def connect_dataloader(self, dataloader: Any) -> None:
        """Called with each user data loader passed to ``prepare``, before the models and
        optimizers of that call are set up (e.g. to read the batch size); default: nothing."""

    def wrap_batches(self, batches: Any) -> Any:
        """The iterable of this process's batches a prepared data loader serves (before device placement); a
        strategy that splits each batch further (the sequence across an ``sp`` group) wraps it; default: as is.
        A wrapper with a ``loop_length()`` method gives the prepared loader's ``len`` (else the inner loader's)."""
        return batches

    def setup(self, models: list, optimizers: list, schedulers: list) -> tuple[list, list, list]:
        """Wrap what one ``prepare`` call passed (any of the lists may be empty).

        The default moves and wraps each model with :meth:`wrap_model` and returns
        optimizers and schedulers unchanged.
        """
        return [self.wrap_model(m) for m in models], optimizers, schedulers

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device_backend.device)

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return getattr(model, "module", model) if self.is_wrapped(model) else model

    def compile_targets(self, model: Any, regional: bool = False) -> list[torch.nn.Module]:
        """The modules of the prepared ``model`` that the ``compile`` step compiles, each in place.

        Default: the user's module, or with ``regional`` its repeated blocks. Under a wrapper
        such as DDP they run inside its forward, where torch splits the graph at the gradient
        buckets so that the all-reduce still overlaps the backward. A strategy whose units must be
        compiled one by one (a sharding strategy's blocks) overrides this.
        """
        inner = self.unwrap_model(model)
        return repeated_blocks(inner) if regional else [inner]

    def is_wrapped(self, model: Any) -> bool:
        return False

    def backward(self, loss: torch.Tensor, model: Any = None, *, sync_gradients: bool = True, **kwargs) -> None:
        """Backpropagate ``loss`` (already scaled by the precision). ``sync_gradients`` is False on
        the micro-batches of an accumulation window that do not end it (gradients stay local)."""
        loss.backward(**kwargs)

    def pipeline_loss(self, model: Any, inputs: tuple, kwargs: dict, target: Any, loss_fn: Any,
                      accumulation_steps: int = 1) -> torch.Tensor:
        """``accelerator.pipeline_loss``: ``loss_fn(model(*inputs, **kwargs), target)``. A strategy that runs the
        model as a pipeline overrides it to run the whole schedule (forward and backward, the loss divided by
        ``accumulation_steps`` itself) and makes the next :meth:`backward` a no-op."""
        return loss_fn(model(*inputs, **kwargs), target)

    def no_sync(self, model: Any):
        """Context in which gradients are accumulated locally, not reduced."""
        return contextlib.nullcontext()

    def trigger_sync_in_backward(self, model: Any):
        """Context in which the next backward of ``model`` reduces gradients even inside :meth:`no_sync`.
        The default has nothing to re-arm (its ``no_sync`` defers nothing)."""
        return contextlib.nullcontext()

    #: whether :meth:`join_context` is offered (``accelerator.join_uneven_inputs``)
    joins_uneven_inputs: ClassVar[bool] = False

    def join_context(self, models: list) -> Any:
        """A context in which ranks that ran out of batches shadow the others' collectives (torch's ``Join``);
        offered when :attr:`joins_uneven_inputs` is True."""
        raise NotImplementedError(f"strategy '{self.name}' cannot join uneven inputs")

    def optimizer_step(self, optimizer: Any, **kwargs) -> Any:
        return self.device_backend.optimizer_step(optimizer, **kwargs)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(parameters, clip_value)


def strategies_building(registry: dict[str, Any], dims: Iterable[str]) -> list[str]:
    """The names, sorted, of the registered strategies whose ``parallel_dims`` include every one of ``dims``."""
    wanted = set(dims)
    return sorted(name for name, strategy in registry.items() if wanted <= set(getattr(strategy, "parallel_dims", ())))
