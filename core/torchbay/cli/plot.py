"""``torchbay plot RUN_DIR``: draw the scalars the built-in ``jsonl`` tracker logged to a PNG.

Every ``metrics.jsonl`` under RUN_DIR is read (a resumed run appends to the same file, so
its steps continue the curve). Metrics whose names end alike (``train/loss``, ``eval/loss``)
share one panel (telemetry's ``memory/rank0/peak_gib``, ``memory/rank1/peak_gib``: one panel for every rank's
peak). ``--telemetry`` draws only telemetry's metrics (docs/telemetry.md). Needs matplotlib (``pip install
matplotlib``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from torchbay.errors import TorchbayError

INSTALL = "pip install matplotlib"
#: the name prefixes of telemetry's metrics (torchbay.telemetry.monitor)
TELEMETRY_PREFIXES = ("throughput/", "time/", "memory/", "flops/")


def register(subparsers) -> None:
    parser = subparsers.add_parser("plot", help="draw the built-in jsonl tracker's scalars to a PNG (matplotlib)",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a directory with metrics.jsonl files under it (e.g. the "
                        "project_dir), or one metrics.jsonl file")
    parser.add_argument("-o", "--output", default=None, help="PNG to write (default: RUN_DIR/metrics.png)")
    parser.add_argument("--metrics", default=None, help="comma-separated metric names to draw (default: all)")
    parser.add_argument("--telemetry", action="store_true", help="only telemetry's metrics (throughput, TFLOP/s, "
                        "MFU, step and data-wait time, memory per rank)")
    parser.add_argument("--force", action="store_true", help="overwrite the output file if it exists")
    parser.add_argument("--title", default=None, help="figure title (default: the run names)")
    parser.set_defaults(func=plot_command)


def panels(series: dict[str, list[tuple[int, float]]]) -> dict[str, list[str]]:
    """Metric names grouped by their last ``/`` part, in first-seen order."""
    groups: dict[str, list[str]] = {}
    for name in series:
        groups.setdefault(name.rsplit("/", 1)[-1], []).append(name)
    return groups


def collect(run_dir: str, wanted: list[str] | None) -> tuple[dict[str, list[tuple[int, float]]], list[Path]]:
    from torchbay.tracking.jsonl import find_jsonl, read_scalars

    root = Path(run_dir)
    if not root.exists():
        raise TorchbayError(f"torchbay plot: {run_dir} does not exist; give the run's project_dir or a metrics.jsonl")
    files = find_jsonl(root)
    if not files:
        raise TorchbayError(f"torchbay plot: no metrics.jsonl under {run_dir}; log with the built-in tracker "
                            f"(tracking.log_with: [jsonl], or --log-with jsonl) to get one")
    series: dict[str, list[tuple[int, float]]] = {}
    for path in files:
        prefix = "" if len(files) == 1 else f"{path.parent.name}:"
        for name, points in read_scalars(path).items():
            series.setdefault(prefix + name, []).extend(points)
    if wanted:
        missing = [w for w in wanted if not any(n == w or n.endswith(":" + w) for n in series)]
        if missing:
            raise TorchbayError(f"torchbay plot --metrics: {', '.join(missing)} not logged (logged: "
                                f"{', '.join(series)})")
        series = {n: p for n, p in series.items() if n in wanted or n.split(":", 1)[-1] in wanted}
    if not series:
        raise TorchbayError(f"torchbay plot: the metrics.jsonl files under {run_dir} hold no numbers yet")
    return series, files


def plot_command(args: argparse.Namespace) -> int:
    wanted = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    series, files = collect(args.run_dir, wanted)
    if args.telemetry:
        series = {n: p for n, p in series.items() if n.split(":", 1)[-1].startswith(TELEMETRY_PREFIXES)}
        if not series:
            raise TorchbayError(f"torchbay plot --telemetry: no telemetry metrics under {args.run_dir}; turn "
                                f"telemetry.enabled on (docs/telemetry.md)")
    root = Path(args.run_dir)
    output = Path(args.output) if args.output else (root.parent if root.is_file() else root) / "metrics.png"
    if output.exists() and not args.force:
        raise TorchbayError(f"torchbay plot: {output} exists; add --force to replace it, or choose -o")
    try:
        import matplotlib
    except ImportError:
        raise TorchbayError(f"torchbay plot needs matplotlib, which is not installed: {INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = panels(series)
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 3.2 * len(groups)), squeeze=False, sharex=True)
    for ax, (label, names) in zip(axes[:, 0], groups.items()):
        for name in names:
            points = sorted(series[name])
            style = "o-" if len(points) <= 30 else "-"
            ax.plot([s for s, _ in points], [v for _, v in points], style, label=name, markersize=4,
                    linewidth=1.2)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(args.title or ", ".join(sorted({p.parent.name for p in files})))
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110, metadata={"Software": "torchbay plot"})
    plt.close(fig)
    print(f"wrote {output} ({len(series)} metric(s) from {', '.join(str(f) for f in files)})")
    return 0
