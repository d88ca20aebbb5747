"""pyproject.toml: the Python it requires, its dependencies and its package list."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import refresh_lock
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
FOLDERS = {"adstore.store": "store", "adstore.integration": "integration", "adstore.daemon": "daemon"}
TOPLEVEL = "daemon/toplevel"


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
    package_dir = dict(setuptools["package-dir"])
    # The namespace package itself holds python -m adstore and nothing else (no __init__: a namespace).
    assert package_dir.pop("adstore") == TOPLEVEL
    assert {p.name for p in (REPO / TOPLEVEL).iterdir() if p.suffix == ".py"} == {"__main__.py"}
    assert {k: v for k, v in package_dir.items() if k in FOLDERS} == FOLDERS
    for name, folder in package_dir.items():
        assert (REPO / folder / "__init__.py").is_file() and name.replace(".", "/").endswith(
            folder.split("/", 1)[-1]
        ), (name, folder)
    found = {"adstore"}
    for name, folder in FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([name, *rel.parts]))
    assert sorted(setuptools["packages"]) == sorted(found)


def test_python_dash_m_adstore_is_the_adstore_command(tmp_path: Path) -> None:
    """``python -m adstore`` (as users run pip, pytest or mypy) parses and runs like the ``adstore`` script."""
    env = {**os.environ, "ADSTORE_ROOT": str(tmp_path / "store")}

    def adstore(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "adstore", *argv], capture_output=True, text=True, env=env)

    version = adstore("--version")
    assert version.returncode == 0 and PROJECT["project"]["version"] in version.stdout, version
    missing = adstore("stats")  # the same one-line error and exit code as the script's
    assert missing.returncode == 13 and "a store is created by its first writer" in missing.stderr, missing
    assert "Traceback" not in missing.stderr
    bad = adstore("no-such-command")
    assert bad.returncode == 2 and "no-such-command" in bad.stderr, bad
    for module in ("adstore.daemon", "adstore.daemon.cli"):  # every module a user may name runs the command
        again = subprocess.run([sys.executable, "-m", module, "stats"], capture_output=True, text=True, env=env)
        assert again.returncode == 13 and "a store is created by its first writer" in again.stderr, (module, again)


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


def _requirements(dist: str, extras: frozenset[str] = frozenset()) -> set[str]:
    """Normalised names of everything ``dist`` (with ``extras``) requires, transitively, as installed here."""
    seen: set[str] = set()
    todo = [(dist, extras)]
    while todo:
        name, wanted = todo.pop()
        for req in map(Requirement, metadata.requires(name) or ()):
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in wanted or {""}):
                continue
            key = canonicalize_name(req.name)
            if key != "adstore" and key not in seen:
                seen.add(key)
                todo.append((req.name, frozenset(req.extras)))
            elif key == "adstore":
                todo.append(("adstore", frozenset(req.extras)))
    return seen


def test_the_test_environment_is_the_locked_one() -> None:
    """Every package the test, demo and docs extras install is pinned in requirements-lock.txt, torch at
    the README's release, and this environment holds exactly those releases (docs/operations.md, "Dependencies")."""
    lock = refresh_lock.parse(refresh_lock.LOCK.read_text())
    needed = _requirements("adstore", frozenset({"test", "demo", "docs"}))
    assert needed - lock.keys() == set(), "requirements-lock.txt misses packages the extras install"
    assert lock["torch"] == "2.13.0" and "torch==2.13.0" in (REPO / "README.md").read_text()
    stale = {n: (lock[n], metadata.version(n)) for n in sorted(needed) if metadata.version(n).split("+")[0] != lock[n]}
    assert not stale, f"not the locked releases (lock, installed): {stale}; install with -c requirements-lock.txt"


def test_the_lock_refresh_reports_every_change() -> None:
    old = refresh_lock.parse("# c\nTorch==2.13.0+cpu\nfoo_bar==1.0\nkept==2\n")
    assert old == {"torch": "2.13.0", "foo-bar": "1.0", "kept": "2"}
    new = refresh_lock.parse("torch==2.13.0\nkept==3\nnew.pkg==0.1 ; python_version >= '3.11'\n")
    assert refresh_lock.diff(old, new) == ["  foo-bar: 1.0 -> (removed)", "  kept: 2 -> 3", "  new-pkg: (none) -> 0.1"]
