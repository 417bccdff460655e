"""Accelerate's ``accelerate.state`` path: the process and run state classes (implemented in
:mod:`torchbay.process.state` and :mod:`torchbay.data.gradient_state`)."""

from torchbay._lazy import serve_names

_SOURCES = {"torchbay.process.state": ["AcceleratorState", "DistributedType", "PartialState"],
            "torchbay.data.gradient_state": ["GradientState"]}
__all__ = sorted(name for names in _SOURCES.values() for name in names)
__getattr__, __dir__ = serve_names(__name__, _SOURCES)
