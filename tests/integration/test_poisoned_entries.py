"""Poisoned *entries* in a real store, read through the real cache paths.

``test_snapshot_safety.py`` proves the snapshot codec rejects hostile
payloads handed to ``load_module``.  Here the hostile bytes arrive the way an
attacker with write access to a shared store would deliver them: published
and committed under the exact key a victim's pipeline (or engine lookup)
computes, or written straight into LMDB rows.  The victim then runs the real
``InferenceOptimizer`` / ``EngineCache.lookup``.  For every poison:

* nothing it names runs — a sentinel file that each payload would create
  must not exist afterwards;
* the cache reports a miss with a reason (never a crash, never a hit);
* the pipeline's result is still correct (the full pipeline ran and its
  output matches eager), and its save replaces the poisoned entry.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import pickle
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from adstore.integration.reference.checkpoint import read_checkpoint, write_random_checkpoint
from adstore.integration.engine.storage import StoreEngineStorage
from adstore.integration.engine.cache import EngineCache
from adstore.integration.reference.models import ModelFactory
from adstore.integration.pipeline.optimizer import InferenceOptimizer
from adstore.integration.reference.pipeline import default_transforms
from adstore.integration.snapshot import FORMAT, VERSION
from adstore.store import Store
from adstore.store.records import manifest_key

MODEL = {"arch": "llama", "layers": 1, "hidden": 32}
REJECT = {"untrusted_target", "corrupt_snapshot", "unsupported_hook"}


@pytest.fixture
def sentinel(tmp_path):
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "a poisoned entry executed code"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A store holding one good pipeline entry; returns what a victim needs to re-run it."""
    tmp = tmp_path_factory.mktemp("poison")
    factory = ModelFactory.from_config(MODEL)
    ckpt = write_random_checkpoint(factory.build(), tmp / "ckpt", seed=3)
    root = tmp / "store"
    transforms = default_transforms(pipeline_cache={"root": str(root)})
    opt = InferenceOptimizer(factory, ckpt, transforms)
    module = opt()
    assert [e.kind for e in opt.events] == ["miss", "save"]
    key = opt.events[-1].key
    with Store.open(root) as store:
        res = store.lookup(key, record=False)
        good = {name: store.read_artifact(res.manifest, name) for name in res.manifest.artifacts}
    with torch.no_grad():
        ref = factory.eager_model(read_checkpoint(ckpt))(*factory.example_inputs()).logits
        out = module(*factory.example_inputs())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    return {"factory": factory, "ckpt": ckpt, "root": root, "transforms": transforms, "key": key,
            "good": good, "ref": ref}


def _publish(root, key: str, artifacts: dict[str, bytes], *, namespace: str = "pipeline", world_size: int = 1):
    """What an attacker with group write access does: a normal, committed save under the victim's key."""
    with Store.open(root) as store:
        gen = store.new_generation()
        refs = {name: store.put_bytes(data) for name, data in artifacts.items()}
        store.publish(key, generation=gen, artifacts=refs, namespace=namespace, world_size=world_size)
        store.commit(key, generation=gen)
        assert store.lookup(key, record=False).hit  # the store itself serves it: only the cache can refuse
        return gen


def _victim_run(p):
    opt = InferenceOptimizer(p["factory"], p["ckpt"], p["transforms"])
    module = opt()
    with torch.no_grad():
        out = module(*p["factory"].example_inputs())
    torch.testing.assert_close(out, p["ref"], rtol=1e-5, atol=1e-5)
    return [(e.kind, e.reason) for e in opt.events], opt


class _Reduce:
    def __init__(self, fn, args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _module_pt_variants(good: bytes, sentinel) -> dict[str, bytes]:
    cmd = f"touch {sentinel}"
    raw_os_system = b"cos\nsystem\n(V" + cmd.encode() + b"\ntR."
    raw_exec = b"cbuiltins\nexec\n(Vopen(" + repr(str(sentinel)).encode() + b", 'w').close()\ntR."
    popen = pickle.dumps(_Reduce(subprocess.Popen, (["touch", str(sentinel)],)), protocol=2)
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, "structure": "{}",
                "tensors": [], "evil": _Reduce(__import__("os").system, (cmd,))}, buf)
    zipped_object = buf.getvalue()
    payload = torch.load(io.BytesIO(good), weights_only=True)
    structure = json.loads(payload["structure"])
    graph = _find_graph(structure)
    graph["targets"][0] = "os.system"
    graph["nodes"].insert(1, ["pwn", "call_function", 0, ["t", cmd], ["d"], None, {}])
    buf = io.BytesIO()
    torch.save({**payload, "structure": json.dumps(structure)}, buf)
    target_os_system = buf.getvalue()
    graph["targets"][0] = "torch.utils.collect_env.run"  # public torch, runs a shell command
    buf = io.BytesIO()
    torch.save({**payload, "structure": json.dumps(structure)}, buf)
    target_torch_shell = buf.getvalue()
    return {"graph_target_torch_shell": target_torch_shell, "raw_pickle_os_system": raw_os_system, "raw_pickle_builtins_exec": raw_exec,
            "pickle_subprocess_popen": popen, "torch_save_with_pickled_object": zipped_object,
            "graph_target_os_system": target_os_system, "empty": b"", "garbage": b"\x00" * 1000}


def _find_graph(node):
    """The first encoded graph (a dict with a ``targets`` list and ``nodes``) in a snapshot structure."""
    if isinstance(node, dict):
        if isinstance(node.get("targets"), list) and isinstance(node.get("nodes"), list) and node["targets"]:
            return node
        for v in node.values():
            found = _find_graph(v)
            if found is not None:
                return found
    elif isinstance(node, list):
        for v in node:
            found = _find_graph(v)
            if found is not None:
                return found
    return None


MODULE_POISONS = ["raw_pickle_os_system", "raw_pickle_builtins_exec", "pickle_subprocess_popen",
                  "torch_save_with_pickled_object", "graph_target_os_system", "graph_target_torch_shell",
                  "empty", "garbage"]


_DEFAULT_MODULE = {"raw_pickle_os_system", "torch_save_with_pickled_object", "graph_target_os_system",
                   "graph_target_torch_shell"}


@pytest.mark.parametrize("poison", [p if p in _DEFAULT_MODULE else pytest.param(p, marks=pytest.mark.slow)
                                    for p in MODULE_POISONS])
def test_poisoned_snapshot_entry_is_a_miss_and_is_replaced(pipeline, sentinel, poison):
    evil = _module_pt_variants(pipeline["good"]["module.pt"], sentinel)[poison]
    _publish(pipeline["root"], pipeline["key"], {**pipeline["good"], "module.pt": evil})
    events, _ = _victim_run(pipeline)
    assert events[0][0] == "miss" and events[0][1] in REJECT, events
    assert events[1] == ("save", None), events  # the victim's save replaced the poisoned entry
    assert not sentinel.exists()
    events, _ = _victim_run(pipeline)
    assert events == [("hit", None)]


HOOK_POISONS = {
    "function_os_system": {"kind": "function", "qualname": "os.system"},
    "partial_builtins_exec": {"kind": "partial", "target": {"kind": "function", "qualname": "builtins.exec"},
                              "keywords": {}},
    "instance_subprocess_popen": {"kind": "instance", "owner_class": "subprocess.Popen",
                                  "owner_state": {"args": "touch x"}},
}


@pytest.mark.parametrize("poison", [p if p == "function_os_system" else pytest.param(p, marks=pytest.mark.slow)
                                    for p in sorted(HOOK_POISONS)])
def test_poisoned_hook_specs_in_an_entry_are_a_miss(pipeline, sentinel, poison):
    params = json.loads(json.dumps(HOOK_POISONS[poison]).replace("touch x", f"touch {sentinel}"))
    hooks = json.dumps([{"type": "importable", "scope": "", "phase": "pre", "with_module": False,
                         "params": params}]).encode()
    _publish(pipeline["root"], pipeline["key"], {**pipeline["good"], "hooks.json": hooks})
    events, _ = _victim_run(pipeline)
    assert events[0][0] == "miss" and events[0][1] in REJECT, events
    assert _victim_run(pipeline)[0] == [("hit", None)]


@pytest.mark.slow
def test_entry_missing_an_artifact_or_with_extra_ones_is_a_miss(pipeline, sentinel):
    _publish(pipeline["root"], pipeline["key"], {"hooks.json": pipeline["good"]["hooks.json"]})
    events, _ = _victim_run(pipeline)
    assert events[0][0] == "miss" and events[0][1] in REJECT, events
    assert _victim_run(pipeline)[0] == [("hit", None)]


def _rewrite_manifest(root, key: str, fn) -> None:
    """Edit the committed manifest row(s) of ``key`` in LMDB directly (no API checks)."""
    with Store.open(root) as store:
        res = store.lookup(key, record=False)
        assert res.hit
        env, db = store.index.env, store.index.db["manifests"]
        for rank, m in res.manifests.items():
            mk = manifest_key(key, rank, m.generation)
            with env.begin(write=True) as txn:
                obj = json.loads(bytes(txn.get(mk, db=db)))
                fn(obj)
                txn.put(mk, json.dumps(obj).encode(), db=db)


TRAVERSALS = ["../../../../../../etc/passwd", "/etc/shadow", "..", "A" * 64, "0" * 63 + "/", "00" * 32 + "/../x"]


@pytest.mark.parametrize("digest", [d if i < 2 else pytest.param(d, marks=pytest.mark.slow)
                                    for i, d in enumerate(TRAVERSALS)])
def test_path_traversal_digests_in_lmdb_rows_are_misses(pipeline, sentinel, digest, tmp_path):
    # The artifact's digest in the manifest row is rewritten to a path.
    def poison(obj):
        obj["a"]["module.pt"][0] = digest

    _rewrite_manifest(pipeline["root"], pipeline["key"], poison)
    with Store.open(pipeline["root"]) as store:
        res = store.lookup(pipeline["key"], record=False)
        assert not res.hit and res.reason == "corrupt_index", res
    events, opt = _victim_run(pipeline)
    assert events[0] == ("miss", "corrupt_index"), events
    assert not sentinel.exists()
    # The run that missed saved over the damaged row; verify --fix recounts
    # the references the damaged row held, and the next run hits.
    assert events[-1] == ("save", None), events
    with Store.open(pipeline["root"], grace_period=0.0) as store:
        assert store.verify(fix=True).ok
        store.plan_sweep().execute()
        assert store.verify().ok
    assert _victim_run(pipeline)[0] == [("hit", None)]


def test_a_damaged_entry_is_replaced_by_the_next_save(pipeline, sentinel):
    def poison(obj):
        obj["a"]["module.pt"][0] = "../../../../etc/passwd"

    _rewrite_manifest(pipeline["root"], pipeline["key"], poison)
    events, opt = _victim_run(pipeline)
    try:
        assert events[0] == ("miss", "corrupt_index"), events
        assert events[1] == ("save", None), [(e.kind, e.reason, e.detail) for e in opt.events]
        assert _victim_run(pipeline)[0] == [("hit", None)]
    finally:  # leave a healthy store for the other tests of this module
        with Store.open(pipeline["root"], grace_period=0.0) as store:
            store.verify(fix=True)
            store.plan_sweep().execute()


def test_traversal_digest_in_a_blob_row_key_is_never_a_path(pipeline, tmp_path):
    """A ``blobs`` row whose key is not 32 bytes (the digest cannot be a path) — verify drops it."""
    with Store.open(pipeline["root"]) as store:
        env = store.index.env
        with env.begin(write=True) as txn:
            txn.put(b"../../../../etc/passwd", b"\0" * 29, db=store.index.db["blobs"])
        try:
            rep = store.verify()
            assert not rep.ok
            assert store.verify(fix=True).ok and store.verify().ok
        finally:
            with env.begin(write=True) as txn:
                txn.delete(b"../../../../etc/passwd", db=store.index.db["blobs"])


# ----------------------------------------------------------------------------- engine entries

class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


def _trusting_lookup(root: str) -> str:
    """A victim that trusts uid 65534 looks the engine up (run in a spawned process)."""
    with Store.open(root) as store:
        trusting = EngineCache(StoreEngineStorage(store, trusted_uids=[65534]))
        _engine, event = trusting.lookup(Tiny(), (torch.randn(2, 8),))
        trusting.close()
    return f"{event.kind} {event.reason or ''}: {event.detail or ''}"


@pytest.fixture(scope="module")
def engine_req(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine") / "store"
    store = Store.open(root)
    cache = EngineCache(StoreEngineStorage(store))
    model, x = Tiny(), torch.randn(2, 8)
    engine, event = cache.lookup(model, (x,))
    assert engine is None and event.reason == "absent"
    yield {"store": store, "cache": cache, "model": model, "x": x, "hash": event.key}
    cache.close()
    store.close()


def _engine_meta(h: str, sentinel, **over) -> dict:
    meta = {"format_version": 1, "hash": h, "kind": "aoti_package",
            "payload": {"sha256": "0" * 64, "size": 0, "weights_included": False},
            "toolchain": {"cc": f"os.system('touch {sentinel}')"}, "settings": {"__import__": "os"},
            "constants": [], "call_spec": ["builtins.exec"], "runner_metadata": {"loader": "subprocess.Popen"}}
    meta.update(over)
    return meta


def _publish_engine(store: Store, h: str, meta: dict | bytes, package: bytes, *, namespace: str = "engine") -> None:
    meta_bytes = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    gen = store.new_generation()
    refs = {"engine.json": store.put_bytes(meta_bytes), "engine.pt2": store.put_bytes(package)}
    store.publish(h, generation=gen, artifacts=refs, namespace=namespace)
    store.commit(h, generation=gen)


def _evil_package(sentinel) -> bytes:
    return f"#!/bin/sh\ntouch {sentinel}\n".encode() + pickle.dumps(_Reduce(__import__("os").system,
                                                                          (f"touch {sentinel}",)))


def _engine_variants(h: str, sentinel) -> dict[str, tuple[dict | bytes, bytes, str]]:
    pkg = _evil_package(sentinel)
    import hashlib

    consistent = {"sha256": hashlib.sha256(pkg).hexdigest(), "size": len(pkg), "weights_included": False}
    return {
        "kind_names_os_system": (_engine_meta(h, sentinel, kind="os.system", payload=consistent), pkg, "engine"),
        "consistent_meta_foreign_toolchain": (_engine_meta(h, sentinel, payload=consistent), pkg, "engine"),
        "payload_checksum_mismatch": (_engine_meta(h, sentinel), pkg, "engine"),
        "meta_is_a_pickle": (pickle.dumps(_Reduce(__import__("os").system, (f"touch {sentinel}",))), pkg, "engine"),
        "meta_for_another_hash": (_engine_meta("f" * 64, sentinel, payload=consistent), pkg, "engine"),
        "wrong_namespace": (_engine_meta(h, sentinel, payload=consistent), pkg, "pipeline"),
    }


ENGINE_POISONS = ["kind_names_os_system", "consistent_meta_foreign_toolchain", "payload_checksum_mismatch",
                  "meta_is_a_pickle", "meta_for_another_hash", "wrong_namespace"]


@pytest.mark.parametrize("poison", ENGINE_POISONS)
def test_poisoned_engine_entry_is_a_miss_before_anything_is_loaded(engine_req, sentinel, poison):
    r = engine_req
    meta, pkg, ns = _engine_variants(r["hash"], sentinel)[poison]
    _publish_engine(r["store"], r["hash"], meta, pkg, namespace=ns)
    r["cache"].clear_memory()
    engine, event = r["cache"].lookup(r["model"], (r["x"],))
    assert engine is None and event.kind == "miss", event
    assert event.reason in {"engine_mismatch", "corrupt_engine", "engine_unavailable"}, event
    assert not sentinel.exists()
    # No temp copy of the poisoned package is left in the store's tmp/.
    assert not [p for p in (r["store"].root / "tmp").iterdir() if p.suffix == ".pt2"]


def test_engine_manifest_with_traversal_digest_is_a_miss(engine_req, sentinel):
    r = engine_req
    meta, pkg, _ = _engine_variants(r["hash"], sentinel)["kind_names_os_system"]
    _publish_engine(r["store"], r["hash"], meta, pkg)
    store = r["store"]
    res = store.lookup(r["hash"], record=False)
    mk = manifest_key(r["hash"], 0, res.generation)
    with store.index.env.begin(write=True) as txn:
        obj = json.loads(bytes(txn.get(mk, db=store.index.db["manifests"])))
        obj["a"]["engine.pt2"][0] = "../../../../../tmp/" + sentinel.name
        txn.put(mk, json.dumps(obj).encode(), db=store.index.db["manifests"])
    engine, event = r["cache"].lookup(r["model"], (r["x"],))
    assert engine is None and event.reason == "engine_unavailable", event
    assert store.verify(fix=True).ok and store.verify().ok


def test_a_failed_commit_leaves_no_uncommitted_manifest(pipeline, monkeypatch):
    """The disk fills between publish and commit (ENOSPC injected at the commit call)."""
    from adstore.store import StoreFull

    with Store.open(pipeline["root"]) as store:
        store.plan_remove([pipeline["key"]]).execute()

    def full(self, key, **kw):
        raise StoreFull(str(self.root), "injected: no space left at commit")

    monkeypatch.setattr(Store, "commit", full)
    events, _ = _victim_run(pipeline)
    monkeypatch.undo()
    assert events[-1] == ("bypass", "disk_full"), events
    with Store.open(pipeline["root"]) as store:
        left = store.manifests(pipeline["key"])
        store.plan_sweep()  # (gc would take it only after the grace period)
    try:
        assert left == [], [(m.rank, m.committed) for m in left]
    finally:
        events, _ = _victim_run(pipeline)  # heal: the next run saves for the other tests


# ----------------------------------------------------------------------------- engine packages are native code
# A compiled engine is a shared object: loading it runs its code.  Another member of the store's
# group publishes, under the victim's engine hash, a package whose .so has a constructor and whose
# metadata is the victim's own (every field is derivable from what the group can read).  The
# engine cache must refuse a package file it did not write (README, "Engine cache").

_EVIL_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void adstore_test_pwn(void) {
    FILE *f = fopen(SENTINEL, "w");
    if (f) fclose(f);
}
"""


def _as_nobody(fn) -> None:
    """Run ``fn()`` in a forked child as uid/gid 65534 (another user with group write access)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([65534])
            os.setgid(65534)
            os.setuid(65534)
            os.umask(0o002)
            fn()
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("gcc") is None, reason="needs root (a second uid) and gcc")
def test_engine_package_from_another_user_is_not_loaded(tmp_path, sentinel):
    shared = Path(f"/tmp/adstore-engine-{os.getpid()}-{id(tmp_path)}")  # pytest's tmp is 0700: not shareable
    shared.mkdir(mode=0o755)
    try:
        _engine_attack(shared, tmp_path, sentinel)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _engine_attack(shared: Path, tmp_path: Path, sentinel: Path) -> None:
    root = shared / "store"
    root.mkdir()
    os.chown(root, 0, 65534)
    os.chmod(root, 0o2775)
    model, x = Tiny(), torch.randn(2, 8)
    with Store.open(root) as store:
        cache = EngineCache(StoreEngineStorage(store))
        honest = cache.compile(model, (x,))  # the victim's own engine, compiled once
        h = honest.hash
        res = store.lookup(h, record=False)
        meta = json.loads(store.read_artifact(res.manifest, "engine.json"))
        package = Path(store.blob_path(res.manifest.artifacts["engine.pt2"])).read_bytes()
        cache.close()
    # The attacker swaps the shared object inside the package for one with a constructor.
    src = tmp_path / "evil.c"
    src.write_text(_EVIL_C)
    so = tmp_path / "evil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DSENTINEL="{sentinel}"', "-o", str(so), str(src)], check=True)
    evil = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(package)) as zin, zipfile.ZipFile(evil, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = so.read_bytes() if info.filename.endswith(".so") else zin.read(info)
            zout.writestr(info, data)
    evil_pkg = evil.getvalue()
    meta["payload"] = {**meta["payload"], "sha256": hashlib.sha256(evil_pkg).hexdigest(), "size": len(evil_pkg)}

    def attack() -> None:  # as a file the attacker owns (a small package would be stored inline)
        with Store.open(root, inline_threshold=1024) as s:
            _publish_engine(s, h, meta, evil_pkg)

    for path in root.rglob("*"):  # the store is shared with the attacker's group
        os.chown(path, -1, 65534)
        os.chmod(path, os.stat(path).st_mode | 0o060)
    _as_nobody(attack)
    with Store.open(root) as store:
        victim = EngineCache(StoreEngineStorage(store))
        engine, event = victim.lookup(model, (x,))
        victim.close()
    assert not sentinel.exists(), f"the engine package's code ran in the victim's process ({event})"
    assert engine is None and event.kind == "miss" and event.reason == "untrusted_engine", event
    # Control: the attack is live — a victim who trusts the attacker's uid does load it, and its code runs.
    # In a fresh (spawned) interpreter: a forked one inherits the objects this process dlopen'ed, and
    # glibc may hand back one of those for the extracted file (same device and inode, reused after the
    # first extraction was deleted) without running the constructor; seen on a cold inductor cache.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        outcome = pool.apply(_trusting_lookup, (str(root),))
    assert sentinel.exists(), f"control failed: the crafted package did not run ({outcome}), so the test proves nothing"
    sentinel.unlink()


# ----------------------------------------------------------------------------- the CLI reads entries too

def _cli(root, *args: str) -> subprocess.CompletedProcess:
    import sys

    return subprocess.run([sys.executable, "-m", "adstore.daemon", "--root", str(root), *args],
                          capture_output=True, text=True, timeout=300, check=False)


def test_adstore_inspect_of_a_poisoned_snapshot_runs_nothing(tmp_path, sentinel):
    root = tmp_path / "store"
    hooks = json.dumps([{"type": "importable", "scope": "", "phase": "pre", "with_module": False,
                         "params": {"kind": "function", "qualname": "os.system"}}]).encode()
    evil = b"cos\nsystem\n(Vtouch " + str(sentinel).encode() + b"\ntR."
    _publish(root, "evil", {"module.pt": evil, "hooks.json": hooks})
    out = _cli(root, "inspect", "evil")
    assert out.returncode == 0 and "Traceback" not in out.stderr, (out.returncode, out.stderr)
    assert "os.system" in out.stdout and "outside the allowed prefixes" in out.stdout, out.stdout
    assert not sentinel.exists()


def test_adstore_explain_of_a_poisoned_components_row_is_a_clean_error(tmp_path):
    root = tmp_path / "store"
    _publish(root, "evil", {"module.pt": b"x", "hooks.json": b"[]"})
    with Store.open(root) as store:
        with store.index.env.begin(write=True) as txn:
            txn.put(b"evil", ('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}").encode(),
                    db=store.index.db["components"])
    for args in (("explain", "evil"), ("inspect", "--no-summary", "evil")):
        out = _cli(root, *args)
        assert out.returncode not in (0, 70), (args, out.returncode, out.stderr)  # 9: damaged store
        assert "internal error" not in out.stderr, (args, out.stderr)


# ----------------------------------------------------------------------------- restores under eviction

def test_an_eviction_between_lookup_and_read_does_not_break_a_restore(pipeline, monkeypatch):
    """The daemon (here `adstore rm`, another process) evicts the entry right after the pipeline's
    lookup said hit.  A restore that holds a lease is skipped by eviction; one that does not, loses."""
    from adstore.store.records import BlobRow

    with Store.open(pipeline["root"]) as store:  # the entry was saved an hour ago (past any grace period)
        with store.index.env.begin(write=True) as txn:
            db = store.index.db["blobs"]
            for k, v in list(txn.cursor(db=db)):
                row = BlobRow.decode(bytes(v), bytes(k))
                row.touched -= 3600
                txn.put(bytes(k), row.encode(), db=db)
    real_lookup = Store.lookup
    fired = []

    def lookup_then_evict(self, key, **kw):
        res = real_lookup(self, key, **kw)
        if res.hit and not fired:
            fired.append(_cli(pipeline["root"], "rm", key))
        return res

    monkeypatch.setattr(Store, "lookup", lookup_then_evict)
    events, _ = _victim_run(pipeline)
    monkeypatch.undo()
    assert fired, "the pipeline never looked the entry up"
    try:
        assert events == [("hit", None)], (events, fired[0].returncode, fired[0].stdout[-200:])
    finally:
        if events != [("hit", None)]:
            _victim_run(pipeline)  # the entry was evicted: save it again for the other tests
