"""The vLLM hooks against stand-ins for vLLM 0.32.0's call signatures (no vLLM is installed here).

The fake ``vllm`` package (``conftest.py``) has only what the hooks wrap,
with vLLM's names, signatures and file layout.  The drivers
(:func:`_aot_call`, :func:`_piecewise_call`) do what vLLM's callers do
around them, in the same order.  The real-vLLM run is ``test_vllm_real.py`` (slow).
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
from pathlib import Path

import pytest

from adstore.integration.inductor.entries import FAILOPEN
from adstore.integration.vllm import hooks, layout, trees
from adstore.integration.vllm.treefiles import artifact_name

AOT_HASH = "c0ffee" * 10 + "abcd"


@pytest.fixture
def vllm(fake_vllm):
    """The fake vLLM (``conftest.py``) with its two compilation modules imported, as in a process that compiles."""
    return importlib.import_module("vllm.compilation.decorators"), importlib.import_module("vllm.compilation.backends")


def _aot_call(decorators, model_cls):
    """What ``__call__`` of a decorated class does with VLLM_USE_AOT_COMPILE: look, else compile and save."""
    root = os.environ["VLLM_CACHE_ROOT"]
    cache_dir = os.path.join(root, "torch_compile_cache", "torch_aot_compile", AOT_HASH)
    inductor_cache = os.path.join(cache_dir, "inductor_cache")
    os.makedirs(inductor_cache, exist_ok=True)
    rank_dir = os.path.join(cache_dir, "rank_0_0")
    model = model_cls()
    loaded = decorators._try_load_aot_compiled_fn(model, os.path.join(rank_dir, "model"))
    if loaded is not None:
        return "loaded", loaded
    with open(os.path.join(inductor_cache, "kernel.so"), "wb") as f:  # Inductor compiles
        f.write(os.urandom(100_000))
    model._aot_compilation_path, model._aot_cache_dir = os.path.join(rank_dir, "model"), rank_dir
    model.save_aot_compiled_function()
    return "compiled", None


def _piecewise_call(backends, prefix="backbone"):
    """What ``VllmBackend.__call__`` does: make the rank/prefix directory, initialize, compile, save."""
    root = os.environ["VLLM_CACHE_ROOT"]
    local = os.path.join(root, "torch_compile_cache", "0123456789", "rank_0_0", prefix)
    os.makedirs(local, exist_ok=True)
    manager = backends.CompilerManager()
    manager.initialize_cache(local, False, prefix)
    if manager.cache:
        return "loaded", manager.cache
    manager.cache = {"graph": "artifact"}
    with open(os.path.join(local, "artifact"), "wb") as f:
        f.write(os.urandom(80_000))
    manager.is_cache_updated = True
    manager.save_to_file()
    return "compiled", None


def _wipe(tmp_path):
    """A new host with the same layout: vLLM's cache directory is gone."""
    import shutil

    shutil.rmtree(tmp_path / "vllm-cache")


def test_importing_and_installing_without_vllm_changes_nothing():
    assert importlib.util.find_spec("vllm") is None
    assert hooks.install() is False
    assert "vLLM not hooked" in hooks.status() and "vllm" not in sys.modules


def test_the_aot_path_restores_what_an_earlier_run_saved(vllm, store, tmp_path):
    decorators, _ = vllm
    original_load, original_save = decorators._try_load_aot_compiled_fn, decorators.Model.save_aot_compiled_function
    assert hooks.install(store) and hooks.status().startswith("installed")
    assert decorators._try_load_aot_compiled_fn is not original_load
    assert _aot_call(decorators, decorators.Model)[0] == "compiled"  # captured after the save
    _wipe(tmp_path)
    how, loaded = _aot_call(decorators, decorators.Model)
    assert how == "loaded" and loaded["repro"] == f"CACHE_DIR = '{os.environ['VLLM_CACHE_ROOT']}/inductor_cache'"
    kernel = tmp_path / "vllm-cache/torch_compile_cache/torch_aot_compile" / AOT_HASH / "inductor_cache/kernel.so"
    assert kernel.stat().st_size == 100_000  # the shared inductor_cache came back too
    assert hooks.uninstall()
    assert decorators._try_load_aot_compiled_fn is original_load
    assert decorators.Model.__dict__["save_aot_compiled_function"] is original_save


def test_an_aot_tree_from_another_cache_root_is_restored_with_this_hosts_paths(vllm, store, tmp_path, monkeypatch):
    decorators, _ = vllm
    assert hooks.install(store)
    assert _aot_call(decorators, decorators.Model)[0] == "compiled"
    key, _ = trees.tree_key(kind="aot", vllm_hash=AOT_HASH, rank="rank_0_0")
    stored = store.lookup(key).manifest
    assert stored.meta["relocated"] == {"model": ["cache_root"]} and stored.meta["anchors"] == {}
    blob = store.read_artifact(stored, artifact_name("model"))
    assert str(tmp_path).encode() not in blob and b"${cache_root}/inductor_cache" in blob  # no path of this host
    other = tmp_path / "home-b" / ".cache" / "vllm"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(other))  # another HOME: the pickle named the first root
    before = FAILOPEN["vllm.incompatible_env"]
    how, loaded = _aot_call(decorators, decorators.Model)
    assert how == "loaded" and FAILOPEN["vllm.incompatible_env"] == before
    assert loaded["repro"] == f"CACHE_DIR = '{other}/inductor_cache'"
    assert pickle.loads(loaded["inner"]) == {"co_filename": f"{other}/inductor_cache/x.py"}
    assert loaded["compiled_fn"].finalized  # vLLM's own class: its own finalize_loading ran


def test_torchs_aot_artifact_gets_the_finalize_loading_vllm_calls_and_loses_it_on_uninstall(vllm, store):
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    assert "finalize_loading" not in Bundled.__dict__  # torch 2.13: vLLM 0.32.0's AOT load fails on CPU
    assert hooks.install(store)  # the fake decorators module was imported: its load calls finalize_loading
    assert Bundled.__dict__["finalize_loading"] is hooks._finalize_loading
    assert Bundled.finalize_loading(object.__new__(Bundled), None) is None
    hooks.uninstall()
    assert "finalize_loading" not in Bundled.__dict__


def test_without_torchs_artifact_class_the_aot_load_is_left_as_it_is_and_said_once(fake_vllm, store, monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "torch._dynamo.aot_compile_types", types.ModuleType("aot_compile_types"))
    before = FAILOPEN["vllm.incompatible_vllm"]
    assert hooks.install(store)
    importlib.import_module("vllm.compilation.decorators")
    assert FAILOPEN["vllm.incompatible_vllm"] == before + 1
    assert store.stats().counters.get("vllm.failopen.incompatible_vllm") == 1
    monkeypatch.undo()
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    assert "finalize_loading" not in Bundled.__dict__


def test_the_piecewise_path_restores_a_prefix_directory(vllm, store, tmp_path):
    _, backends = vllm
    original = backends.CompilerManager.__dict__["initialize_cache"]
    assert hooks.install(store)
    assert _piecewise_call(backends) == ("compiled", None)
    _wipe(tmp_path)
    assert _piecewise_call(backends) == ("loaded", {"graph": "artifact"})
    assert _piecewise_call(backends, prefix="eagle_head")[0] == "compiled"  # another part, another tree
    hooks.uninstall()
    assert backends.CompilerManager.__dict__["initialize_cache"] is original


def test_a_broken_store_never_reaches_vllm(vllm, store, tmp_path):
    decorators, backends = vllm
    assert hooks.install(store)
    store.close()  # every adstore step now fails: the originals still run, unchanged
    assert _aot_call(decorators, decorators.Model)[0] == "compiled"
    assert _piecewise_call(backends)[0] == "compiled"
    assert _aot_call(decorators, decorators.Model)[0] == "loaded"  # vLLM's own files, as without adstore
    assert any(k.startswith("vllm.") for k in FAILOPEN), FAILOPEN


def test_directories_outside_vllms_layout_are_left_alone(tmp_path):
    root = str(tmp_path / "root")
    assert layout.aot_layout(f"{root}/torch_compile_cache/torch_aot_compile/{AOT_HASH}/rank_1_0/model", root) == (
        layout.Layout(
            AOT_HASH,
            "rank_1_0",
            Path(root, "torch_compile_cache/torch_aot_compile", AOT_HASH, "rank_1_0"),
            Path(root, "torch_compile_cache/torch_aot_compile", AOT_HASH, "inductor_cache"),
        )
    )
    assert layout.aot_layout(f"/elsewhere/torch_aot_compile/{AOT_HASH}/rank_1_0/model", root) is None
    assert layout.aot_layout(f"{root}/torch_compile_cache/torch_aot_compile/../x/rank_1_0/model", root) is None
    good = f"{root}/torch_compile_cache/0123456789/rank_0_0/backbone"
    assert layout.piecewise_layout(good, "backbone", root).vllm_hash == "0123456789"
    assert layout.piecewise_layout(f"{root}/torch_compile_cache/0123456789/rank_0_0/", "", root).rank == "rank_0_0"
    assert layout.piecewise_layout("/user/chosen/dir/rank_0_0/backbone", "backbone", root) is None


#: A gid the group database does not know (container runtimes run users under such gids): not a private group.
UNKNOWN_GID = 48_813


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give vLLM's directories a gid of no group")
def test_vllms_directories_made_under_umask_002_are_tightened_not_refused(vllm, store, tmp_path):
    """vLLM made its cache directories 0775 under a primary group not known to be private: a tree is still served.

    The rule for code tightens the directory a file goes to or comes from;
    the ones above it (vLLM's too) and inside a tree used to refuse the
    tree (``unsafe_root``), on every start.
    """
    import grp

    decorators, _ = vllm
    with pytest.raises(KeyError):
        grp.getgrgid(UNKNOWN_GID)
    root = Path(os.environ["VLLM_CACHE_ROOT"])
    hash_dir = root / "torch_compile_cache" / "torch_aot_compile" / AOT_HASH

    def made_by_vllm(inductor_wrote: bool) -> None:
        (hash_dir / "inductor_cache").mkdir(parents=True)  # vLLM makes it (empty) before it looks
        if inductor_wrote:
            (hash_dir / "inductor_cache" / "fxgraph" / "q5").mkdir(parents=True)
            (hash_dir / "inductor_cache" / "fxgraph" / "q5" / "entry").write_bytes(b"inductor's")
        for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            os.chown(d, -1, UNKNOWN_GID)
            d.chmod(0o775)

    assert hooks.install(store)
    made_by_vllm(inductor_wrote=True)
    before = FAILOPEN["vllm.unsafe_root"]
    assert _aot_call(decorators, decorators.Model)[0] == "compiled"
    _wipe(tmp_path)
    made_by_vllm(inductor_wrote=False)
    how, _ = _aot_call(decorators, decorators.Model)
    assert how == "loaded" and FAILOPEN["vllm.unsafe_root"] == before
    assert (hash_dir / "inductor_cache" / "fxgraph" / "q5" / "entry").read_bytes() == b"inductor's"  # restored
    assert all(d.stat().st_mode & 0o022 == 0 for d in (root, hash_dir.parent, hash_dir))
