"""The ``torchbay`` command line."""
