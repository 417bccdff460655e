"""``torchbay new-plugin --kind device NAME``: scaffold a plugin distribution.

The generated package (``setup.cfg`` with the ``torchbay`` entry point, ``pyproject.toml``,
``torchbay_<name>/plugin.py`` with the backend class, the conformance test wired in, a
README) installs and passes the device conformance kit as generated: the device maps to
the host CPU until its author fills it in. Nothing outside the new directory is touched.
"""

from __future__ import annotations

import keyword
import re
import string
import sys
from importlib import resources
from pathlib import Path

from torchbay.errors import TorchbayError

KINDS = ("device",)
#: template file -> path in the generated package (formatted with the names)
DEVICE_FILES = {
    "setup.cfg.tmpl": "setup.cfg",
    "pyproject.toml.tmpl": "pyproject.toml",
    "README.md.tmpl": "README.md",
    "__init__.py.tmpl": "{package}/__init__.py",
    "plugin.py.tmpl": "{package}/plugin.py",
    "accelerate.yaml.tmpl": "{package}/accelerate.yaml",
    "test_conformance.py.tmpl": "tests/test_{name}_conformance.py",
}
RESERVED = {"auto", "cpu"}
NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def names_for(name: str) -> dict[str, str]:
    """The names derived from a plugin name: distribution, package and class."""
    if not NAME_RE.match(name) or keyword.iskeyword(name):
        raise TorchbayError(f"plugin name '{name}' must be lowercase letters, digits and '_', starting with a letter "
                            f"(it becomes the config value device: {name} and the package torchbay_{name})")
    if name in RESERVED:
        raise TorchbayError(f"plugin name '{name}' is reserved by torchbay; choose your device's own name")
    classname = "".join(part.capitalize() for part in name.split("_") if part) + "Backend"
    return {"name": name, "dist": "torchbay-" + name.replace("_", "-"), "package": f"torchbay_{name}",
            "classname": classname}


def _template(kind: str, filename: str) -> str:
    path = resources.files("torchbay").joinpath("templates", kind, filename)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TorchbayError(f"the template {kind}/{filename} is missing from this torchbay installation (it ships as "
                            f"package data under torchbay/templates); reinstall torchbay") from None


def scaffold_device_plugin(name: str, output: str | Path = ".", force: bool = False) -> Path:
    """Write the device plugin package ``<output>/<name>``; return its directory."""
    values = names_for(name)
    target = Path(output) / name
    if target.exists() and any(target.iterdir()) and not force:
        raise TorchbayError(f"{target} already exists and is not empty; choose another --output or pass --force")
    rendered = {}
    for template, relative in DEVICE_FILES.items():
        text = string.Template(_template("device", template)).substitute(values)
        rendered[target / relative.format(**values)] = text
    differing = [path for path, text in rendered.items()
                 if path.exists() and (not path.is_file() or path.read_text(encoding="utf-8") != text)]
    if differing:  # checked before anything is written, so a refusal leaves the directory as it was
        listed = "\n".join(f"  {path}" for path in differing)
        raise TorchbayError(f"new-plugin would replace files that differ from the templates (yours, or an older "
                            f"scaffold's):\n{listed}\nmove them away or choose another --output; torchbay does not "
                            f"overwrite files, even with --force")
    for path, text in rendered.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return target


def run(args) -> int:
    if args.kind != "device":  # argparse limits the choices; kept for direct callers
        raise TorchbayError(f"--kind {args.kind} is not supported (kinds: {', '.join(KINDS)})")
    target = scaffold_device_plugin(args.name, args.output, force=args.force)
    values = names_for(args.name)
    print(f"created {values['dist']} in {target}\n"
          f"next:\n"
          f"  pip install -e {target}\n"
          f"  torchbay plugins            # '{args.name}' is listed\n"
          f"  pytest {target / 'tests'}   # the device conformance kit (passes as generated, mapped to the CPU)\n"
          f"then fill in {target / values['package'] / 'plugin.py'} (steps at its top).", file=sys.stdout)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("new-plugin", help="scaffold a torchbay plugin package (a device, for now)",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=KINDS, required=True, help="what the plugin provides")
    parser.add_argument("name", help="the plugin's name (the device's config value), e.g. 'acme'")
    parser.add_argument("--output", "-o", default=".", metavar="DIR",
                        help="directory to create the package in; it goes to DIR/NAME (default: .)")
    parser.add_argument("--force", action="store_true",
                        help="write into an existing non-empty directory (a file that differs is never replaced)")
    parser.set_defaults(func=run)
