"""The ``fp8`` config section: settings every FP8 engine reads (an engine rejects what it cannot honour)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from torchbay.plugin import Section


class FP8Config(Section):
    """``fp8:`` in the torchbay config; ``fp8.backend`` picks the engine of ``mixed_precision: fp8``."""

    backend: str = Field("auto", description="FP8 engine: an installed engine's name, or auto")
    recipe: Literal["tensorwise", "rowwise", "delayed", "current", "block", "mxfp8"] = "tensorwise"
    format: Literal["E4M3", "HYBRID"] = Field("HYBRID", description="HYBRID: E4M3 forward, E5M2 backward")
    margin: int = Field(0, ge=0)
    amax_history_len: int = Field(16, ge=1)
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    include: list[str] = Field(default_factory=list,
                               description="convert only modules whose name matches one of these regexes")
    exclude: list[str] = Field(default_factory=list,
                               description="never convert modules whose name matches one of these regexes")
    keep_first_and_last: bool = Field(True, description="keep the first and last Linear in higher precision")
    outer_autocast: bool = Field(True, description="keep a bf16 autocast around the FP8 forward")
    filter_small_layers: Optional[bool] = Field(
        None, description="leave a Linear too small to gain from FP8 (K*N/(K+N) below engine_options."
                          "small_layer_threshold, 1024) in higher precision; null: on, off when the engine "
                          "emulates FP8")
    engine_options: dict[str, Any] = Field(default_factory=dict, description="passed to the engine as is")
