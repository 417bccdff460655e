"""The base of every FP8 engine's precision (``mixed_precision: fp8``).

An engine plugin subclasses :class:`FP8Precision`, sets ``engine`` (the ``fp8.backend`` value it
serves), ``priority`` (``fp8.backend: auto`` tries engines highest first), ``engine_module`` and
``install_hint``, lists the ``fp8.engine_options`` it takes in ``accepted_options``, and extends
:meth:`FP8Precision.check` with what it cannot honour. The base checks the engine options and the
bf16 autocast ``fp8.outer_autocast`` needs, and wraps the forward in that autocast.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import re
from typing import Any, ClassVar

import torch

from torchbay.errors import CheckpointError
from torchbay.plugin import Precision
from torchbay_fp8.linears import SMALL_LAYER_HARMONIC, LinearPlan

log = logging.getLogger("torchbay.fp8")
#: engines whose checkpoint holds weights or optimizer state in their own format: another precision cannot resume it
NOT_PORTABLE = {"msamp"}


def option_problems(engine: str, options: dict[str, Any], allowed: dict[str, Any]) -> list[str]:
    """Unknown keys or wrong types in ``fp8.engine_options`` for ``engine``.

    ``allowed`` maps each key to a type, a tuple of types, or a ``set`` of allowed values.
    """
    problems = []
    for key, value in options.items():
        if key not in allowed:
            close = difflib.get_close_matches(key, list(allowed), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            problems.append(f"fp8.engine_options.{key} is not an option of fp8 engine '{engine}'; {hint}"
                            f"its options: {', '.join(sorted(allowed))}")
            continue
        rule = allowed[key]
        if isinstance(rule, set):
            if value not in rule:
                problems.append(f"fp8.engine_options.{key} = {value!r} is not accepted by fp8 engine '{engine}'; "
                                f"use one of {sorted(rule, key=str)}")
        elif not isinstance(value, rule) or (rule in (int, (int, float)) and isinstance(value, bool)):
            names = rule.__name__ if isinstance(rule, type) else " or ".join(r.__name__ for r in rule)
            problems.append(f"fp8.engine_options.{key} = {value!r} must be {names} for fp8 engine '{engine}'")
    return problems


def is_explicit(context, key: str) -> bool:
    """Whether ``fp8.<key>`` was set by the user (any source but the defaults)."""
    return context.resolved.source_of(f"fp8.{key}") != "default"


_KEY = re.compile(r"\bfp8\.([A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_])")


def name_handler_sources(context, problems: list[str]) -> list[str]:
    """Each problem about an ``fp8.<key>`` an Accelerate kwargs handler set, with the handler's keyword named."""
    out = []
    for problem in problems:
        sources = []
        for key in dict.fromkeys(_KEY.findall(problem)):
            source = context.resolved.source_of(f"fp8.{key}")
            if source.startswith("kwargs handler") and source not in sources:
                sources.append(source)
        out.append(problem + "".join(f" (set by {s})" for s in sources))
    return out


class FP8Precision(Precision):
    """FP8 through an engine: reads the ``fp8`` section; with ``fp8.outer_autocast`` the forward
    also runs in bf16 autocast (what the engine keeps out of FP8 computes in bf16)."""

    name = "fp8"
    #: ``fp8.engine_options`` this engine takes: key -> type, tuple of types, or set of values
    accepted_options: ClassVar[dict[str, Any]] = {"small_layer_threshold": (int, float)}

    #: whether this engine can compute a recipe's numerics in high precision (``fp8.emulate``)
    can_emulate: ClassVar[bool] = False

    # -- validation ---------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls, device_backend_cls, config=None) -> str | None:
        """The engine's own reasons, and ``fp8.emulate`` asked of an engine that cannot emulate (so that
        ``fp8.backend: auto`` passes on to one that can)."""
        reason = super().unavailable_reason(device_backend_cls, config)
        if reason is None and config is not None and config.fp8.emulate and not cls.can_emulate:
            return (f"fp8.emulate: true asks for emulated numerics, which engine '{cls.engine}' does not compute; "
                    "use fp8.backend: torchao, or drop fp8.emulate")
        return reason

    @classmethod
    def check(cls, context) -> list[str]:
        """The engine options, and bf16 autocast on the device when ``fp8.outer_autocast``.

        Engines extend this (``problems = super().check(context)``) with the settings they
        cannot honour, each named through :meth:`unsupported`.
        """
        fp8 = context.config.fp8
        problems = option_problems(cls.engine, dict(fp8.engine_options), cls.accepted_options)
        device = context.device_backend_cls
        if fp8.outer_autocast and not device.supports_autocast(torch.bfloat16):
            problems.append(f"fp8.outer_autocast needs bf16 autocast, which device '{device.name}' lacks; "
                            f"set fp8.outer_autocast: false")
        return problems

    @classmethod
    def unsupported(cls, key: str, value: Any, why: str) -> str:
        """The problem line for an ``fp8.<key>`` setting this engine cannot honour."""
        return f"fp8 engine '{cls.engine}' cannot honour fp8.{key} = {value!r}: {why}"

    # -- set-up -------------------------------------------------------------------------
    def __init__(self, context):
        super().__init__(context)
        self.fp8 = context.config.fp8
        self.options = dict(self.fp8.engine_options)

    #: whether this run computes FP8 numerics in high precision (no FP8 kernels: speed means nothing)
    emulate: bool = False

    def small_layer_filter(self) -> float:
        """The ``K*N/(K+N)`` below which a Linear stays in higher precision (0: no filter).

        ``fp8.filter_small_layers`` unset: on, unless the engine emulates FP8 (where no layer gains).
        """
        on = self.fp8.filter_small_layers
        if on is None:
            on = not self.emulate
        return self.options.get("small_layer_threshold", SMALL_LAYER_HARMONIC) if on else 0

    def is_explicit(self, key: str) -> bool:
        """Whether ``fp8.<key>`` was set by the user (any source but the defaults)."""
        return is_explicit(self.context, key)

    @property
    def is_main_process(self) -> bool:
        """Whether this process logs for the run (rank 0)."""
        strategy = getattr(self.context, "strategy", None)
        if strategy is not None:
            return strategy.rank == 0
        return self.context.cluster.rank() == 0

    # -- every step ---------------------------------------------------------------------
    @property
    def wraps_forward(self) -> bool:
        return self.fp8.outer_autocast

    def forward_context(self, handler=None):
        """bf16 autocast with ``fp8.outer_autocast`` (``handler``: the user's ``AutocastKwargs``)."""
        if not self.fp8.outer_autocast:
            return contextlib.nullcontext()
        enabled = handler.enabled if handler is not None else True
        return self.device_backend.autocast(torch.bfloat16, enabled=enabled)

    def log_plan(self, plan: LinearPlan, label: str) -> None:
        """The layer -> recipe table, once per converted model, on the main process."""
        if self.is_main_process:
            high = "bf16" if self.fp8.outer_autocast else "full precision"
            log.info("%s %s (layer -> recipe):\n%s", label, plan.describe(), plan.table(high))

    # -- state ----------------------------------------------------------------------------
    def saved_here(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` is this engine's (True), or another precision's, which this run drops with a one-line
        notice (False); a checkpoint whose engine kept weights in its own format is refused (CheckpointError)."""
        saved = state.get("engine")
        if saved == self.engine:
            return True
        was = state.get("describe") or (f"fp8 engine {saved!r}" if saved else "a precision without an FP8 engine")
        if saved in NOT_PORTABLE or state.get("portable") is False:
            raise CheckpointError(f"precision: the checkpoint was saved with {was}, which keeps weights and optimizer "
                                  f"state in its own format; this run ({self.describe()}) cannot resume it: resume "
                                  f"with fp8.backend: {saved}")
        if self.is_main_process:
            log.warning("precision: the checkpoint was saved with %s; this run uses %s: the weights load, the saved "
                        "precision state is dropped and the layers train as this run's policy says", was,
                        self.describe())
        return False

    def check_saved_engine(self, state: dict[str, Any]) -> None:
        """Refuse precision state that another engine (or precision) saved."""
        if state.get("engine") != self.engine:
            raise CheckpointError(f"precision: the checkpoint was saved with fp8 engine {state.get('engine')!r} "
                                  f"(precision state {sorted(state)}), this run uses '{self.engine}'; resume with "
                                  f"fp8.backend: {state.get('engine') or '<the engine it was saved with>'}")

    def describe(self) -> str:
        return f"fp8:{self.engine}"
