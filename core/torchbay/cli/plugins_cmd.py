"""``torchbay plugins``: every plugin with its version, status, hooks and what it registers."""

from __future__ import annotations

import argparse
import json


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
        from torchbay.plugin.selection import probe_run_hooks

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
    from torchbay.plugin.info import _own_version

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


def plugins_command(args: argparse.Namespace) -> int:
    from torchbay.plugin.manager import get_plugin_manager

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
    widths = [max(len(headers[i]), *(len(c[i]) for c in cells)) if cells else len(headers[i])
              for i in range(len(headers))]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    for row, r in zip(cells, table):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if r["error"]:
            print(f"    error: {r['error']}")
        if r.get("fix"):
            print(f"    fix: {r['fix']}")
    return 0
