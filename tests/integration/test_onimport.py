"""``onimport.when_imported``: a callback on a module's import, without importing it, that never breaks the import."""

from __future__ import annotations

import importlib
import sys
import uuid

import pytest

from adstore.integration import onimport


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh package name on ``sys.path`` with modules ``a`` and ``broken`` (raises when imported)."""
    name = f"pkg_{uuid.uuid4().hex[:8]}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("VALUE = 1\n")
    (root / "broken.py").write_text("raise RuntimeError('broken module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


def test_the_callback_waits_for_the_import_and_the_watch_leaves_after(package):
    seen = []
    onimport.when_imported(f"{package}.a", lambda m: seen.append(m.VALUE))
    assert f"{package}.a" not in sys.modules and seen == []
    assert onimport.watched() == [f"{package}.a"] and any(isinstance(f, onimport._Finder) for f in sys.meta_path)
    module = importlib.import_module(f"{package}.a")
    assert seen == [1] and module.VALUE == 1
    assert "exec_module" not in vars(module.__spec__.loader)  # the loader is its own again
    assert onimport.watched() == [] and not any(isinstance(f, onimport._Finder) for f in sys.meta_path)


def test_an_imported_module_gets_the_callback_at_once(package):
    importlib.import_module(f"{package}.a")
    seen = []
    onimport.when_imported(f"{package}.a", seen.append)
    assert [m.__name__ for m in seen] == [f"{package}.a"] and onimport.watched() == []


def test_a_failing_callback_never_fails_the_import(package, caplog):
    def boom(module):
        raise ValueError("injected")

    onimport.when_imported(f"{package}.a", boom)
    assert importlib.import_module(f"{package}.a").VALUE == 1
    assert any("injected" in r.getMessage() for r in caplog.records)


def test_a_cancelled_callback_is_not_called(package):
    seen = []
    cancel = onimport.when_imported(f"{package}.a", seen.append)
    cancel()
    importlib.import_module(f"{package}.a")
    assert seen == [] and onimport.watched() == []


def test_a_module_that_fails_to_import_keeps_its_callback_for_the_next_attempt(package):
    seen = []
    cancel = onimport.when_imported(f"{package}.broken", seen.append)
    with pytest.raises(RuntimeError, match="broken module"):
        importlib.import_module(f"{package}.broken")
    assert seen == [] and onimport.watched() == [f"{package}.broken"]
    cancel()
    assert onimport.watched() == []
