"""Accelerate's FP8 ``kwargs_handlers`` (``AORecipeKwargs``, ``TERecipeKwargs``, ``MSAMPRecipeKwargs`` and the
deprecated ``FP8RecipeKwargs``), served as settings of the ``fp8`` config section.

Each handler gives the keys it was given as the ``fp8_config`` mapping of an Accelerate config file
(``accelerate_section`` and :meth:`FP8Handler.accelerate_keys`); ``Accelerator`` reads them with the same table
``torchbay config import-accelerate`` and ``launch --fp8_*`` use (the ``accelerate.yaml`` of torchbay-fp8 and its
engine plugins), so a handler and the equivalent YAML give one ``fp8`` section, and records each value's source
as the handler's keyword: ``describe_source`` and every config error say ``kwargs handler
TERecipeKwargs(margin=2)``. A key no installed engine plugin maps is a config error naming the keyword. Keys left
``None`` are not settings: Accelerate's defaults for them are filled into the object (a script may read them)
but the config keeps torchbay's.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Optional

from torchbay.errors import ConfigError

#: the modes a handler of this module needs (``mixed_precision``)
FP8_MODES = ("fp8", "fp4")
TE_FORMATS = ("HYBRID", "E4M3", "E5M2")
AMAX_ALGOS = ("max", "most_recent")
OPT_LEVELS = ("O1", "O2")


class FP8Handler:
    """What every FP8 handler shares: the keys it was given, as Accelerate's ``fp8_config``."""

    #: Accelerate's nested config the handler stands for
    accelerate_section: ClassVar[str] = "fp8_config"
    #: ``fp8_config.backend`` in Accelerate's spelling
    backend_value: ClassVar[str] = ""
    needs_mixed_precision: ClassVar[tuple[str, ...]] = FP8_MODES

    def accelerate_keys(self) -> dict[str, tuple[Any, Optional[str]]]:
        """``{fp8_config key: (value, the keyword that set it, or None)}`` for the keywords given."""
        keys: dict[str, tuple[Any, Optional[str]]] = {"backend": (self.backend_value, None)}
        for f in fields(self):
            if f.name in self._given:
                value = getattr(self, f.name)
                keys[f.name] = (list(value) if isinstance(value, tuple) else value, f.name)
        return keys

    def to_kwargs(self) -> dict[str, Any]:
        """The keywords given (Accelerate's ``KwargsHandler.to_kwargs``: the values that are not defaults)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in self._given}

    def _label(self, keyword: str, value: Any) -> str:
        return f"kwargs handler {type(self).__name__}({keyword}={value!r})"


def _flag(value: Optional[bool]) -> Optional[bool]:
    return None if value is None else bool(value)


@dataclass
class AORecipeKwargs(FP8Handler):
    """torchao FP8 (``fp8.backend: torchao``). ``config``, a torchao ``Float8LinearConfig``, is read back into
    ``fp8.recipe`` (tensorwise, rowwise or rowwise_with_gw_hp), ``fp8.emulate`` and the engine options it
    matches; ``module_filter_func(module, fqn)`` further narrows the Linears the policy converts (and, as in
    Accelerate, replaces the keep-first-and-last rule)."""

    config: Any = None
    module_filter_func: Optional[Callable] = None
    pad_inner_dim: Optional[bool] = None
    enable_fsdp_float8_all_gather: Optional[bool] = None

    backend_value: ClassVar[str] = "AO"

    def __post_init__(self):
        self._given = {f.name for f in fields(self) if getattr(self, f.name) is not None}
        if importlib.util.find_spec("torchao") is None:
            raise ImportError("AORecipeKwargs needs torchao: pip install torchbay-fp8-torchao")

    def accelerate_keys(self) -> dict[str, tuple[Any, Optional[str]]]:
        keys: dict[str, tuple[Any, Optional[str]]] = {"backend": (self.backend_value, None)}
        for key in ("pad_inner_dim", "enable_fsdp_float8_all_gather"):
            if key in self._given:
                keys[key] = (_flag(getattr(self, key)), key)
        return keys

    def torchbay_config(self) -> dict[str, tuple[Any, str]]:
        """What ``config`` and ``module_filter_func`` say (no ``fp8_config`` key of Accelerate's holds them)."""
        out: dict[str, tuple[Any, str]] = {}
        if self.config is not None:
            for dotted, value in float8_config_settings(self.config).items():
                out[dotted] = (value, self._label("config", type(self.config).__name__ + "(...)"))
        if self.module_filter_func is not None:
            out["fp8.keep_first_and_last"] = (False, self._label("module_filter_func", self.module_filter_func))
        return out


def float8_config_settings(config: Any) -> dict[str, Any]:
    """torchao's ``Float8LinearConfig`` as ``fp8`` settings: the torchao recipe whose casts it has, and the
    flags torchbay exposes; a config no recipe matches is a ConfigError naming the fields that differ."""
    from torchao.float8 import Float8LinearConfig

    flags = ("emulate", "enable_fsdp_float8_all_gather", "pad_inner_dim", "round_scales_to_power_of_2")
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        base = Float8LinearConfig.from_recipe_name(recipe)
        differ = [f for f in base.__dataclass_fields__ if f not in flags and getattr(base, f) != getattr(config, f)]
        if not differ:
            break
    else:
        raise ConfigError(f"kwargs handler AORecipeKwargs(config=...): this Float8LinearConfig matches no torchao "
                          f"recipe torchbay offers (tensorwise, rowwise, rowwise_with_gw_hp); fields that differ from "
                          f"tensorwise: {', '.join(differ)}. Use fp8.engine_options.recipe_name, or the defaults")
    out: dict[str, Any] = {"fp8.backend": "torchao"}
    if recipe == "rowwise_with_gw_hp":
        out["fp8.engine_options.recipe_name"] = recipe
    else:
        out["fp8.recipe"] = recipe
    if config.emulate:
        out["fp8.emulate"] = True
    for key in ("enable_fsdp_float8_all_gather", "pad_inner_dim", "round_scales_to_power_of_2"):
        if getattr(config, key) != getattr(Float8LinearConfig(), key):
            out[f"fp8.engine_options.{key}"] = bool(getattr(config, key))
    return out


@dataclass
class TERecipeKwargs(FP8Handler):
    """Transformer Engine (``fp8.backend: te``): delayed scaling unless ``use_mxfp8_block_scaling``."""

    use_autocast_during_eval: Optional[bool] = None
    margin: Optional[int] = None
    interval: Optional[int] = None
    fp8_format: Optional[str] = None
    amax_history_len: Optional[int] = None
    amax_compute_algo: Optional[str] = None
    override_linear_precision: Optional[tuple] = None
    use_mxfp8_block_scaling: Optional[bool] = None

    backend_value: ClassVar[str] = "TE"

    def __post_init__(self):
        self._given = {f.name for f in fields(TERecipeKwargs) if getattr(self, f.name) is not None}
        self._fill_te_defaults()

    def _fill_te_defaults(self) -> None:
        """Accelerate's values for the keywords left out, on the object only (the config keeps torchbay's)."""
        if self.fp8_format is not None:
            self.fp8_format = str(self.fp8_format).upper()
            if self.fp8_format not in TE_FORMATS:
                raise ConfigError(f"TERecipeKwargs(fp8_format={self.fp8_format!r}): use one of {', '.join(TE_FORMATS)}")
        if self.amax_compute_algo is not None:
            self.amax_compute_algo = str(self.amax_compute_algo).lower()
            if self.amax_compute_algo not in AMAX_ALGOS:
                raise ConfigError(f"TERecipeKwargs(amax_compute_algo={self.amax_compute_algo!r}): use one of "
                                  f"{', '.join(AMAX_ALGOS)}")
        defaults = {"use_autocast_during_eval": False, "margin": 0, "interval": 1, "fp8_format": "HYBRID",
                    "amax_history_len": 1024, "amax_compute_algo": "most_recent",
                    "override_linear_precision": (False, False, False), "use_mxfp8_block_scaling": False}
        for key, value in defaults.items():
            if getattr(self, key) is None:
                setattr(self, key, value)


@dataclass
class MSAMPRecipeKwargs(FP8Handler):
    """MS-AMP (``fp8.backend: msamp``): ``opt_level`` is ``fp8.engine_options.opt_level``."""

    opt_level: Optional[str] = None

    backend_value: ClassVar[str] = "MSAMP"

    def __post_init__(self):
        self._given = {"opt_level"} if self.opt_level is not None else set()
        self._fill_msamp_defaults()

    def _fill_msamp_defaults(self) -> None:
        if self.opt_level is None:
            self.opt_level = "O2"
        if self.opt_level not in OPT_LEVELS:
            raise ConfigError(f"MSAMPRecipeKwargs(opt_level={self.opt_level!r}): use one of {', '.join(OPT_LEVELS)}")


@dataclass
class FP8RecipeKwargs(TERecipeKwargs, MSAMPRecipeKwargs):
    """Deprecated in Accelerate (a FutureWarning): ``backend`` 'TE' or 'MSAMP' (MS-AMP when it is installed,
    else TE) with that engine's keywords; a keyword of the other engine is a ConfigError naming it."""

    backend: Optional[str] = None

    def __post_init__(self):
        warnings.warn("FP8RecipeKwargs is deprecated (as in Accelerate); use TERecipeKwargs or MSAMPRecipeKwargs, "
                      "or set fp8.backend in the config", FutureWarning, stacklevel=3)
        given = {f.name for f in fields(self) if getattr(self, f.name) is not None}
        if self.backend is None:
            self.backend = "MSAMP" if importlib.util.find_spec("msamp") is not None else "TE"
        self.backend = str(self.backend).upper()
        if self.backend not in ("TE", "MSAMP"):
            raise ConfigError(f"FP8RecipeKwargs(backend={self.backend!r}): use 'TE' or 'MSAMP' (for torchao, "
                              "AORecipeKwargs)")
        self._given = given - {"backend"}
        self._fill_te_defaults()
        self._fill_msamp_defaults()
        own = {f.name for f in fields(TERecipeKwargs)} if self.backend == "TE" else {"opt_level"}
        other = sorted(self._given - own)
        if other:
            raise ConfigError([f"kwargs handler FP8RecipeKwargs({key}={getattr(self, key)!r}): it belongs to the "
                               f"{'MSAMP' if self.backend == 'TE' else 'TE'} backend, not backend={self.backend!r}"
                               for key in other])
        if "backend" in given:
            self._given.add("backend")

    def accelerate_keys(self) -> dict[str, tuple[Any, Optional[str]]]:
        keys = super().accelerate_keys()
        keys["backend"] = (self.backend, "backend" if "backend" in self._given else None)
        return keys
