"""Model FLOPs: counted once with torch's ``FlopCounterMode`` (on the first optimizer step, or on any function you
give it, e.g. one that runs on meta tensors), and the standard ``6 x parameters x tokens`` estimate for transformers
(forward 2, backward 4 multiply-adds per parameter and token; attention's own FLOPs left out).
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.flop_counter import FlopCounterMode


def count_flops(fn: Callable[[], Any]) -> int:
    """The FLOPs torch's ``FlopCounterMode`` counts while ``fn()`` runs (forward and backward, if ``fn`` runs both).

    Runs on meta tensors too: build the model under ``torch.device("meta")`` and give it meta inputs to count
    without memory or time."""
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())


def transformer_estimate(parameters: int, tokens: int) -> int:
    """``6 x parameters x tokens``: the FLOPs of a training step of a decoder-only transformer (Kaplan et al. 2020),
    without attention's quadratic term (which ``FlopCounterMode`` counts)."""
    return 6 * int(parameters) * int(tokens)


def parameter_count(models: list[Any]) -> int:
    """Parameters of the models (each counted once, even when tied or shared between models); a sharded
    parameter (DTensor) counts its whole size."""
    seen: set[int] = set()
    total = 0
    for model in models:
        for p in getattr(model, "parameters", lambda: [])():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


class StepFlopCounter:
    """A ``FlopCounterMode`` opened at one point and closed at another (the first step's batch, then its optimizer
    step): :meth:`open`, :meth:`close` -> FLOPs, or ``None`` when counting could not be done (then telemetry logs
    no counted FLOPs rather than a wrong number)."""

    def __init__(self) -> None:
        self._mode: FlopCounterMode | None = None
        self.error: str | None = None

    @property
    def counting(self) -> bool:
        return self._mode is not None

    def open(self) -> None:
        if self._mode is not None:
            return
        try:
            mode = FlopCounterMode(display=False)
            mode.__enter__()
            self._mode = mode
        except Exception as exc:  # a dispatch mode that cannot nest here: no count, said in the log
            self.error = f"{type(exc).__name__}: {exc}"

    def close(self) -> int | None:
        mode, self._mode = self._mode, None
        if mode is None:
            return None
        try:
            mode.__exit__(None, None, None)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            return None
        return int(mode.get_total_flops())

