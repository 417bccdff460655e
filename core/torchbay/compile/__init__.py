"""``torch.compile`` as a config-selected step of ``prepare`` (the ``compile`` section), and Accelerate's names for
it (``TorchDynamoPlugin``, ``DynamoBackend``, ``compile_regions``...): implemented in ``compiler``, a mechanism on
torch alone that strategies (which blocks to compile) and selection (the section's checks) use too."""

from typing import TYPE_CHECKING

from torchbay._lazy import attach

_LAZY = {
    "ModelCompiler": "torchbay.compile.compiler",
    "TorchDynamoPlugin": "torchbay.compile.compiler",
    "DynamoBackend": "torchbay.compile.compiler",
    "compile_regions": "torchbay.compile.compiler",
    "has_compiled_regions": "torchbay.compile.compiler",
    "repeated_blocks": "torchbay.compile.compiler",
    "section_problems": "torchbay.compile.compiler",
}
__getattr__, __dir__ = attach(__name__, _LAZY)

# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --
__all__ = ["DynamoBackend", "ModelCompiler", "TorchDynamoPlugin", "compile_regions", "has_compiled_regions",
           "repeated_blocks", "section_problems"]

if TYPE_CHECKING:
    from torchbay.compile.compiler import (
        DynamoBackend,
        ModelCompiler,
        TorchDynamoPlugin,
        compile_regions,
        has_compiled_regions,
        repeated_blocks,
        section_problems,
    )
# -- end of the names written by scripts/public_names.py --
