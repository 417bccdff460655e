"""Accelerate's ``accelerate.optimizer``/``accelerate.scheduler`` names (implemented in
:mod:`torchbay.accelerator.prepared`), and ``GradientState`` (:mod:`torchbay.data.gradient_state`)."""

from torchbay._lazy import serve_names

_SOURCES = {"torchbay.accelerator.prepared": ["PreparedOptimizer", "PreparedScheduler", "AcceleratedOptimizer",
                                              "AcceleratedScheduler"],
            "torchbay.data.gradient_state": ["GradientState"]}
__all__ = sorted(name for names in _SOURCES.values() for name in names)
__getattr__, __dir__ = serve_names(__name__, _SOURCES)
