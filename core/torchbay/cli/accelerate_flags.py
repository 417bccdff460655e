"""``torchbay launch`` with ``accelerate launch``'s spellings, and did-you-mean for unknown options.

Accelerate's ``--num_processes`` is torchbay's ``--num-processes``: every ``--a_b`` whose ``--a-b``
is a flag of the command is read as that flag. Accelerate's switches that choose a set-up
(``--multi_gpu``, ``--cpu``, and the ones plugins add) and the flags named otherwise here
(``--gpu_ids``) come from the Accelerate tables (``resources/accelerate.yaml``: ``launch_switches``,
``launch_values``, each plugin's ``accelerate.yaml``), so that a switch means here what the same
Accelerate config means to ``torchbay config import-accelerate``. An Accelerate flag with no
meaning here is refused with the reason the same table gives (``not_imported``).
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any

from torchbay.errors import ConfigError

BOOL_WORDS = {"true", "false", "yes", "no", "1", "0", "on", "off"}


def options_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def _values_taken(action: argparse.Action, next_token: str | None) -> int:
    """How many tokens after ``action``'s flag are its value (the flag given without ``=``)."""
    if action.nargs == 0:
        return 0
    if action.nargs == "?":
        return int(next_token is not None and next_token.lower() in BOOL_WORDS)
    return 1 if action.nargs in (None, 1) else 0


class AccelerateLaunchFlags:
    """Reads ``accelerate launch``'s spellings into ``torchbay launch``'s flags."""

    def __init__(self, parser: argparse.ArgumentParser, table: dict[str, Any] | None = None, pm=None):
        self.parser = parser
        self.options = options_of(parser)
        self._table = table
        self._pm = pm
        self.dests: dict[str, str] = getattr(parser, "_torchbay_config_dests", {})
        #: torchbay key -> the Accelerate flag that set it (``config show --sources`` names it)
        self.origins: dict[str, str] = {}

    @property
    def table(self) -> dict[str, Any]:
        """The Accelerate tables, read only when a flag is not torchbay's own."""
        if self._table is None:
            from torchbay.compat.config_import import mapping_table

            self._table = mapping_table(self._pm)
        return self._table

    def translate(self, argv: list[str]) -> list[str]:
        """``argv`` after ``launch`` with Accelerate's spellings replaced; the script and its
        arguments are left exactly as given."""
        out: list[str] = []
        i = 0
        while i < len(argv):
            token = argv[i]
            if token == "--" or not token.startswith("-"):
                return out + argv[i:]  # the script (or module) and everything after it
            name, eq, value = token.partition("=")
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if name in self.options:
                taken = 0 if eq else _values_taken(self.options[name], nxt)
                out += argv[i:i + 1 + taken]
                i += 1 + taken
                continue
            accelerate_name = name[2:] if name.startswith("--") else None
            replaced = self._accelerate_flag(accelerate_name, eq, value, nxt) if accelerate_name else None
            if replaced is None:
                out.append(token)  # not ours nor Accelerate's: argparse reports it, with a did-you-mean
                i += 1
                continue
            tokens, taken = replaced
            out += tokens
            i += 1 + taken
        return out

    def _accelerate_flag(self, key: str, eq: str, value: str, nxt: str | None) -> tuple[list[str], int] | None:
        """The torchbay tokens for Accelerate's ``--key`` and how many following tokens it used."""
        dashed = "--" + key.replace("_", "-")
        found = self._section_of(key) if "_" in key and dashed in self.options else None
        if found is not None and self._translates(*found):
            return self._section_flag(key, *found, eq, value, nxt)  # Accelerate's values (--fp8_backend ao)
        if "_" in key and dashed in self.options:
            taken = 0 if eq else _values_taken(self.options[dashed], nxt)
            self.origins[self.options[dashed].dest] = f"--{key}"
            return ([dashed + eq + value] if eq else [dashed, *([nxt] if taken else [])]), taken
        switches = self.table.get("launch_switches") or {}
        if key in switches:
            return self._settings_flags(key, switches[key]), 0
        values = self.table.get("launch_values") or {}
        if key in values:
            if not eq and nxt is None:
                raise ConfigError(f"--{key} (accelerate launch's) needs a value", header="bad command line")
            flag, given = self.dests.get(values[key]), value if eq else nxt
            self.origins[values[key]] = f"--{key}"
            return ([flag, given] if flag else [f"--set={values[key]}={given}"]), 0 if eq else 1
        found = self._section_of(key)
        if found is not None:
            return self._section_flag(key, *found, eq, value, nxt)
        from torchbay.registry.published import LAUNCH_SWITCH, distribution_for

        serving = distribution_for(LAUNCH_SWITCH, key)
        if serving:  # a plugin's switch, and that plugin is not installed
            raise ConfigError(f"--{key} is accelerate launch's; torchbay launch reads it once {serving} is installed: "
                              f"pip install {serving}", header="bad command line")
        reason = (self.table.get("launch_refused") or {}).get(key) or (self.table.get("not_imported") or {}).get(key)
        if reason:
            raise ConfigError(f"--{key} is accelerate launch's; it has no meaning for torchbay launch: "
                              f"{' '.join(str(reason).split())} (see torchbay launch --help)",
                              header="bad command line")
        return None

    def _translates(self, section: str, key: str) -> bool:
        """Whether the table reads Accelerate's values of ``key`` its own way (a value table, or settings it implies),
        so that the flag must go through it even where torchbay has a flag of the same name."""
        spec = self.table["sections"][section]
        return "values" in (spec.get("keys") or {}).get(key, {}) or key in (spec.get("implies") or {})

    def _section_of(self, flag: str) -> tuple[str, str] | None:
        """``(nested config, its key)`` that ``--flag`` names (the key, or Accelerate's flag for it: ``fp8_margin``
        is fp8_config's ``margin``), in an installed plugin's table."""
        from torchbay.compat.config_import import flag_of

        for name, spec in (self.table.get("sections") or {}).items():
            for key in (spec.get("keys") or {}) if "target" in spec else ():
                if flag in (key, flag_of(spec, key)):
                    return name, key
        return None

    def _section_flag(self, flag: str, section: str, key: str, eq: str, value: str,
                      nxt: str | None) -> tuple[list[str], int]:
        """``--fsdp_offload_params true``: the key of Accelerate's ``section`` read as a config file's would be
        (config_import's rules, the same table), so the flag sets the same torchbay keys."""
        import json

        import yaml

        from torchbay.compat.config_import import ImportReport, convert_section

        spec = self.table["sections"][section]
        if eq:
            given, taken = value, 0
        elif nxt is not None and (nxt.lower() in BOOL_WORDS or
                                  not (nxt.startswith("-") or spec["keys"][key].get("switch"))):
            given, taken = nxt, 1
        else:
            given, taken = "true", 0  # a switch (Accelerate's store_true), or a bare flag meaning true
        parsed: Any = given
        if given.lower() not in ("no", "yes", "on", "off"):  # YAML would read `--dynamo_backend no` as false
            try:
                parsed = yaml.safe_load(given)
            except yaml.YAMLError:
                pass
        report = ImportReport()
        flat = convert_section(section, spec, {key: parsed}, report)
        if report.not_imported:
            _, shown, why = report.not_imported[0]
            raise ConfigError(f"--{flag} {shown} is accelerate launch's; torchbay launch cannot honour it: "
                              f"{' '.join(str(why).split())} (see torchbay launch --help)", header="bad command line")
        tokens = []
        for dotted, setting in flat.items():
            self.origins[dotted] = f"--{flag}"
            tokens.append(f"--set={dotted}={json.dumps(setting)}")
        return tokens, taken

    def _settings_flags(self, switch: str, meaning: Any) -> list[str]:
        settings = meaning
        if isinstance(meaning, str):  # a distributed_type: whatever that type sets, as config import does
            types = self.table.get("distributed_type") or {}
            if meaning not in types:
                why = (self.table.get("unsupported_distributed_type") or {}).get(meaning)
                raise ConfigError(f"--{switch} (accelerate launch's) chooses distributed_type {meaning}, which "
                                  + (' '.join(str(why).split()) if why else
                                     "no installed torchbay plugin provides (`torchbay plugins` lists them)"),
                                  header="bad command line")
            settings = types[meaning]
        tokens: list[str] = []
        for dotted, setting in (settings or {}).items():
            self.origins[dotted] = f"--{switch}"
            flag = self.dests.get(dotted)
            tokens += [flag, str(setting)] if flag else [f"--set={dotted}={setting}"]
        return tokens


def unknown_option_message(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """``unrecognized option --x; did you mean --y?`` for the options argparse did not know."""
    options = sorted(o for o in options_of(parser) if o.startswith("--"))
    parts = []
    for token in unknown:
        name = token.partition("=")[0]
        if not name.startswith("-"):
            parts.append(f"unexpected argument {token!r}")
            continue
        normalized = {o.replace("_", "-"): o for o in options}
        close = difflib.get_close_matches(name.replace("_", "-"), list(normalized), n=1, cutoff=0.6)
        parts.append(f"unrecognized option {name}" + (f"; did you mean {normalized[close[0]]}?" if close else ""))
    return "; ".join(parts)  # (the parser's error adds "see <prog> --help")
