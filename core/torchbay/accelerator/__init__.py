"""The user's API: :class:`Accelerator` (Accelerate's ``accelerate.accelerator`` path) and the parts it composes:
``prepare`` (what ``prepare`` does per object), ``prepared`` (the optimizer and scheduler wrappers),
``process`` (collectives and the breakpoint trigger), ``tracking`` (the tracker methods, over the run's
``torchbay.tracking.run.RunTracking``), ``checkpointed`` (the prepared objects and training state given to the
checkpointer), ``surface`` (Accelerate-only arguments); the Accelerate-only properties are in
``torchbay.compat.accelerator_views``.
"""

from torchbay._lazy import serve_names

__all__ = ['Accelerator']
_IMPLEMENTATION = "torchbay.accelerator.accelerator"
__getattr__, __dir__ = serve_names(__name__, {_IMPLEMENTATION: __all__}, fallback=(_IMPLEMENTATION,))
