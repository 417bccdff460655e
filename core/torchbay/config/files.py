"""Reading config files: UTF-8 text only, YAML with no duplicate keys, one-line errors.

Every failure is a :class:`~torchbay.errors.ConfigError` that names the file, what is wrong
(a directory, UTF-16, binary content, a duplicate key, a YAML syntax error with its line)
and the fix.

PyYAML is imported on the first file read, not with this module: its import compiles a large
Unicode pattern (about 70 ms), and a run with no config file reads no YAML at all.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
from pathlib import Path
from typing import Any

from torchbay.errors import ConfigError

CONFIG_FILE_ENV = "TORCHBAY_CONFIG_FILE"


def read_text_file(path: str | os.PathLike, what: str = "config file",
                   setting: str = f"--config-file or {CONFIG_FILE_ENV}") -> str:
    """The text of a UTF-8 file; any other content is a :class:`ConfigError` naming the fix."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} '{path}' is a directory, not a file (set {setting} to a YAML file)")
    if not path.exists():  # a pipe or /dev/stdin is fine: only a name that is not there is refused
        raise ConfigError(f"{what} '{path}' does not exist (set {setting} to a YAML file)")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} '{path}' cannot be read: {exc.strerror or exc}") from None
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{what} '{path}' is UTF-16 encoded; save it as UTF-8 "
                          f"(e.g. iconv -f UTF-16 -t UTF-8 {path} > fixed.yaml)")
    if b"\0" in raw[:8192]:
        raise ConfigError(f"{what} '{path}' is a binary file, not YAML text; point {setting} at a YAML file")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{what} '{path}' is not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}, e.g. "
                          f"a Latin-1 file); save it as UTF-8 (iconv -f LATIN1 -t UTF-8 {path} > fixed.yaml)") from None


@functools.lru_cache(maxsize=None)
def _unique_key_loader(equal_repeats: bool = False) -> type:
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (YAML would keep the last); with
    ``equal_repeats``, a key repeated with an equal value (which means one thing) is read once."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader reports it
                    continue
                if first is None:
                    seen[key] = (key_node, value_node)
                    continue
                first_key, first_value = first
                if equal_repeats and self.construct_object(first_value, deep=True) == \
                        self.construct_object(value_node, deep=True):
                    continue
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' on lines {first_key.start_mark.line + 1} and "
                    f"{key_node.start_mark.line + 1}; keep one of them", key_node.start_mark)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def parse_yaml(text: str, name: str, equal_repeats: bool = False) -> Any:
    """Parse YAML text; errors, duplicate keys included, are one :class:`ConfigError` line (``equal_repeats``: a key
    repeated with an equal value is no error)."""
    import yaml

    try:
        return yaml.load(text, Loader=_unique_key_loader(equal_repeats))
    except yaml.constructor.ConstructorError as exc:
        if exc.problem and exc.problem.startswith("duplicate key"):
            raise ConfigError(f"{name}: {exc.problem}") from None
        raise ConfigError(f"{name} is not valid YAML: {_one_line(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{name} is not valid YAML: {_one_line(exc)}") from None


def _one_line(exc: Exception) -> str:
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(exc).split())


def load_yaml_file(path: str | os.PathLike, equal_repeats: bool = False) -> dict[str, Any]:
    """A YAML file's mapping; a key given twice is an error (with ``equal_repeats``: only with another value, as an
    Accelerate file may repeat a key that Accelerate's reader keeps the last of)."""
    text = read_text_file(path)
    data = parse_yaml(text, f"config file '{path}'", equal_repeats)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of keys to values, not {type(data).__name__}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"config file '{path}': key {bad[0]!r} is not a name; keys are names like mixed_precision")
    return data


@functools.lru_cache(maxsize=None)
def read_packaged_yaml(package: str, resource: str) -> Any:
    """A YAML data file shipped inside ``package`` (torchbay's tables, a plugin's fragment), read once.

    Uses libyaml's safe loader where PyYAML has it (the pure-Python one costs tens of ms of
    every start-up). Callers must not change the returned object: it is shared.
    """
    import yaml

    text = importlib.resources.files(package).joinpath(resource).read_text(encoding="utf-8")
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
