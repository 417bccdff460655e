"""``torch.compile`` as a config-selected step of ``prepare`` (the ``compile`` section), and Accelerate's names for
it (``TorchDynamoPlugin``, ``DynamoBackend``, ``compile_regions``...): implemented in ``compiler``, a mechanism on
torch alone that strategies (which blocks to compile) and selection (the section's checks) use too."""

from torchbay._lazy import serve_names

__all__ = ["ModelCompiler", "TorchDynamoPlugin", "DynamoBackend", "compile_regions", "has_compiled_regions",
           "repeated_blocks", "section_problems"]
_IMPLEMENTATION = "torchbay.compile.compiler"
__getattr__, __dir__ = serve_names(__name__, {_IMPLEMENTATION: __all__}, fallback=(_IMPLEMENTATION,))
