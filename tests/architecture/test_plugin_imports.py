"""Every in-repo plugin package (``plugins/**/torchbay_*``) keeps the core's import rules: no runtime import cycle
among its modules, and imports of torchbay's code inside functions only as the exception
(imports.FUNCTION_LEVEL_SHARE_MAX). The checker is shown failing a package written to break both, and the numbers
in docs/architecture.md are the ones measured now."""

from __future__ import annotations

import textwrap

import imports
import pytest

DOC = imports.ROOT / "docs" / "architecture.md"


def test_every_plugin_package_is_checked():
    names = {package.name for package in imports.plugin_packages()}
    assert {"torchbay_fsdp", "torchbay_deepspeed", "torchbay_cuda", "torchbay_fp8_te", "torchbay_wandb"} <= names
    assert len(names) == len(imports.plugin_packages())  # one package per name


@pytest.mark.parametrize("package", imports.plugin_packages(), ids=lambda package: package.name)
def test_plugin_package_keeps_the_core_import_rules(package):
    assert not imports.problems(package), "\n".join(imports.problems(package))


def _write(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")


def test_the_checker_fails_a_package_with_a_cycle_and_deferred_imports(tmp_path):
    """A package on disk that breaks both rules: ``a`` imports ``b`` at module level, ``b`` imports ``a`` inside a
    function (a runtime cycle all the same), and ``c`` makes every import inside functions."""
    package = tmp_path / "plugins" / "demo" / "torchbay_demo"
    _write(package, {
        "__init__.py": '"""demo"""\n',
        "a.py": "from torchbay_demo import b\nfrom torchbay.errors import ConfigError\n",
        "b.py": "def f():\n    from torchbay_demo.a import ConfigError\n    return ConfigError\n",
        "c.py": """\
            import torchbay_demo.a
            from torchbay_demo.b import f
            if TYPE_CHECKING:
                from torchbay_demo import a as typed  # does not run: not counted
            def g():
                from torchbay_demo import a, b
                from torchbay.plugin import hookimpl
                return a, b, hookimpl
            def h():
                import torchbay_demo.b
                from . import a
                return a, torchbay_demo.b
        """,
    })
    edges = imports.import_edges(package)
    assert ("torchbay_demo.b", "torchbay_demo.a", 2, True) in edges
    assert ("torchbay_demo.a", "torchbay.errors", 2, False) in edges
    assert imports.cycles(edges) == [["torchbay_demo.a", "torchbay_demo.b"]]
    assert imports.function_level(edges) == (6, 10)  # b: a; c: g imports a, b, torchbay.plugin and h b, a
    found = imports.problems(package)
    assert any("runtime import cycle torchbay_demo.a <-> torchbay_demo.b" in p for p in found), found
    assert any("6 of 10 imports of torchbay's code sit inside functions (the limit is 1, 10%)" in p
               and "torchbay_demo.c:6 -> torchbay_demo.a" in p for p in found), found


def test_one_import_moved_into_a_function_fails_a_package_at_its_limit(tmp_path):
    """The limit is what it says: 10 imports at module level pass with one inside a function, and fail with two."""
    package = tmp_path / "torchbay_edge"
    modules = {"__init__.py": ""}
    modules.update({f"m{i}.py": "from torchbay.errors import ConfigError\n" for i in range(9)})
    modules["late.py"] = "def f():\n    from torchbay.errors import ConfigError\n    return ConfigError\n"
    _write(package, modules)
    assert imports.function_level(imports.import_edges(package)) == (1, 10)
    assert not imports.problems(package)
    (package / "m0.py").write_text("def f():\n    from torchbay.errors import ConfigError\n    return ConfigError\n")
    assert imports.function_level(imports.import_edges(package)) == (2, 10)
    assert imports.problems(package) and "2 of 10" in imports.problems(package)[0]


def test_the_docs_show_the_numbers_measured_now():
    assert imports.table() in DOC.read_text(encoding="utf-8"), (
        "docs/architecture.md, \"Imports inside functions\", is stale: paste the output of "
        "python tests/architecture/imports.py")
