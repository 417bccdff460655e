"""Accelerate's config files as torchbay reads them: the default file's place, the settings holder behind
``load_config_from_file`` / ``ClusterConfig``, and the step that turns ``launch --config_file <Accelerate file>``
into the torchbay config ``torchbay config import-accelerate`` would write (used by ``torchbay launch`` and by
``accelerate launch`` under the switch)."""

from __future__ import annotations

import os
from typing import Any

from torchbay.compat.config_import import import_file, to_yaml
from torchbay.config.files import load_yaml_file
from torchbay.errors import ConfigError

#: the name every temporary config imported from an Accelerate file starts with (only such a file is removed)
IMPORTED_PREFIX = "torchbay-from-accelerate-"

#: where Accelerate keeps its default config (``accelerate config`` writes it; libraries read it)
default_config_file = os.path.join(
    os.path.expanduser(os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"),
                                                              "huggingface"))),
    "accelerate", "default_config.yaml")


class AccelerateConfigFile:
    """An Accelerate config file's settings (``load_config_from_file(path).to_dict()``)."""

    def __init__(self, settings: dict[str, Any] | None = None, path: str | None = None, **given: Any):
        self._settings = {**(settings or {}), **given}  # ClusterConfig(compute_environment=..., ...) too
        self.path = path

    def to_dict(self) -> dict[str, Any]:
        return dict(self._settings)

    def to_yaml_file(self, yaml_file: str) -> None:
        """Write the settings as YAML to ``yaml_file``; only a new file, or the file these settings came from."""
        import yaml

        if os.path.exists(yaml_file) and os.path.abspath(yaml_file) != os.path.abspath(self.path or ""):
            raise ConfigError(f"{yaml_file} exists and is not the file these settings were read from: torchbay "
                              "does not write over it; give a new path")
        with open(yaml_file, "w", encoding="utf-8") as handle:
            yaml.safe_dump(self.to_dict(), handle, sort_keys=False)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._settings[name]
        except KeyError:
            raise AttributeError(f"{self.path} has no setting {name!r}") from None


#: Accelerate's config classes (``accelerate.commands.config.config_args``): the settings holder serves them
BaseConfig = AccelerateConfigFile


class ClusterConfig(AccelerateConfigFile):
    """The settings of an Accelerate config file for a local or cluster run (what ``torchbay launch`` imports)."""


class SageMakerConfig(AccelerateConfigFile):
    """The settings of an Accelerate config file for Amazon SageMaker (``compute_environment: AMAZON_SAGEMAKER``).
    torchbay reads them; it does not submit SageMaker jobs (a launch with such a file is refused, saying so)."""


#: the ``compute_environment`` whose files :func:`load_config_from_file` reads as :class:`SageMakerConfig`
SAGEMAKER = "AMAZON_SAGEMAKER"


def load_config_from_file(config_file: str | None = None) -> AccelerateConfigFile:
    """Read an Accelerate YAML or JSON config file (the default one when ``config_file`` is None)."""
    import json

    path = config_file or default_config_file
    if not os.path.isfile(path):
        raise ConfigError(f"Accelerate config file {path} does not exist; give an existing file or write one with "
                          "`torchbay config` (torchbay reads Accelerate's files as they are)")
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as handle:
            settings = json.load(handle)
    else:
        settings = load_yaml_file(path, equal_repeats=True) or {}  # a key repeated with one value reads once
    if not isinstance(settings, dict):
        raise ConfigError(f"Accelerate config file {path} must hold a mapping of Accelerate's keys to values")
    holder = SageMakerConfig if settings.get("compute_environment") == SAGEMAKER else ClusterConfig
    return holder(settings, path)


def with_torchbay_config(args: list[str]) -> tuple[list[str], str | None]:
    """Replace an Accelerate ``--config_file`` (before the script) by the torchbay config imported from it.

    The import is what ``torchbay config import-accelerate`` does; its report goes to stderr, and the imported
    config is written to a new temporary file (the user's file is only read), whose path is returned with the
    arguments: ``launch_command`` removes it once the launch has read it.
    """
    import sys
    import tempfile

    for index, token in enumerate(args):
        if not token.startswith("-"):
            break  # the script: what follows is its own
        flag, _, value = token.partition("=")
        if flag not in ("--config_file", "--config-file"):
            continue
        value = value or (args[index + 1] if index + 1 < len(args) else "")
        if not os.path.isfile(value):
            return args, None  # missing, a folder...: the launch's own config reading says what is wrong
        read = load_config_from_file(value)
        if isinstance(read, SageMakerConfig):
            raise ConfigError(f"{value} has compute_environment: {SAGEMAKER}: Accelerate would submit this run as "
                              "an Amazon SageMaker job, and torchbay does not submit SageMaker jobs (it reads such a "
                              "file, it does not launch it). Run the launch inside the SageMaker job with a "
                              "LOCAL_MACHINE config, or submit it with Accelerate's own `accelerate launch` "
                              "(TORCHBAY_AS_ACCELERATE unset)", header="launch --config_file")
        settings = read.to_dict()
        if "distributed_type" not in settings and "compute_environment" not in settings:
            return args, None  # already a torchbay config
        tree, report = import_file(value)
        worth_saying = [line for line in report.lines() if not line.startswith(("mapped", "ignored"))]
        print(f"torchbay: the Accelerate config {value} imported as torchbay settings ({len(report.mapped)} mapped, "
              f"{len(report.ignored)} without effect here; `torchbay config import-accelerate` shows each)"
              + "".join(f"\n  {line}" for line in worth_saying), file=sys.stderr)
        handle = tempfile.NamedTemporaryFile("w", prefix=IMPORTED_PREFIX, suffix=".yaml", delete=False)
        with handle:
            handle.write(to_yaml(tree, report, value))
        rest = args[index + 1:] if "=" in token else args[index + 2:]
        return [*args[:index], "--config-file", handle.name, *rest], handle.name
    return args, None


def remove_imported_config(path: str | None) -> None:
    """Remove the temporary config :func:`with_torchbay_config` wrote, once the launch has read it: a file of
    torchbay's own name only, never the user's."""
    if path and os.path.basename(path).startswith(IMPORTED_PREFIX) and os.path.isfile(path):
        os.remove(path)
