"""torchbay's version (``torchbay.__version__``), in a module of its own below every layer, so that any module
may read it without importing the package's lazy face (``torchbay/__init__.py``)."""

__version__ = "0.2.0"
