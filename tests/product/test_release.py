"""Release metadata: every plugin distribution (and the plugin template `torchbay new-plugin` renders) requires
torchbay with both bounds, a lower one the current core satisfies and an upper one that stops at the next API major.

The wheels and sdists themselves are built, installed in a fresh venv and trained with by scripts/check_release.sh
(`make release-check`, run once by .ci/run).
"""

import configparser
import glob
import os
import string

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLUGIN_CFGS = sorted(glob.glob(os.path.join(ROOT, "plugins", "*", "setup.cfg"))
                     + glob.glob(os.path.join(ROOT, "plugins", "*", "*", "setup.cfg")))
TEMPLATE_CFG = os.path.join(ROOT, "core", "torchbay", "templates", "device", "setup.cfg.tmpl")


def _core_version() -> Version:
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    return Version(cfg["metadata"]["version"])


def _torchbay_requirements(text: str, where: str) -> list:
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read_string(text, source=where)
    lines = [line.strip() for line in cfg["options"].get("install_requires", "").splitlines()]
    reqs = [Requirement(line) for line in lines if line and not line.startswith("#")]
    return [r for r in reqs if r.name == "torchbay" or r.name.startswith("torchbay-")]


def _cases():
    cases = [(os.path.relpath(p, ROOT), open(p, encoding="utf-8").read()) for p in PLUGIN_CFGS]
    rendered = string.Template(open(TEMPLATE_CFG, encoding="utf-8").read()).substitute(
        name="acme", dist="torchbay-acme", package="torchbay_acme", classname="AcmeBackend")
    return cases + [(os.path.relpath(TEMPLATE_CFG, ROOT), rendered)]


def test_the_plugins_are_found():
    assert len(PLUGIN_CFGS) >= 19, PLUGIN_CFGS  # plugins/*/setup.cfg and plugins/*/*/setup.cfg


@pytest.mark.parametrize("where,text", _cases(), ids=[c[0] for c in _cases()])
def test_every_plugin_requires_torchbay_with_both_bounds(where, text):
    core = _core_version()
    next_major = Version(f"{core.major + 1}.0")
    reqs = _torchbay_requirements(text, where)
    assert any(r.name == "torchbay" for r in reqs), f"{where}: install_requires does not name torchbay"
    for req in reqs:
        ops = {spec.operator for spec in req.specifier}
        assert ">=" in ops and "<" in ops, (f"{where}: '{req}' needs both bounds, e.g. '{req.name}>={core.major}."
                                            f"{core.minor},<{core.major + 1}'")
        if req.name == "torchbay":
            assert req.specifier.contains(str(core)), (
                f"{where}: '{req}' excludes torchbay {core}, the core in this tree")
            assert not req.specifier.contains(str(next_major), prereleases=True), (
                f"{where}: '{req}' admits torchbay {next_major}, the next API major")
