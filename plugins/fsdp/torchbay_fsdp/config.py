"""The ``fsdp`` section of the torchbay config tree (``fsdp:`` in YAML, ``TORCHBAY_FSDP__KEY``,
``--fsdp-key`` on ``torchbay launch``)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from torchbay.plugin import DEFAULT_SCHEDULE, SCHEDULES, Section

DType = Literal["auto", "float32", "bfloat16", "float16"]


class FSDPConfig(Section):
    """Settings of the ``fsdp`` strategy. Defaults are PyTorch's own where PyTorch has one."""

    version: Literal[1, 2] = Field(
        2, description="2: torch.distributed.fsdp.fully_shard (any device with a process group); "
                       "1: FullyShardedDataParallel (needs an accelerator)")
    wrap_policy: Literal["transformer", "size", "none"] = Field(
        "transformer", description="which submodules become their own FSDP unit (the root always is one): "
                                   "transformer = blocks whose class is in transformer_layer_cls_to_wrap (or the "
                                   "model's _no_split_modules); size = submodules with >= min_num_params; "
                                   "none = root only")
    transformer_layer_cls_to_wrap: list[str] = Field(
        default_factory=list, description="class names of the blocks to wrap, e.g. [GPT2Block]")
    min_num_params: int = Field(100_000_000, ge=1, description="for wrap_policy: size")
    reshard_after_forward: bool = Field(
        True, description="true: free gathered parameters after forward (FULL_SHARD); "
                          "false: keep them until backward (SHARD_GRAD_OP)")
    backward_prefetch: Optional[Literal["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]] = Field(
        None, description="unset: PyTorch's default (BACKWARD_PRE in FSDP1, implicit one-module prefetch in FSDP2)")
    cpu_offload: bool = Field(False, description="keep sharded parameters, gradients and optimizer state in CPU memory")
    activation_checkpointing: bool = Field(False,
                                           description="recompute the activations of each wrapped block in backward")
    cpu_ram_efficient_loading: bool = Field(
        False, description="rank 0's weights are broadcast as shards; other ranks may build the model on the meta "
                           "device (with torch.device('meta'): model = Net()) and never hold a full copy")
    param_dtype: DType = Field(
        "auto", description="dtype parameters are gathered and computed in; auto: from mixed_precision "
                            "(bf16 -> bfloat16, fp16 -> float16, otherwise the parameters' own)")
    reduce_dtype: DType = Field(
        "auto", description="dtype gradients are reduced in; auto: float32 when param_dtype is lower, "
                            "else the gradients' own")


class ParallelismSection(Section):
    """The ``parallelism`` section: sizes of the N-D parallel dimensions of ``strategy: fsdp``
    (``torchbay.ParallelismConfig``; ``--dp-shard-size``, ``--tp-size``... on ``torchbay launch``).

    All sizes 1 (the default) with ``strategy: fsdp`` shards over every process (``dp_shard``
    = the world size). Otherwise the sizes multiply to the number of processes.
    """

    dp_replicate_size: int = Field(1, ge=1, description="replicas of the sharded model (HSDP when dp_shard_size > 1, "
                                                        "plain DDP alone)")
    dp_shard_size: int = Field(1, ge=1, description="processes each replica's parameters, gradients and optimizer "
                                                    "state are sharded over (FSDP)")
    tp_size: int = Field(1, ge=1, description="tensor parallel: processes that split each planned layer (tp_plan) "
                                              "and read the same batch")
    cp_size: int = Field(1, ge=1, description="context parallel: processes that split the sequence of each batch "
                                              "(SDPA attention; needs an accelerator)")
    sp_size: int = Field(1, ge=1, description="Ulysses sequence parallel: processes that split the sequence of each "
                                              "batch and exchange attention heads by all-to-all (any device; "
                                              "docs/parallelism.md)")
    sp_backend: Literal["torchbay", "deepspeed"] = Field(
        "torchbay", description="torchbay: its own Ulysses on the mesh; deepspeed: Accelerate's name, mapped onto the "
                                "same (no DeepSpeed needed)")
    sp_attn_implementation: Optional[str] = Field(
        None, description="attention run on the gathered sequence under sp: sdpa, eager, flash_attention_2/3; "
                          "unset: the model's own")
    sp_seq_length: Optional[int] = Field(None, ge=1, description="sp: the length of every batch's sequence, checked "
                                                                 "divisible by sp_size before training (unset: any)")
    ep_size: int = Field(1, ge=1, description="expert parallel: ranks each expert module's experts are split over, "
                                              "taken from the dp_shard ranks (divides dp_shard_size)")
    ep_plan: list[str] = Field(
        default_factory=list, description="module-name patterns (* = one name component) of the expert modules; "
                                          "empty: those torchbay recognises (3-D w1/w2/w3 or gate_up_proj/down_proj)")
    cp_comm_strategy: Literal["allgather", "alltoall"] = Field(
        "allgather", description="how the ranks of a cp group exchange keys and values")
    tp_plan: dict[str, Any] = Field(
        default_factory=dict, description="module-name pattern (* = one name component) -> style: colwise, rowwise, "
                                          "colwise_rep, rowwise_rep, local_colwise, local_rowwise, replicate, "
                                          "sequence_parallel (or a torch ParallelStyle object in Python); empty: the "
                                          "model's own tp_plan / _tp_plan attribute")
    pp_size: int = Field(1, ge=1, description="pipeline parallel: stages of whole blocks, one group of processes each "
                                              "(outermost mesh dimension)")
    pp_schedule: Literal[tuple(SCHEDULES)] = Field(  # type: ignore[valid-type]
        DEFAULT_SCHEDULE, description="pipeline schedule (torch.distributed.pipelining): GPipe, 1F1B, Interleaved1F1B, "
                                      "InterleavedZeroBubble, ZBVZeroBubble")
    pp_microbatches: Optional[int] = Field(
        None, ge=1, description="micro-batches each batch is cut into for the pipeline; unset: the number of stages")
    pp_virtual_stages: Optional[int] = Field(
        None, ge=1, description="stages per rank (Interleaved1F1B, InterleavedZeroBubble: 2 or more; "
                                "ZBVZeroBubble: 2); unset: 2 for those, 1 otherwise")
    pp_split_points: list[str] = Field(
        default_factory=list, description="blocks that start a new stage (e.g. [layers.4, layers.8]); empty: balanced "
                                          "by parameter count")
