"""vLLM's model-class facts (``modelinfos``) through the store, against the stand-in registry of ``conftest.py``.

vLLM 0.32.0 inspects a model class in a subprocess (seconds) unless
``<VLLM_CACHE_ROOT>/modelinfos/<module>-<Class>.json`` holds the facts for
the model source's hash.  The hooks restore that file from the store before
vLLM looks and capture it after vLLM writes it; these tests count the
inspections the stand-in would have run in a subprocess.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

from adstore.integration import onimport
from adstore.integration.inductor.entries import FAILOPEN
from adstore.integration.vllm import hooks, modelinfos, trees
from adstore.store import Store
from adstore.store.remote import Signer, TrustedKeys, generate_keypair, open_remote

LLAMA = ("vllm.model_executor.models.llama", "LlamaForCausalLM")
FILE = "vllm-model_executor-models-llama-LlamaForCausalLM.json"
HASH = "9f" * 32


def _registry():
    return importlib.import_module("vllm.model_executor.models.registry")


def _leftovers(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if ".adstore-" in p.name] if root.is_dir() else []


def test_a_host_without_the_file_reads_the_facts_from_the_store(fake_vllm, store):
    assert hooks.install(store)
    registry = _registry()  # vLLM imports it after the plugin ran: the hooks wait for that
    model = registry._LazyRegisteredModel(*LLAMA)
    first = model.inspect_model_cls(HASH)
    assert registry.INSPECTED == ["LlamaForCausalLM"]
    shutil.rmtree(fake_vllm)  # vLLM's cache directory is gone, the store is not
    assert model.inspect_model_cls(HASH) == first
    assert registry.INSPECTED == ["LlamaForCausalLM"], "the class was inspected again"
    saved = json.loads((fake_vllm / "modelinfos" / FILE).read_text())
    assert saved["hash"] == HASH and saved["modelinfo"] == {"is_text_generation_model": True, "supports_pp": True}
    assert not _leftovers(fake_vllm)
    store.flush()
    counters = store.stats().counters
    assert counters.get("vllm.trees_captured") == 1 and counters.get("vllm.trees_restored") == 1


def test_a_new_host_gets_the_facts_through_a_remote(fake_vllm, tmp_path):
    pair = generate_keypair()
    url = f"memory://modelinfo-{uuid.uuid4().hex[:8]}"

    def remote():
        return open_remote(
            url,
            mode="read-write",
            signer=Signer.from_pem(pair.private_pem),
            trusted=TrustedKeys.from_pem(pair.public_pem),
        )

    with Store.open(tmp_path / "a", remote=remote()) as a:
        assert hooks.install(a)
        _registry()._LazyRegisteredModel(*LLAMA).inspect_model_cls(HASH)
        hooks.uninstall()
    shutil.rmtree(fake_vllm)
    with Store.open(tmp_path / "b", remote=remote()) as b:
        assert hooks.install(b)
        _registry()._LazyRegisteredModel(*LLAMA).inspect_model_cls(HASH)
        hooks.uninstall()
    assert _registry().INSPECTED == ["LlamaForCausalLM"]


def test_a_changed_model_source_is_a_miss_and_each_class_has_its_own_entry(fake_vllm, store):
    assert hooks.install(store)
    registry = _registry()
    llama, other = registry._LazyRegisteredModel(*LLAMA), registry._LazyRegisteredModel(LLAMA[0], "Other_Class")
    llama.inspect_model_cls(HASH)
    other.inspect_model_cls(HASH)
    shutil.rmtree(fake_vllm)
    llama.inspect_model_cls("0e" * 32)  # the model's source changed: another hash
    other.inspect_model_cls(HASH)  # restored beside the file written just before: per class, not per directory
    assert registry.INSPECTED == ["LlamaForCausalLM", "Other_Class", "LlamaForCausalLM"]


def test_vllms_own_file_is_never_replaced(fake_vllm, store):
    assert hooks.install(store)
    registry = _registry()
    model = registry._LazyRegisteredModel(*LLAMA)
    model.inspect_model_cls(HASH)
    stale = json.dumps({"hash": "11" * 32, "modelinfo": {"is_text_generation_model": False, "supports_pp": False}})
    (fake_vllm / "modelinfos" / FILE).write_text(stale)  # vLLM's, for another source: vLLM decides
    model.inspect_model_cls(HASH)
    assert registry.INSPECTED == ["LlamaForCausalLM", "LlamaForCausalLM"]
    assert json.loads((fake_vllm / "modelinfos" / FILE).read_text())["hash"] == HASH  # vLLM rewrote it


def test_a_tree_with_another_file_is_refused(fake_vllm, store, tmp_path):
    anchors = {"cache_root": str(fake_vllm)}
    source = tmp_path / "src"
    source.mkdir()
    (source / "evil.json").write_text(json.dumps({"hash": HASH, "modelinfo": {}}))
    part = modelinfos.part_of(FILE)
    captured = trees.capture(
        store, kind=modelinfos.KIND, vllm_hash=HASH, rank=modelinfos.RANK, part=part, source=source, anchors=anchors
    )
    assert captured.captured
    before = FAILOPEN["vllm.corrupt_tree"]
    got = modelinfos.restore(
        store, directory=fake_vllm / "modelinfos", filename=FILE, module_hash=HASH, anchors=anchors
    )
    assert not got.ok and got.reason == "corrupt_tree", got
    assert FAILOPEN["vllm.corrupt_tree"] == before + 1
    assert not (fake_vllm / "modelinfos" / FILE).exists() and not _leftovers(fake_vllm)


def test_a_file_vllm_did_not_save_for_this_hash_is_not_captured(fake_vllm, store):
    directory = fake_vllm / "modelinfos"
    directory.mkdir(parents=True)
    (directory / FILE).write_text(json.dumps({"hash": "22" * 32, "modelinfo": {}}))
    got = modelinfos.capture(store, directory=directory, filename=FILE, module_hash=HASH, anchors={})
    assert not got.ok and got.reason == "not_saved"
    assert modelinfos.capture(store, directory=directory, filename="../x.json", module_hash=HASH, anchors={}).reason


def test_a_broken_store_never_reaches_vllm(fake_vllm, store):
    assert hooks.install(store)
    store.close()
    registry = _registry()
    model = registry._LazyRegisteredModel(*LLAMA)
    assert model.inspect_model_cls(HASH).supports_pp is True
    shutil.rmtree(fake_vllm)
    assert model.inspect_model_cls(HASH).supports_pp is True
    assert registry.INSPECTED == ["LlamaForCausalLM", "LlamaForCausalLM"]


def test_a_registry_without_a_hooked_function_keeps_the_other_hook(fake_vllm, store):
    registry = _registry()
    del registry._LazyRegisteredModel._save_modelinfo_to_cache  # another vLLM
    before = FAILOPEN["vllm.incompatible_vllm"]
    assert hooks.install(store)
    assert FAILOPEN["vllm.incompatible_vllm"] == before + 1
    wrapped = registry._LazyRegisteredModel.__dict__["_load_modelinfo_from_cache"]
    assert getattr(wrapped, "__adstore_original__", None) is not None


@pytest.mark.parametrize("module", ["vllm.compilation.backends", "vllm.compilation.decorators"])
def test_install_imports_no_module_it_hooks(fake_vllm, store, module):
    import sys

    importlib.import_module("vllm")
    assert hooks.install(store)
    assert module not in sys.modules and module in onimport.watched()
    imported = importlib.import_module(module)  # as vLLM's worker does, later
    owner = imported if module.endswith("decorators") else imported.CompilerManager
    name = "_try_load_aot_compiled_fn" if module.endswith("decorators") else "initialize_cache"
    assert getattr(getattr(owner, name), "__adstore_original__", None) is not None
    hooks.uninstall()
    assert onimport.watched() == [] and getattr(getattr(owner, name), "__adstore_original__", None) is None
    assert os.environ["VLLM_CACHE_ROOT"] == str(fake_vllm)
