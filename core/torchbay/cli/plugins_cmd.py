"""``torchbay plugins``: every plugin with its version, status, hooks and what it registers."""

from __future__ import annotations

import argparse
import json
import shutil


def register(subparsers) -> None:
    parser = subparsers.add_parser("plugins",
                                   help="list plugins: name, version, plugin API version, status, hooks, registers")
    parser.add_argument("--requirements", action="store_true",
                        help="print pip requirement lines that reproduce this installation's plugins")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.set_defaults(func=plugins_command)


def rows(pm) -> list[dict]:
    rows_error = ""
    try:
        pm.registries()  # fills "registers"; a plugin failing here is marked failed
        pm.load_every_registered()  # and one whose lazily registered class cannot be imported
        pm.config_sections()
        from torchbay.registry.selection import probe_run_hooks

        probe_run_hooks(pm)  # a plugin failing in torchbay_validate/state_extra too
        pm.registries()  # what a failed plugin registered is dropped
    except Exception as exc:  # never hide the table
        rows_error = f"{type(exc).__name__}: {exc}"
    out = []
    for info in sorted(pm.infos.values(), key=lambda i: (i.status != "builtin", i.name)):
        hooks = [h.removeprefix("torchbay_") for h in pm.hooks_of(info.name)]
        out.append({"name": info.name, "distribution": info.distribution, "version": info.version,
                    "api": info.api or "-", "status": info.status, "hooks": hooks,
                    "registers": sorted(set(info.registers)),
                    "error": (f"in {info.hook}: " if info.hook and info.hook not in ("import", "registration")
                              else "") + (info.error or ""),
                    "fix": info.how_to_remove() if info.status in ("failed", "refused") else ""})
    if rows_error:
        out.append({"name": "(registries)", "distribution": "", "version": "", "api": "", "status": "failed",
                    "hooks": [], "registers": [], "error": rows_error, "fix": ""})
    return out


def requirement_lines(pm) -> list[str]:
    from torchbay.registry.info import _own_version

    lines = [f"torchbay=={_own_version()}"]
    seen = {"torchbay"}
    for info in sorted(pm.infos.values(), key=lambda i: i.distribution):
        if info.distribution in seen or info.distribution in ("?", "(in process)", ""):
            continue
        seen.add(info.distribution)
        line = f"{info.distribution}=={info.version}"
        if info.status not in ("loaded", "builtin"):
            line += f"  # {info.status}" + (f": {info.error}" if info.error else "")
        lines.append(line)
    return lines


#: the narrowest a wrapped column (HOOKS, REGISTERS) becomes before the table is let past the terminal's width
MIN_WRAPPED = 16


def fit_widths(headers: tuple[str, ...], cells: list[tuple[str, ...]], columns: int) -> list[int]:
    """Each column's width; the last two (comma lists) share what the terminal has left and wrap inside it."""
    widths = [max(len(headers[i]), *(len(c[i]) for c in cells)) if cells else len(headers[i])
              for i in range(len(headers))]
    fixed = sum(widths[:-2]) + 2 * (len(widths) - 1)
    room = columns - fixed
    if sum(widths[-2:]) <= room:
        return widths
    hooks, registers = widths[-2:]
    # never narrower than one item of the list (a hook name is not cut in two)
    least = [max([MIN_WRAPPED, *(len(item) for c in cells for item in c[i].split(", "))]) for i in (-2, -1)]
    widths[-2] = min(hooks, max(least[0], room * hooks // (hooks + registers)))
    widths[-1] = min(registers, max(least[1], room - widths[-2]))
    return widths


def _wrapped_row(row: tuple[str, ...], widths: list[int]) -> list[str]:
    """The lines of one table row, each cell wrapped (at ", ") to its column's width."""
    import textwrap

    parts = [textwrap.wrap(cell, width=width, break_on_hyphens=False) or [""] for cell, width in zip(row, widths)]
    height = max(len(p) for p in parts)
    return ["  ".join((p[i] if i < len(p) else "").ljust(w) for p, w in zip(parts, widths)).rstrip()
            for i in range(height)]


def plugins_command(args: argparse.Namespace) -> int:
    from torchbay.registry.manager import get_plugin_manager

    pm = get_plugin_manager()
    if args.requirements:
        print("\n".join(requirement_lines(pm)))
        return 0
    table = rows(pm)
    if args.format == "json":
        print(json.dumps(table, indent=2))
        return 0
    headers = ("NAME", "DISTRIBUTION", "VERSION", "API", "STATUS", "HOOKS", "REGISTERS")
    cells = [(r["name"], r["distribution"], r["version"], r["api"], r["status"], ", ".join(r["hooks"]) or "-",
              ", ".join(r["registers"]) or "-") for r in table]
    widths = fit_widths(headers, cells, shutil.get_terminal_size().columns)
    for line in _wrapped_row(headers, widths):
        print(line)
    for row, r in zip(cells, table):
        for line in _wrapped_row(row, widths):
            print(line)
        if r["error"]:
            print(f"    error: {r['error']}")
        if r.get("fix"):
            print(f"    fix: {r['fix']}")
    return 0
