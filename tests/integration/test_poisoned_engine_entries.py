"""Poisoned *engine* entries: misses before anything is loaded; a package from another user is refused.

The attacker publishes, under the victim's engine hash, metadata and
packages that name ``os.system``, lie about their checksum or hash, are
pickles, or sit in the wrong namespace; the victim's ``EngineCache.lookup``
misses with a reason and runs nothing (a sentinel file stays absent).  A
compiled engine is native code: a package whose shared object has a
constructor, written by another uid, is not loaded (slow; needs root and
gcc), while a victim who trusts that uid does load it (the control).
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
from poison_support import Reduce, sentinel_fixture  # noqa: F401  (the sentinel fixture)

from adstore.integration.engine.cache import EngineCache
from adstore.integration.engine.storage import StoreEngineStorage
from adstore.store import Store
from adstore.store.index.rows import manifest_key


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
    meta = {
        "format_version": 1,
        "hash": h,
        "kind": "aoti_package",
        "payload": {"sha256": "0" * 64, "size": 0, "weights_included": False},
        "toolchain": {"cc": f"os.system('touch {sentinel}')"},
        "settings": {"__import__": "os"},
        "constants": [],
        "call_spec": ["builtins.exec"],
        "runner_metadata": {"loader": "subprocess.Popen"},
    }
    meta.update(over)
    return meta


def _publish_engine(store: Store, h: str, meta: dict | bytes, package: bytes, *, namespace: str = "engine") -> None:
    meta_bytes = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    gen = store.new_generation()
    refs = {"engine.json": store.put_bytes(meta_bytes), "engine.pt2": store.put_bytes(package)}
    store.publish(h, generation=gen, artifacts=refs, namespace=namespace)
    store.commit(h, generation=gen)


def _evil_package(sentinel) -> bytes:
    return f"#!/bin/sh\ntouch {sentinel}\n".encode() + pickle.dumps(
        Reduce(__import__("os").system, (f"touch {sentinel}",))
    )


def _engine_variants(h: str, sentinel) -> dict[str, tuple[dict | bytes, bytes, str]]:
    pkg = _evil_package(sentinel)
    import hashlib

    consistent = {"sha256": hashlib.sha256(pkg).hexdigest(), "size": len(pkg), "weights_included": False}
    return {
        "kind_names_os_system": (_engine_meta(h, sentinel, kind="os.system", payload=consistent), pkg, "engine"),
        "consistent_meta_foreign_toolchain": (_engine_meta(h, sentinel, payload=consistent), pkg, "engine"),
        "payload_checksum_mismatch": (_engine_meta(h, sentinel), pkg, "engine"),
        "meta_is_a_pickle": (pickle.dumps(Reduce(__import__("os").system, (f"touch {sentinel}",))), pkg, "engine"),
        "meta_for_another_hash": (_engine_meta("f" * 64, sentinel, payload=consistent), pkg, "engine"),
        "wrong_namespace": (_engine_meta(h, sentinel, payload=consistent), pkg, "pipeline"),
    }


ENGINE_POISONS = [
    "kind_names_os_system",
    "consistent_meta_foreign_toolchain",
    "payload_checksum_mismatch",
    "meta_is_a_pickle",
    "meta_for_another_hash",
    "wrong_namespace",
]


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
    res = store.lookup(r["hash"], count=False)
    mk = manifest_key(r["hash"], 0, res.generation)
    with store.index.env.begin(write=True) as txn:
        obj = json.loads(bytes(txn.get(mk, db=store.index.db["manifests"])))
        obj["a"]["engine.pt2"][0] = "../../../../../tmp/" + sentinel.name
        txn.put(mk, json.dumps(obj).encode(), db=store.index.db["manifests"])
    engine, event = r["cache"].lookup(r["model"], (r["x"],))
    assert engine is None and event.reason == "engine_unavailable", event
    assert store.verify(fix=True).ok and store.verify().ok


# ----------------------------------------------------------------------------- engine packages are native code
# A compiled engine is a shared object: loading it runs its code.  Another member of the store's
# group publishes, under the victim's engine hash, a package whose .so has a constructor and whose
# metadata is the victim's own (every field is derivable from what the group can read).  The
# engine cache must refuse a package file it did not write (docs/engine-cache.md, "Trust").

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
        res = store.lookup(h, count=False)
        meta = json.loads(store.read_artifact(res.manifest, "engine.json"))
        package = store.read_artifact(res.manifest, "engine.pt2")  # the content (its file may be a zstd frame)
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
