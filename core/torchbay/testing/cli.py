"""Run a ``torchbay`` command in the test's own process, as a plugin's tests do for the options and commands the
plugin adds (``estimate-memory --pp-size``, ``merge-weights``): what it prints goes to pytest's captured output."""

from __future__ import annotations

from torchbay.cli.main import main


def run_command(*argv: str) -> int:
    """The exit status of ``torchbay <argv...>``."""
    return main(list(argv))
