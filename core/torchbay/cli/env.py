"""``torchbay env``: versions, plugins, devices and the config, as a block for bug reports."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers) -> None:
    parser = subparsers.add_parser("env", help="versions, plugins, devices and config: paste it into bug reports")
    parser.add_argument("--config-file", metavar="FILE", default=None, help="config to report (default: "
                        "$TORCHBAY_CONFIG_FILE, else ./torchbay.yaml when there is one)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.set_defaults(func=env_command)


def _found_config_file() -> str | None:
    """./torchbay.yaml when no config file is named, as torchbay launch reads it."""
    import os

    from torchbay.cli.options import DEFAULT_CONFIG_FILE
    from torchbay.config.files import CONFIG_FILE_ENV

    if not os.environ.get(CONFIG_FILE_ENV) and os.path.isfile(DEFAULT_CONFIG_FILE):
        return DEFAULT_CONFIG_FILE
    return None


def _fmt_bytes(n: int | None) -> str:
    if not n:
        return "?"
    return f"{n / 2**30:.1f} GiB"


def collect(pm, config_file: str | None = None) -> dict[str, Any]:
    """Everything ``torchbay env`` prints, as plain data."""
    import os

    from torchbay.config.model import RESOLVED_ENV
    from torchbay.registry.resolve import resolve_config

    report: dict[str, Any] = {"versions": {}, "plugins": [], "backends": {}, "devices": [], "config": {}}
    try:
        pm.config_sections()  # a plugin failing here is listed as failed below
        from torchbay.registry.selection import probe_run_hooks

        probe_run_hooks(pm, config_file)  # and one failing in torchbay_validate / torchbay_state_extra
    except Exception:
        pass
    registries = pm.registries()  # without what a failed plugin registered
    for impl in reversed(pm.hook.torchbay_report_env.get_hookimpls()):
        try:
            found = impl.function() or {}
        except Exception as exc:
            found = {"error": f"torchbay_report_env raised {type(exc).__name__}: {exc}"}
        target = report["versions"] if impl.plugin_name == "validation" else report["backends"].setdefault(
            impl.plugin_name, {})
        target.update({str(k): str(v) for k, v in found.items()})
    for dist in ("pluggy", "pydantic", "safetensors", "numpy"):
        try:
            from importlib.metadata import version

            report["versions"][dist] = version(dist)
        except Exception:
            report["versions"][dist] = "not installed"
    for info in sorted(pm.infos.values(), key=lambda i: (i.status != "builtin", i.name)):
        report["plugins"].append({"name": info.name, "distribution": info.distribution, "version": info.version,
                                  "status": info.status, "error": info.error, "hook": info.hook,
                                  "fix": info.how_to_remove() if info.status == "failed" else ""})
    for name, cls in sorted(registries["devices"].items()):
        entry: dict[str, Any] = {"name": name, "plugin": getattr(cls, "_torchbay_plugin", "?")}
        try:
            reason = cls.unavailable_reason()
            count = 0 if reason else int(cls.device_count())
        except Exception as exc:  # a broken device plugin must not hide the report
            reason = f"its plugin failed to say: {type(exc).__name__}: {exc}"
        if reason:
            entry["available"] = False
            entry["reason"] = reason
        else:
            entry["available"] = True
            entry["count"] = count
            try:
                free, total = cls(0).mem_get_info()
                entry["memory"] = f"{_fmt_bytes(free)} free of {_fmt_bytes(total)} (device 0)"
            except Exception as exc:
                entry["memory"] = f"unknown ({type(exc).__name__}: {exc})"
        report["devices"].append(entry)
    report["trackers"] = _trackers(registries["trackers"])
    from torchbay.axes.cluster import detect_cluster_environment

    cluster = detect_cluster_environment(registries["cluster_environments"])
    report["cluster"] = cluster.describe()
    environ = {k: v for k, v in os.environ.items() if k != RESOLVED_ENV}
    try:
        resolved = resolve_config(file=config_file, environ=environ, pm=pm)
        report["config"] = {k: {"value": v, "source": resolved.source_of(k)} for k, v in resolved.flat().items()
                            if resolved.source_of(k) != "default"}
        report["config_file"] = config_file or os.environ.get("TORCHBAY_CONFIG_FILE") or "none"
        from torchbay.tracking.trackers import where_logs_go

        report["tracking"] = where_logs_go(resolved.config, registries["trackers"])
    except Exception as exc:
        report["config_error"] = str(exc)
    return report


def _trackers(registry: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, cls in sorted(registry.items()):
        try:
            reason = cls.unavailable_reason()
        except Exception as exc:  # a broken tracker plugin must not hide the report
            reason = f"its plugin failed to say: {type(exc).__name__}: {exc}"
        entry: dict[str, Any] = {"name": name, "plugin": getattr(cls, "_torchbay_plugin", "?"),
                                 "available": not reason}
        if reason:
            entry["reason"] = reason
        out.append(entry)
    return out


def env_command(args: argparse.Namespace) -> int:
    from torchbay.registry.manager import get_plugin_manager

    report = collect(get_plugin_manager(), args.config_file or _found_config_file())
    if args.format == "json":
        print(json.dumps(report, indent=2))
        return 0
    print("\n".join(["```", "torchbay env", ""] + _head(report) + _plugins(report) + _reported(report)
                    + _devices(report) + _trackers_lines(report) + _tail(report) + ["```"]))
    return 0


#: what the built-in environment plugin reports, shown first (docs/cli.md)
FIRST = ("python", "platform", "torch", "torch accelerator", "torchbay")


def _head(report: dict[str, Any]) -> list[str]:
    own = report["backends"].get("environment", {})
    lines = [f"python: {own.get('python', '?')} ({own.get('platform', '?')})",
             f"torch: {own.get('torch', '?')} (accelerator: {own.get('torch accelerator', '?')})",
             f"torchbay: {own.get('torchbay', '?')}"]
    rest = {k: v for k, v in {**own, **report["versions"]}.items() if k not in FIRST}
    return lines + ["libraries: " + ", ".join(f"{k}: {v}" for k, v in rest.items())]


def _wrapped(label: str, items: list[str], width: int = 100) -> list[str]:
    """``  label: a, b, c`` over as many lines as it takes, never splitting an item."""
    lines = [f"  {label}: "]
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if len(lines[-1]) + len(piece) > width and lines[-1].strip():
            lines.append("    ")
        lines[-1] += piece + " "
    return [line.rstrip() for line in lines]


def _plugins(report: dict[str, Any]) -> list[str]:
    builtin = [p for p in report["plugins"] if p["status"] == "builtin"]
    loaded = [p for p in report["plugins"] if p["status"] == "loaded"]
    out = ["plugins:"]
    if builtin:
        core = builtin[0]
        out += _wrapped(f"built in ({core['distribution']} {core['version']})", [p["name"] for p in builtin])
    out += _wrapped("loaded", [f"{p['name']} {p['version']}" if p["distribution"] == f"torchbay-{p['name']}"
                               else f"{p['name']} ({p['distribution']} {p['version']})" for p in loaded])
    for p in report["plugins"]:
        if p in builtin or p in loaded:
            continue
        line = f"  {p['name']} ({p['distribution']} {p['version']}): {p['status']}"
        if p.get("hook") and p["hook"] not in ("import", "registration"):
            line += f" in {p['hook']}"
        out.append(line + (f": {p['error']}" if p["error"] else "") + (f" ({p['fix']})" if p.get("fix") else ""))
    return out


def _reported(report: dict[str, Any]) -> list[str]:
    """What plugins report about their libraries, but what the device lines say anyway."""
    said = {f"not available: {d['reason']}" for d in report["devices"] if not d["available"]}
    lines = []
    for plugin, values in report["backends"].items():
        for key, value in values.items():
            if plugin == "environment" or value in said:
                continue
            lines.append(f"  {plugin}: {value}" if key == plugin else f"  {plugin}: {key}: {value}")
    return ["reported by plugins:"] + lines if lines else []


def _devices(report: dict[str, Any]) -> list[str]:
    out = ["devices:"]
    for d in report["devices"]:
        if d["available"]:
            out.append(f"  {d['name']}: {d['count']} found, {d.get('memory', '')}")
        else:
            out.append(f"  {d['name']}: not available: {d['reason']}")
    return out


def _trackers_lines(report: dict[str, Any]) -> list[str]:
    available = [t["name"] for t in report["trackers"] if t["available"]]
    out = ["trackers (tracking.log_with selects by name):"] + _wrapped("available", available)
    out += [f"  {t['name']} ({t['plugin']}): not available: {t['reason']}" for t in report["trackers"]
            if not t["available"]]
    if report.get("tracking"):
        out.append("logs of the selected trackers go to:")
        out += [f"  {name}: {where}" for name, where in report["tracking"].items()]
    return out


def _tail(report: dict[str, Any]) -> list[str]:
    out = []
    out.append(f"cluster: {report['cluster']}")
    if "config_error" in report:
        out.append("config: INVALID")
        out += ["  " + line for line in report["config_error"].splitlines()]
    else:
        out.append(f"config (file: {report['config_file']}; only values not at their default):")
        if not report["config"]:
            out.append("  all defaults")
        for k, v in report["config"].items():
            out.append(f"  {k}: {json.dumps(v['value'])}  # {v['source']}")
    return out
