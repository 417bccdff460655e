"""Accelerate's ``ParallelismConfig``: the sizes of the N-D parallel dimensions.

The user-facing object only. It names no strategy: the sizes (and a tensor-parallel plan)
become the ``parallelism`` config section, which a strategy plugin that can build N-D
parallelism contributes; that strategy builds the one named ``DeviceMesh`` and applies
each dimension. A strategy declares the dimensions it can build in
``Strategy.parallel_dims``; the selected strategy's ``check`` refuses the others.

Dimensions, in mesh order (outermost first): ``pp`` (pipeline stages: whole blocks of layers,
:mod:`torchbay.distributed.pipeline_config`), ``dp_replicate`` (replicas, as DDP),
``dp_shard`` (sharded data parallel), ``cp`` (context parallel: the sequence), ``sp`` (Ulysses
sequence parallel: the sequence, all-to-all over heads around attention), ``tp`` (tensor
parallel: inside layers). Flattened: ``dp`` = dp_replicate x dp_shard (ranks with different
data), ``dp_shard_cp`` = dp_shard x cp (what the model is sharded over), ``dp_cp`` = dp_replicate x
dp_shard x cp (what the loss is averaged over).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from torchbay.distributed.pipeline_config import DEFAULT_SCHEDULE, check_pipeline
from torchbay.errors import ConfigError

#: mesh dimensions in mesh order (outermost first)
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")
#: the config section a strategy plugin that builds N-D parallelism contributes
SECTION = "parallelism"
CP_COMM_STRATEGIES = ("allgather", "alltoall")
#: attention implementations the Ulysses wrapper runs on the gathered sequence (or a hub flash-attention kernel)
SP_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
#: Accelerate's environment variables for the fields left unset (``accelerate launch`` writes them)
ENV_PREFIX = "PARALLELISM_CONFIG_"


def _from_env(field_name: str, default: Any, kind: type = str) -> Any:
    """``PARALLELISM_CONFIG_<FIELD>`` as ``kind``, or ``default`` when it is not set."""
    variable = ENV_PREFIX + field_name.upper()
    raw = os.environ.get(variable)
    if raw is None or raw.strip() == "":
        return default
    try:
        return kind(raw.strip())
    except ValueError:
        raise ConfigError(f"{variable}={raw!r}: give a whole number (the size of that parallel dimension), or "
                          f"unset it") from None


@dataclass
class TorchTensorParallelConfig:
    """Accelerate's tensor-parallel handler. ``enable_async_tp`` is not supported (an error when true)."""

    enable_async_tp: bool = False

    def __post_init__(self):
        if self.enable_async_tp:
            raise ConfigError("TorchTensorParallelConfig(enable_async_tp=True) is not supported by torchbay; "
                              "leave enable_async_tp=False")


@dataclass
class TorchContextParallelConfig:
    """Accelerate's context-parallel handler: how the ranks of a ``cp`` group exchange keys and values."""

    cp_comm_strategy: Optional[str] = None

    def __post_init__(self):
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = _from_env("cp_comm_strategy", "allgather")
        if self.cp_comm_strategy not in CP_COMM_STRATEGIES:
            raise ConfigError(f"Invalid cp_comm_strategy: {self.cp_comm_strategy} (TorchContextParallelConfig("
                              f"cp_comm_strategy=...) or {ENV_PREFIX}CP_COMM_STRATEGY); use one of "
                              f"{', '.join(CP_COMM_STRATEGIES)}")


@dataclass
class DeepSpeedSequenceParallelConfig:
    """Accelerate's sequence-parallel handler (its name, for Trainer/TRL): torchbay runs its own Ulysses with it.

    ``sp_seq_length``: the sequence length of every batch (checked divisible by sp_size at config time) when
    ``sp_seq_length_is_variable`` is false; ``sp_attn_implementation``: the attention run on the gathered
    sequence (``sdpa``, ``eager``, ``flash_attention_2/3`` or a hub flash-attention kernel; unset: the model's own).
    """

    sp_seq_length: Optional[int] = None
    sp_seq_length_is_variable: Optional[bool] = None
    sp_attn_implementation: Optional[str] = None

    def __post_init__(self):
        if self.sp_seq_length_is_variable is None:
            self.sp_seq_length_is_variable = _from_env("sp_seq_length_is_variable", "true").lower() == "true"
        if self.sp_seq_length is None:
            raw = _from_env("sp_seq_length", None)
            self.sp_seq_length = None if raw in (None, "None") else int(raw)
        if not self.sp_seq_length_is_variable and self.sp_seq_length is None:
            raise ConfigError("DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=False) needs sp_seq_length "
                              f"(or {ENV_PREFIX}SP_SEQ_LENGTH): give the length of every batch, or leave "
                              f"sp_seq_length_is_variable unset")
        if self.sp_attn_implementation is None:
            self.sp_attn_implementation = _from_env("sp_attn_implementation", None)
        impl = self.sp_attn_implementation
        if impl is not None and impl not in SP_ATTN_IMPLEMENTATIONS and not ("/" in impl and "flash-attn" in impl):
            raise ConfigError(f"Invalid sp_attn_implementation: {impl!r}; use one of "
                              f"{', '.join(SP_ATTN_IMPLEMENTATIONS)} or a hub flash-attention kernel "
                              f"('kernels-community/flash-attn2'), or leave it unset (the model's own)")


@dataclass
class ParallelismConfig:
    """Sizes of the parallel dimensions, with Accelerate 1.15's fields and rules.

    ``tp_plan`` (torchbay's field) maps module-name patterns (``*`` matches one name
    component, e.g. ``"blocks.*.attn.q"``) to a style string (``"colwise"``, ``"rowwise"``,
    ``"colwise_rep"``, ``"rowwise_rep"``, ``"local_colwise"``, ``"local_rowwise"``,
    ``"replicate"``, ``"sequence_parallel"``) or a torch ``ParallelStyle`` object. Without
    one, the model's own ``tp_plan`` / ``_tp_plan`` attribute is used.

    - ``dp_replicate_size > 1`` alone is plain data parallelism (DDP).
    - ``dp_replicate_size > 1`` with ``dp_shard_size > 1`` is HSDP.
    - ``tp_size`` / ``cp_size > 1`` with ``dp_replicate_size > 1`` needs ``dp_shard_size > 1``.
    - all sizes multiply to the number of processes (checked when the Accelerator starts).

    Pipeline parallel (torchbay's fields; docs/parallelism.md): ``pp_size`` stages of whole blocks,
    run by ``pp_schedule`` (GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble) over
    ``pp_microbatches`` micro-batches per batch, ``pp_virtual_stages`` stages per rank for the
    interleaved/V schedules, cut before the blocks ``pp_split_points`` names (else balanced by
    parameter count).
    """

    dp_replicate_size: Optional[int] = None
    dp_shard_size: Optional[int] = None
    tp_size: Optional[int] = None
    cp_size: Optional[int] = None
    cp_backend: Optional[str] = None
    sp_size: Optional[int] = None
    sp_backend: Optional[str] = None
    tp_handler: Optional[TorchTensorParallelConfig] = None
    cp_handler: Optional[TorchContextParallelConfig] = None
    sp_handler: Any = None
    tp_plan: Optional[dict] = None
    #: expert parallel (torchbay's field): experts split over ep ranks taken from dp_shard (not a mesh dimension)
    ep_size: Optional[int] = None
    #: module-name patterns of the expert modules (unset: the strategy recognises them)
    ep_plan: Optional[list] = None
    pp_size: Optional[int] = None
    pp_schedule: Optional[str] = None
    pp_microbatches: Optional[int] = None
    pp_virtual_stages: Optional[int] = None
    pp_split_points: Optional[list] = None
    #: the mesh the selected strategy built (set when an Accelerator takes this config)
    device_mesh: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        for name in ("pp_size", "dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size", "ep_size"):
            value = getattr(self, name)
            value = _from_env(name, 1, int) if value is None else value
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ParallelismConfig({name}={value!r}): a size is an integer of at least 1")
            setattr(self, name, value)
        self.cp_backend = self.cp_backend or _from_env("cp_backend", "torch")
        # which names a backend takes is the strategy's (its parallelism section): torchbay's own Ulysses, and the
        # name Accelerate gives sp_backend, which that strategy maps onto it
        self.sp_backend = self.sp_backend or _from_env("sp_backend", "torchbay")
        problems = validate_sizes(self.sizes)
        if self.cp_backend != "torch":
            problems.append(f"ParallelismConfig(cp_backend={self.cp_backend!r}): the only context-parallel backend "
                            f"is 'torch' (torch.distributed.tensor.experimental.context_parallel)")
        if not isinstance(self.sp_backend, str):
            problems.append(f"ParallelismConfig(sp_backend={self.sp_backend!r}): give the backend's name")
        if self.sp_handler is not None and not isinstance(self.sp_handler, DeepSpeedSequenceParallelConfig):
            problems.append(f"ParallelismConfig(sp_handler={type(self.sp_handler).__name__}): give a "
                            f"torchbay.utils.DeepSpeedSequenceParallelConfig (or leave it unset)")
        if self.cp_handler is not None and not isinstance(self.cp_handler, TorchContextParallelConfig):
            problems.append(f"ParallelismConfig(cp_handler={type(self.cp_handler).__name__}): cp_backend 'torch' "
                            f"takes a torchbay.TorchContextParallelConfig")
        if self.tp_plan is not None and not isinstance(self.tp_plan, dict):
            problems.append(f"ParallelismConfig(tp_plan={type(self.tp_plan).__name__}): give a mapping of module-name "
                            f"pattern to style, e.g. {{'blocks.*.up': 'colwise', 'blocks.*.down': 'rowwise'}}")
        if self.ep_size > 1 and self.dp_shard_size % self.ep_size:
            problems.append(f"ParallelismConfig(ep_size={self.ep_size}) must divide dp_shard_size "
                            f"{self.dp_shard_size}: experts are split over ep ranks taken from the dp_shard ranks")
        self.pp_schedule = self.pp_schedule or _from_env("pp_schedule", DEFAULT_SCHEDULE)
        problems += check_pipeline(self.pp_size, self.pp_schedule, self.pp_microbatches, self.pp_virtual_stages,
                                   "ParallelismConfig")
        if problems:
            raise ConfigError(problems)
        if self.tp_size > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if self.cp_size > 1 and self.cp_handler is None:
            self.cp_handler = TorchContextParallelConfig()
        if self.sp_size > 1 and self.sp_handler is None:
            self.sp_handler = DeepSpeedSequenceParallelConfig()
        if self.sp_handler is not None and self.sp_handler.sp_seq_length and self.sp_size > 1 \
                and self.sp_handler.sp_seq_length % self.sp_size:
            raise ConfigError(f"DeepSpeedSequenceParallelConfig(sp_seq_length={self.sp_handler.sp_seq_length}) is "
                              f"not divisible by sp_size {self.sp_size}: pad the batches to a multiple of "
                              f"{self.sp_size} (e.g. the collator's pad_to_multiple_of) and give that length")

    # -- sizes -----------------------------------------------------------------------------
    @property
    def sizes(self) -> dict[str, int]:
        """Every dimension's size, in mesh order."""
        return {name: getattr(self, f"{name}_size") for name in MESH_ORDER}

    @property
    def total_size(self) -> int:
        return self.pp_size * self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size * self.sp_size

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        return self.pp_size * self.tp_size * self.cp_size * self.sp_size

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp_size > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    # -- dimension names (as Accelerate names them) -------------------------------------------
    @property
    def dp_dim_names(self) -> list[str]:
        """Enabled dimensions across which the data differ."""
        return [n for n in ("dp_replicate", "dp_shard") if self.sizes[n] > 1]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Enabled dimensions whose ranks get the same batch."""
        return [n for n in ("tp", "cp", "sp") if self.sizes[n] > 1]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """Enabled dimensions flattened into the one the model is sharded over."""
        return [n for n in ("dp_shard", "cp") if self.sizes[n] > 1]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Enabled dimensions across which the loss is averaged."""
        return [n for n in ("dp_replicate", "dp_shard", "cp") if self.sizes[n] > 1]

    @property
    def fsdp_dim_names(self) -> list[str]:
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        """Enabled dimensions, data-parallel ones first (Accelerate's order; the mesh itself is in
        :data:`MESH_ORDER`, see :meth:`_get_mesh`)."""
        return self.dp_dim_names + self.non_dp_dim_names

    # -- the mesh ---------------------------------------------------------------------------
    def _get_mesh(self) -> tuple:
        """``(dimension names, sizes)`` of the enabled dimensions in mesh order (outermost first), as
        ``init_device_mesh`` takes them; ``()`` when every size is 1."""
        enabled = [(name, size) for name, size in self.sizes.items() if size > 1]
        return tuple(zip(*enabled))

    def build_device_mesh(self, device_type: str):
        """A new ``DeviceMesh`` of the enabled dimensions on ``device_type`` (every process of the default
        group must call it), with the flattened dimensions ``dp``, ``dp_shard_cp`` and ``dp_cp`` where
        their parts are enabled; ``None`` when every size is 1."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = self._get_mesh()
        if not mesh:
            return None
        names, shape = mesh
        device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        for parts, flat in ((self.dp_dim_names, "dp"), (self.dp_shard_cp_dim_names, "dp_shard_cp"),
                            (self.dp_cp_dim_names, "dp_cp")):
            if parts:
                device_mesh[parts]._flatten(flat)
        return device_mesh

    # -- torchbay config ------------------------------------------------------------------------
    def to_config(self) -> dict[str, Any]:
        """Dotted values of the ``parallelism`` config section (``Accelerator(parallelism_config=...)``)."""
        out: dict[str, Any] = {f"{SECTION}.{name}_size": size for name, size in self.sizes.items()
                               if name != "pp" or size > 1}
        if self.cp_handler is not None:
            out[f"{SECTION}.cp_comm_strategy"] = self.cp_handler.cp_comm_strategy
        if self.tp_plan is not None:
            out[f"{SECTION}.tp_plan"] = dict(self.tp_plan)
        if self.sp_size > 1:
            out[f"{SECTION}.sp_backend"] = self.sp_backend
        if self.ep_size > 1:
            out[f"{SECTION}.ep_size"] = self.ep_size
        if self.ep_plan is not None:
            out[f"{SECTION}.ep_plan"] = list(self.ep_plan)
        if self.sp_handler is not None and self.sp_size > 1:
            out[f"{SECTION}.sp_attn_implementation"] = self.sp_handler.sp_attn_implementation
            out[f"{SECTION}.sp_seq_length"] = self.sp_handler.sp_seq_length
        for name in ("pp_schedule", "pp_microbatches", "pp_virtual_stages", "pp_split_points"):
            if getattr(self, name) is not None and (self.pp_size > 1 or name != "pp_schedule"):
                out[f"{SECTION}.{name}"] = getattr(self, name)
        return out

    @classmethod
    def from_section(cls, section: Any) -> "ParallelismConfig":
        """The object for a resolved ``parallelism`` section."""
        return cls(**{f"{n}_size": getattr(section, f"{n}_size", 1) or 1 for n in MESH_ORDER},
                   cp_handler=TorchContextParallelConfig(getattr(section, "cp_comm_strategy", "allgather")),
                   tp_plan=getattr(section, "tp_plan", None) or None, sp_backend="torchbay",
                   ep_size=getattr(section, "ep_size", 1) or 1, ep_plan=getattr(section, "ep_plan", None) or None,
                   sp_handler=DeepSpeedSequenceParallelConfig(
                       getattr(section, "sp_seq_length", None), getattr(section, "sp_seq_length", None) is None,
                       getattr(section, "sp_attn_implementation", None))
                   if (getattr(section, "sp_size", 1) or 1) > 1 else None,
                   pp_schedule=getattr(section, "pp_schedule", None),
                   pp_microbatches=getattr(section, "pp_microbatches", None),
                   pp_virtual_stages=getattr(section, "pp_virtual_stages", None),
                   pp_split_points=getattr(section, "pp_split_points", None) or None)

    def get_device_mesh(self, device_type: Optional[str] = None):
        """The mesh of this config: the one the selected strategy built (``accelerator.torch_device_mesh``), else
        one built now on ``device_type`` (:meth:`build_device_mesh`)."""
        if self.device_mesh is None:
            if device_type is None:
                raise ConfigError("ParallelismConfig.get_device_mesh(): no mesh was built yet; pass the device type "
                                  "(get_device_mesh('cpu')), or let an Accelerator take this config "
                                  "(Accelerator(parallelism_config=...)) and read accelerator.torch_device_mesh")
            self.device_mesh = self.build_device_mesh(device_type)
            return self.device_mesh
        if device_type is not None and self.device_mesh.device_type != device_type:
            raise ConfigError(f"ParallelismConfig.get_device_mesh({device_type!r}): the mesh was built for "
                              f"{self.device_mesh.device_type!r}")
        return self.device_mesh


def validate_sizes(sizes: dict[str, int], world_size: Optional[int] = None, where: str = "parallelism") -> list[str]:
    """Accelerate's rules for a set of sizes; with ``world_size``, also that they multiply to it."""
    problems = []
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            problems.append(f"{where}.{name}_size is {size!r}; a size is an integer of at least 1")
    if problems:
        return problems
    if sizes.get("cp", 1) > 1 and sizes.get("sp", 1) > 1:
        problems.append(f"{where}: cp_size {sizes['cp']} and sp_size {sizes['sp']} both shard the sequence; set one "
                        f"of them to 1 (docs/parallelism.md: cp or sp)")
    if (sizes.get("tp", 1) > 1 or sizes.get("cp", 1) > 1) and sizes.get("dp_replicate", 1) > 1 \
            and sizes.get("dp_shard", 1) == 1:
        problems.append(f"{where}: tp_size/cp_size > 1 with dp_replicate_size {sizes['dp_replicate']} and "
                        f"dp_shard_size 1 (tensor/context parallel on top of plain data parallelism) is not "
                        f"supported; set dp_shard_size instead of dp_replicate_size (sharded + TP/CP), or both "
                        f"(HSDP + TP/CP)")
    if world_size is not None:
        total = 1
        for size in sizes.values():
            total *= size
        if total != world_size:
            described = " x ".join(f"{n}_size {s}" for n, s in sizes.items() if s > 1) or "all sizes 1"
            problems.append(f"{where}: {described} = {total} processes, but this run has {world_size}; make the "
                            f"sizes multiply to {world_size} (or launch {total} processes)")
    return problems


def parallel_sizes(config: Any) -> dict[str, int]:
    """The sizes in a resolved config's ``parallelism`` section; all 1 when no plugin contributes one."""
    section = getattr(config, SECTION, None)
    return {name: int(getattr(section, f"{name}_size", 1) or 1) for name in MESH_ORDER}
