"""``torchbay env``: versions, plugins, devices and the config, as a block for bug reports."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers) -> None:
    parser = subparsers.add_parser("env", help="versions, plugins, devices and config: paste it into bug reports")
    parser.add_argument("--config-file", metavar="FILE", default=None, help="config to report (default: "
                        "$TORCHBAY_CONFIG_FILE)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.set_defaults(func=env_command)


def _fmt_bytes(n: int | None) -> str:
    if not n:
        return "?"
    return f"{n / 2**30:.1f} GiB"


def collect(pm, config_file: str | None = None) -> dict[str, Any]:
    """Everything ``torchbay env`` prints, as plain data."""
    import os

    from torchbay.config import RESOLVED_ENV, resolve_config

    report: dict[str, Any] = {"versions": {}, "plugins": [], "backends": {}, "devices": [], "config": {}}
    registries = pm.registries()
    try:
        pm.config_sections()  # a plugin failing here is listed as failed below
    except Exception:
        pass
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
                                  "status": info.status, "error": info.error, "hook": info.hook})
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
    from torchbay.cluster import detect_cluster_environment

    cluster = detect_cluster_environment(registries["cluster_environments"])
    report["cluster"] = cluster.describe()
    environ = {k: v for k, v in os.environ.items() if k != RESOLVED_ENV}
    try:
        resolved = resolve_config(file=config_file, environ=environ, pm=pm)
        report["config"] = {k: {"value": v, "source": resolved.source_of(k)} for k, v in resolved.flat().items()
                            if resolved.source_of(k) != "default"}
        report["config_file"] = config_file or os.environ.get("TORCHBAY_CONFIG_FILE") or "none"
        from torchbay.tracking import where_logs_go

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
    from torchbay.plugins import get_plugin_manager

    report = collect(get_plugin_manager(), args.config_file)
    if args.format == "json":
        print(json.dumps(report, indent=2))
        return 0
    out = ["```", "torchbay env", "", "versions:"]
    out += [f"  {k}: {v}" for k, v in report["versions"].items()]
    out.append("plugins:")
    for p in report["plugins"]:
        line = f"  {p['name']} ({p['distribution']} {p['version']}): {p['status']}"
        if p.get("hook") and p["hook"] not in ("import", "registration"):
            line += f" in {p['hook']}"
        out.append(line + (f": {p['error']}" if p["error"] else ""))
    if report["backends"]:
        out.append("backend libraries (reported by plugins):")
        for plugin, values in report["backends"].items():
            for k, v in values.items():
                out.append(f"  {plugin}: {k}: {v}")
    out.append("devices:")
    for d in report["devices"]:
        if d["available"]:
            out.append(f"  {d['name']}: {d['count']} found, {d.get('memory', '')}")
        else:
            out.append(f"  {d['name']}: not available: {d['reason']}")
    out.append("trackers (tracking.log_with selects by name):")
    for t in report["trackers"]:
        out.append(f"  {t['name']} ({t['plugin']}): " + ("available" if t["available"] else
                                                         f"not available: {t['reason']}"))
    if report.get("tracking"):
        out.append("logs of the selected trackers go to:")
        out += [f"  {name}: {where}" for name, where in report["tracking"].items()]
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
    out.append("```")
    print("\n".join(out))
    return 0
