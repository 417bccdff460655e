"""torchbay-fp8-torchao: FP8 training through torchao's Float8 Linear (``fp8.backend: torchao``).

Importing this package (or its plugin module) does not import torchao; torchao is imported
when the engine is selected and a model is converted.
"""

__version__ = "0.1.0"
