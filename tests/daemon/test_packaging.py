"""pyproject.toml: the Python it requires, its dependencies and its package list."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
FOLDERS = {"adstore.store": "store", "adstore.integration": "integration", "adstore.daemon": "daemon"}


def _sources() -> list[Path]:
    return [p for folder in FOLDERS.values() for p in (REPO / folder).rglob("*.py")]


def test_requires_the_python_whose_stdlib_the_code_uses() -> None:
    """tomllib and enum.StrEnum are 3.11; so no tomli backport is needed or listed."""
    spec = SpecifierSet(PROJECT["project"]["requires-python"])
    assert "3.10" not in spec and "3.11" in spec and sys.version_info >= (3, 11)
    deps = PROJECT["project"]["dependencies"]
    assert not [d for d in deps if d.split(";")[0].strip().startswith("tomli")], deps
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert "tomli" not in names, f"{path} imports tomli"


def test_every_package_folder_is_listed() -> None:
    """A non-editable install (``pip install .``) ships only the packages listed."""
    setuptools = PROJECT["tool"]["setuptools"]
    package_dir = setuptools["package-dir"]
    assert {k: v for k, v in package_dir.items() if k in FOLDERS} == FOLDERS
    for name, folder in package_dir.items():
        assert (REPO / folder / "__init__.py").is_file() and name.replace(".", "/").endswith(
            folder.split("/", 1)[-1]
        ), (name, folder)
    found = set()
    for name, folder in FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([name, *rel.parts]))
    assert sorted(setuptools["packages"]) == sorted(found)


def test_every_module_is_small_documented_and_declares_its_api() -> None:
    """Under 500 lines, a docstring, an explicit ``__all__``, and no reference to a document outside the repository."""
    for path in sorted(_sources()):
        text = path.read_text()
        tree = ast.parse(text)
        assert len(text.splitlines()) < 500, f"{path}: {len(text.splitlines())} lines"
        assert ast.get_docstring(tree), f"{path} has no docstring"
        assert "DESIGN" not in text and "§" not in text, f"{path} refers to a document outside the repository"
        if path.name != "__main__.py":
            assert any(
                isinstance(node, (ast.Assign, ast.AnnAssign))
                and any(
                    getattr(t, "id", None) == "__all__"
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                )
                for node in tree.body
            ), f"{path} has no __all__"
