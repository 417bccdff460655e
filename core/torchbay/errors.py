"""The exceptions torchbay raises at its users.

Every user-facing failure is a :class:`TorchbayError`; its message names the setting or
plugin at fault and how to fix it.
"""

from __future__ import annotations


class TorchbayError(Exception):
    """Base class of every error torchbay raises on purpose."""


class ConfigError(TorchbayError, ValueError):
    """A configuration value, file, flag or environment variable is wrong.

    ``problems`` holds one line per problem, so that all of them are reported at once.
    """

    def __init__(self, problems: list[str] | str, *, header: str = "invalid torchbay configuration"):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1 and "\n" not in self.problems[0]:
            super().__init__(f"{header}: {self.problems[0]}")  # one problem: one line
            return
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{header}:\n{lines}")


class IncompatibleSetupError(ConfigError):
    """The chosen device, strategy and precision cannot work together."""

    def __init__(self, problems: list[str]):
        super().__init__(problems, header="this set-up cannot run (fix every item, then retry)")


class PluginError(TorchbayError):
    """A plugin is missing, failed to load, or is required but blocked."""


class CheckpointError(TorchbayError):
    """A checkpoint could not be written or a part of it could not be restored."""


class LaunchError(TorchbayError):
    """Processes could not be started, or a rank failed."""


class UnsupportedAPIError(TorchbayError, AttributeError, NotImplementedError):
    """An Accelerate name that torchbay does not offer; the message says what to use instead.

    An AttributeError, so that such a name is a missing attribute (``hasattr`` is False) whose message says why.
    """


class ModelSourceError(TorchbayError, OSError):
    """A model named on the command line cannot be read from where it was named (an OSError, as a missing file
    is)."""
