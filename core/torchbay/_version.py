"""torchbay's version, in a module of its own so that any layer reads it without importing the top-level façade
(setup.cfg's ``version`` says the same: tests/architecture/test_public_names.py checks it)."""

__version__ = "0.2.0"
