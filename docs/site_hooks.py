"""Hooks of the docs site (mkdocs.yml, ``make docs``): the home page is README.md, each reference page is one public
module rendered by mkdocstrings from its docstrings and types, and a link that leaves docs/ (a plugin's README, a
source file) is shown as the repository path it names, since the site holds only docs/; the docstrings' Sphinx roles
are dropped before their code."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
#: the public modules, one reference page each (mkdocs.yml's nav lists them; the hooks are docs/hooks.md)
REFERENCE = ("torchbay", "torchbay.plugin", "torchbay.utils", "torchbay.config", "torchbay.tracking", "torchbay.errors")
_OUT_OF_DOCS = re.compile(r"\[([^\]]+)\]\(\.\./([^)\s]+)\)")


def on_files(files, config):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "index.md", content=readme.replace("](docs/", "](")))
    for module in REFERENCE:
        files.append(File.generated(config, f"reference/{module}.md", content=f"::: {module}\n"))
    return files


def on_page_markdown(markdown, page, config, files):
    if "/" in page.file.src_uri:  # only the guides at docs/'s top level link out of it
        return markdown
    return _OUT_OF_DOCS.sub(lambda link: f"{link.group(1)} (`{link.group(2)}`)", markdown)


_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|data|attr|exc|obj|const):<code>~?")


def on_page_content(html, page, config, files):
    """The docstrings' Sphinx roles (``:class:`~torchbay.errors.ConfigError```) as plain code: the name stays."""
    return _ROLE.sub("<code>", html)
