"""The vLLM plugin without vLLM: ``register()`` is what vLLM calls in each process, so it is tested as vLLM calls it.

Off with ``ADSTORE_VLLM=0``; on, it enables the Inductor integration once per
process; a store that cannot be opened is one log line, never an exception;
and the entry point vLLM looks up is declared by the installed distribution.
"""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

from adstore.integration import inductor
from adstore.integration.inductor import entries as entries_module
from adstore.integration.vllm import plugin

pytest.importorskip("torch")


@pytest.fixture
def fresh(monkeypatch):
    """A process in which vLLM has not called the plugin yet; adstore disabled again after the test."""
    monkeypatch.setattr(plugin, "_registered_pid", None)
    monkeypatch.delenv("ADSTORE_VLLM", raising=False)
    monkeypatch.delenv("ADSTORE_REMOTE", raising=False)
    inductor.disable()
    yield
    inductor.disable()


def test_adstore_vllm_0_does_nothing(fresh, store_root, monkeypatch):
    monkeypatch.setenv("ADSTORE_VLLM", "0")
    plugin.register()
    assert inductor.active() is None
    assert plugin._registered_pid is None
    assert not store_root.exists()


def test_register_enables_the_inductor_integration_once(fresh, store_root, monkeypatch):
    calls = []
    enable = inductor.enable
    monkeypatch.setattr(inductor, "enable", lambda *a, **k: calls.append(1) or enable(*a, **k))
    plugin.register()
    entries = inductor.active()
    assert entries is not None and str(entries.store.root) == str(store_root)
    plugin.register()  # vLLM may load its plugins more than once in a process
    plugin.register()
    assert calls == [1] and inductor.active() is entries
    entries.store.flush()
    assert entries.store.stats().counters.get("vllm.plugin_enabled") == 1


def test_register_leaves_an_enable_of_the_process_alone(fresh, store_root, monkeypatch):
    assert inductor.enable() is True
    entries = inductor.active()
    plugin.register()
    assert inductor.active() is entries


def test_a_broken_store_root_is_logged_not_raised(fresh, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the store's directory should be")
    monkeypatch.setenv("ADSTORE_ROOT", str(blocker / "store"))
    monkeypatch.setattr(entries_module, "_logged", set())  # the reason is logged once per process
    with caplog.at_level(logging.WARNING, logger="adstore"):
        plugin.register()
    assert inductor.active() is None
    assert any("without adstore" in r.getMessage() for r in caplog.records)
    plugin.register()  # tried once per process: no second attempt, no second line
    assert inductor.active() is None


def test_an_unexpected_error_is_logged_not_raised(fresh, store_root, monkeypatch, caplog):
    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(inductor, "enable", boom)
    with caplog.at_level(logging.WARNING, logger="adstore"):
        plugin.register()
    assert [r.getMessage() for r in caplog.records if "injected" in r.getMessage()]


def test_the_entry_point_is_declared():
    points = importlib.metadata.distribution("adstore").entry_points
    (ep,) = [p for p in points if p.group == "vllm.general_plugins"]
    assert ep.name == "adstore" and ep.value == "adstore.integration.vllm.plugin:register"
    assert ep.load() is plugin.register


def test_the_model_inspection_subprocess_is_left_alone(fresh, store_root, monkeypatch):
    import sys
    import types
    from importlib.machinery import ModuleSpec

    main = types.ModuleType("__main__")  # what `python -m vllm.model_executor.models.registry` runs as __main__
    main.__spec__ = ModuleSpec(plugin.INSPECTION_MAIN, None)
    monkeypatch.setitem(sys.modules, "__main__", main)
    plugin.register()
    assert inductor.active() is None and plugin._registered_pid is None
    assert not store_root.exists()


def test_the_plugin_and_adstore_enable_never_enable_twice(fresh, store_root, monkeypatch):
    """Under ``adstore run``, vLLM's processes have both: whichever comes first enables, the other keeps it."""
    from adstore.integration import autoenable

    calls = []
    enable = inductor.enable
    monkeypatch.setattr(inductor, "enable", lambda *a, **k: calls.append(1) or enable(*a, **k))
    assert autoenable.activate() is True  # torch._dynamo imported first
    entries = inductor.active()
    plugin.register()
    assert autoenable.activate() is True
    assert calls == [1] and inductor.active() is entries
    inductor.disable()
    monkeypatch.setattr(plugin, "_registered_pid", None)
    plugin.register()  # the plugin first
    entries = inductor.active()
    assert autoenable.activate() is True
    assert calls == [1, 1] and inductor.active() is entries
