"""What plugins contribute besides classes: config sections and Accelerate compatibility data.

A mixin of :class:`~torchbay.registry.manager.PluginManager`. Both are merged from every plugin's
hook result, built-ins first; a plugin whose contribution clashes with the core's or an
earlier plugin's is disabled (``_fail``) and none of its contribution is used.
"""

from __future__ import annotations

import copy
from typing import Any

from torchbay.config.model import CoreConfig


class Contributions:
    """Merging of ``torchbay_config_sections`` and ``torchbay_accelerate_mapping`` results."""

    def _results_of(self, hook: str):
        """``(impl, plugin info, result)`` of every working plugin's ``hook``, built-ins first
        (a plugin that fails while answering is skipped: the guard has disabled it)."""
        for impl in getattr(self.hook, hook).get_hookimpls():
            if self.is_failed(impl.plugin_name):
                continue
            found = impl.function() or {}
            if not self.is_failed(impl.plugin_name):
                yield impl, self.info_of(impl.plugin_name), found

    def config_sections(self) -> dict[str, Any]:
        """Every plugin's config section; a plugin whose section name is taken fails."""
        from pydantic import BaseModel

        sections: dict[str, Any] = {}
        owners: dict[str, str] = {}
        hook = "torchbay_config_sections"
        for impl, info, found in self._results_of(hook):
            if not isinstance(found, dict) or not all(
                    isinstance(m, type) and issubclass(m, BaseModel) for m in found.values()):
                self._fail(info, hook, f"returned {found!r}, not a mapping of section name to pydantic model")
                continue
            clash = next((n for n in found if n in CoreConfig.model_fields), None)
            if clash:
                self._fail(info, hook, f"its config section '{clash}' clashes with the core key '{clash}'")
                continue
            clash = next((n for n in found if n in sections), None)
            if clash:
                self._fail(info, hook, f"its config section '{clash}' is already claimed by plugin "
                                       f"'{owners[clash]}'")
                continue
            for name, model in found.items():
                sections[name], owners[name] = model, impl.plugin_name
        return sections

    def _mapping_fragments(self):
        """``(plugin name, info, fragment)`` of every working plugin that has one, in registration order: the
        ``accelerate.yaml`` in its package, or what its ``torchbay_accelerate_mapping`` returns when it has that
        hook (a plugin whose file or hook fails is disabled and skipped)."""
        from torchbay.registry.fragments import FRAGMENT_FILE, fragment_file_of, read_fragment

        hook = "torchbay_accelerate_mapping"
        by_hook = {impl.plugin_name: impl for impl in getattr(self.hook, hook).get_hookimpls()}
        for name, plugin in self.list_name_plugin():
            if plugin is None or self.is_failed(name):
                continue
            impl, package = by_hook.get(name), None
            if impl is None:
                package = fragment_file_of(plugin)
                if package is None:
                    continue
                try:
                    found = read_fragment(package)
                except Exception as exc:  # a malformed file disables its plugin, as a failing hook does
                    self._fail(self.info_of(name), f"{package}/{FRAGMENT_FILE}", str(exc))
                    continue
            else:
                found = impl.function() or {}
            if not self.is_failed(name):
                yield name, self.info_of(name), found

    def accelerate_mapping(self, part: str, core: dict[str, Any]) -> dict[str, Any]:
        """The core's Accelerate compatibility table ``part`` with every plugin's fragment merged in.

        ``part`` is ``"config_import"`` or ``"api"`` (a plugin's ``accelerate.yaml``, or the hook
        ``torchbay_accelerate_mapping``);
        ``core`` is the core's own table, left unchanged. Mappings merge key by key and lists are
        concatenated; a key that the core or an earlier plugin already defines (at any depth, with
        a value that is not a mapping on both sides) is a conflict: as for a taken config section
        name, the later plugin fails and none of its fragment is used. Called only when the
        Accelerate import or an Accelerate name needs the table (never at import or start-up).
        """
        merged = copy.deepcopy(core)
        owners: dict[tuple[str, ...], str] = {}
        hook = "torchbay_accelerate_mapping"
        for plugin_name, info, found in self._mapping_fragments():
            fragment = found.get(part) if isinstance(found, dict) else None
            if not isinstance(found, dict) or not isinstance(fragment or {}, dict):
                self._fail(info, hook, f"returned {found!r}, not {{'config_import': mapping, 'api': mapping}}")
                continue
            candidate = copy.deepcopy(merged)
            clash = _merge_fragment(candidate, fragment or {}, (part,))
            if clash:
                owner = next((name for where, name in owners.items()
                              if where[:len(clash)] == clash or clash[:len(where)] == where), None)
                by = f"plugin '{owner}'" if owner else "torchbay's own table"
                self._fail(info, hook, f"its Accelerate mapping defines '{'.'.join(map(str, clash))}', which {by} "
                                       f"already defines")
                continue
            owners.update({path: plugin_name for path in _leaf_paths(fragment or {}, (part,))})
            merged = candidate
        return merged


def _merge_fragment(into: dict, fragment: dict, path: tuple) -> tuple | None:
    """Merge ``fragment`` into ``into`` in place; the path of the first key both define, else None."""
    for key, value in fragment.items():
        here = (*path, key)
        if key not in into:
            into[key] = copy.deepcopy(value)
        elif isinstance(into[key], dict) and isinstance(value, dict):
            clash = _merge_fragment(into[key], value, here)
            if clash:
                return clash
        elif isinstance(into[key], list) and isinstance(value, list):
            into[key] = into[key] + copy.deepcopy(value)
        else:
            return here
    return None


def _leaf_paths(fragment: dict, path: tuple) -> list[tuple]:
    """Every key path of ``fragment`` that ends at a value which is not a mapping."""
    paths = []
    for key, value in fragment.items():
        if isinstance(value, dict) and value:
            paths += _leaf_paths(value, (*path, key))
        else:
            paths.append((*path, key))
    return paths

