"""The ``fp8`` config section: settings every FP8 (and FP4: ``mixed_precision: fp4`` reads it too) engine reads;
an engine rejects what it cannot honour. The per-layer policy (include/exclude, small layers, positional rules) is
applied by :func:`torchbay_fp8.linears.plan_linears` for every engine."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from torchbay.plugin import Section


class FP8Config(Section):
    """``fp8:`` in the torchbay config; ``fp8.backend`` picks the engine of ``mixed_precision: fp8``."""

    backend: str = Field("auto", description="FP8 engine: an installed engine's name, or auto")
    recipe: Literal["tensorwise", "rowwise", "delayed", "current", "block", "mxfp8", "mxfp4", "nvfp4"] = Field(
        "tensorwise", description="scaling recipe; mxfp4 / nvfp4 with mixed_precision: fp4 (unset there: the "
                                  "engine's FP4 recipe); docs/precision.md says which engine and hardware run each")
    format: Literal["E4M3", "HYBRID", "E5M2"] = Field("HYBRID", description="HYBRID: E4M3 forward, E5M2 backward")
    emulate: bool = Field(False, description="compute the recipe's numerics in high precision where the hardware "
                                             "cannot run it (torchao; slow: for tests and numerics studies)")
    margin: int = Field(0, ge=0)
    amax_history_len: int = Field(16, ge=1)
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    include: list[str] = Field(default_factory=list,
                               description="convert only modules whose name matches one of these regexes")
    exclude: list[str] = Field(default_factory=list,
                               description="never convert modules whose name matches one of these regexes")
    keep_first_and_last: bool = Field(True, description="keep the first and last Linear in higher precision")
    blocks: Optional[str] = Field(None, description="the ModuleList of the model's blocks, by name, for the "
                                                    "keep_*_blocks rules; null: the longest ModuleList")
    keep_first_blocks: int = Field(0, ge=0, description="keep the Linears of the first N blocks in higher precision")
    keep_last_blocks: int = Field(0, ge=0, description="keep the Linears of the last N blocks in higher precision")
    keep_last_blocks_fraction: float = Field(0.0, ge=0.0, le=1.0,
                                             description="keep the last fraction of blocks (rounded up) in higher "
                                                         "precision (torchtitan keeps the last blocks of FP4 runs)")
    outer_autocast: bool = Field(True, description="keep a bf16 autocast around the FP8 forward")
    filter_small_layers: Optional[bool] = Field(
        None, description="leave a Linear too small to gain from FP8 (K*N/(K+N) below engine_options."
                          "small_layer_threshold, 1024) in higher precision; null: on, off when the engine "
                          "emulates FP8")
    engine_options: dict[str, Any] = Field(default_factory=dict, description="passed to the engine as is")
