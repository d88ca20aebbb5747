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
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
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


def _as_nobody(fn, *, must_succeed: bool = True) -> bool:
    """Run ``fn()`` in a forked child as uid/gid 65534 (another user with group write access); whether it did."""
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
    done = os.waitstatus_to_exitcode(status) == 0
    assert done or not must_succeed
    return done


def _evil_package_of(package: bytes, tmp_path: Path, sentinel: Path) -> bytes:
    """``package`` with its shared object swapped for one whose constructor creates ``sentinel``."""
    src = tmp_path / "evil.c"
    src.write_text(_EVIL_C)
    so = tmp_path / "evil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DSENTINEL="{sentinel}"', "-o", str(so), str(src)], check=True)
    evil = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(package)) as zin, zipfile.ZipFile(evil, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = so.read_bytes() if info.filename.endswith(".so") else zin.read(info)
            zout.writestr(info, data)
    return evil.getvalue()


def _share_with_nobody(root: Path) -> None:
    """Make ``root`` a store shared with group 65534, as a group-shared store is: 2775 directories, the
    index group-writable, blob and record files read-only (0444) as the store writes them."""
    os.chown(root, 0, 65534)
    os.chmod(root, 0o2775)
    for path in root.rglob("*"):
        os.chown(path, -1, 65534)
        if path.is_dir() or not {"blobs", "records"} & set(path.relative_to(root).parts):
            os.chmod(path, os.stat(path).st_mode | (0o2070 if path.is_dir() else 0o060))


_NEEDS_ROOT_AND_GCC = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("gcc") is None, reason="needs root (a second uid) and gcc"
)


@pytest.fixture(scope="module")
def honest_engine(tmp_path_factory):
    """The victim's own engine, compiled once: a store holding it (a template to copy), its hash, meta, package."""
    template = tmp_path_factory.mktemp("honest") / "store"
    with Store.open(template) as store:
        cache = EngineCache(StoreEngineStorage(store))
        h = cache.compile(Tiny(), (torch.randn(2, 8),)).hash
        res = store.lookup(h, count=False)
        meta = json.loads(store.read_artifact(res.manifest, "engine.json"))
        package = store.read_artifact(res.manifest, "engine.pt2")  # the content (its file may be a zstd frame)
        cache.close()
    return template, h, meta, package


@pytest.fixture
def shared_store(honest_engine):
    """A copy of the honest store, shared with the attacker's group (pytest's tmp is 0700: not shareable)."""
    shared = Path(tempfile.mkdtemp(prefix="adstore-engine-", dir="/tmp"))
    os.chmod(shared, 0o755)
    root = shared / "store"
    shutil.copytree(honest_engine[0], root, symlinks=True)
    _share_with_nobody(root)
    yield root
    shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.slow
@_NEEDS_ROOT_AND_GCC
def test_engine_package_from_another_user_is_not_loaded(honest_engine, shared_store, tmp_path, sentinel):
    root, (_, h, meta, package) = shared_store, honest_engine
    evil_pkg = _evil_package_of(package, tmp_path, sentinel)
    meta = {**meta, "payload": {**meta["payload"], "sha256": hashlib.sha256(evil_pkg).hexdigest()}}
    meta["payload"]["size"] = len(evil_pkg)

    def attack() -> None:  # as a file the attacker owns (a small package would be stored inline)
        with Store.open(root, inline_threshold=1024) as s:
            _publish_engine(s, h, meta, evil_pkg)

    _as_nobody(attack)
    model, x = Tiny(), torch.randn(2, 8)
    with Store.open(root) as store:
        victim = EngineCache(StoreEngineStorage(store))
        engine, event = victim.lookup(model, (x,))
        victim.close()
    assert not sentinel.exists(), f"the engine package's code ran in the victim's process ({event})"
    # The attacker's record does not seal the rows (it is not a trusted user's) ...
    assert engine is None and event.kind == "miss" and event.reason == "engine_unavailable", event
    assert "unsealed_entry" in str(event), event
    # ... and were the rows believed, the package file's owner is refused all the same.
    with Store.open(root) as store, _rows_believed():
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


# ----------------------------------------------------------------------------- races on the way to the loader
# In a group-shared store ``blobs/xx/`` and ``tmp/`` are group-writable without the sticky bit, so a member
# can rename files there while the victim checks and loads.  The victim below runs in a fresh (spawned)
# interpreter with the attacker's move hooked in at a step boundary of the real code (after the package is
# copied out of the store; after the writer check), so each race is won every time, no timing loop.


def _symlink_over(blob: str) -> None:
    """As the attacker: replace the attacker's own blob file with a link to a root-owned file."""
    link = f"{blob}.link"
    os.symlink("/etc/passwd", link)
    os.rename(link, blob)


def _replace_copy(copy: str, evil: str) -> None:
    """As the attacker: put the evil package where the victim's checked copy is, by a rename."""
    planted = os.path.join(os.path.dirname(copy), "planted.pt2")
    shutil.copyfile(evil, planted)
    os.rename(planted, copy)


@contextmanager
def _rows_believed() -> Iterator[None]:
    """Lookups without the seal (``trusted=None``): the defence behind it, the package owner's check, alone."""
    lookup = Store.lookup
    Store.lookup = lambda self, key, **kw: lookup(self, key, **{**kw, "trusted": None})  # type: ignore[method-assign]
    try:
        yield
    finally:
        Store.lookup = lookup  # type: ignore[method-assign]


def _racing_victim(root: str, race: str, evil: str) -> str:
    """The victim looks its engine up while the attacker runs ``race`` (run in a spawned process).

    In ``symlink_after_copy`` the attacker's own entry is looked up with its rows believed (the seal
    refuses it first: see the test above), so the race meets the package owner's check.
    """
    if race == "symlink_after_copy":
        load_record = StoreEngineStorage.load_record

        def copied_then_raced(self, hash):
            record = load_record(self, hash)  # the package is copied out of the store now
            blob = str(self.store.blob_path(record.meta["payload"]["sha256"]))
            _as_nobody(lambda: _symlink_over(blob))
            return record

        StoreEngineStorage.load_record = copied_then_raced
    else:
        check_loadable = StoreEngineStorage.check_loadable

        def checked_then_raced(self, record):
            check_loadable(self, record)  # the writer check passed: the honest engine
            copy = str(record.payload_path)
            _as_nobody(lambda: _replace_copy(copy, evil), must_succeed=False)
            return None

        StoreEngineStorage.check_loadable = checked_then_raced
    believed = _rows_believed() if race == "symlink_after_copy" else nullcontext()
    with believed, Store.open(root) as store:
        victim = EngineCache(StoreEngineStorage(store))
        engine, event = victim.lookup(Tiny(), (torch.randn(2, 8),))
        victim.close()
    return f"{event.kind} {event.reason or ''}: {event.detail or ''}"


@pytest.mark.slow
@_NEEDS_ROOT_AND_GCC
@pytest.mark.parametrize("race", ["symlink_after_copy", "copy_swapped_before_load"])
def test_a_racing_group_member_never_gets_a_package_loaded(honest_engine, shared_store, tmp_path, sentinel, race):
    """(a) the attacker's blob becomes a link to a root-owned file once its copy is taken: the owner check
    must judge the file the copy was read from; (b) the honest engine's checked copy is replaced before it is
    loaded: the copy must sit where no other user can rename anything in."""
    root, (_, h, meta, package) = shared_store, honest_engine
    evil_pkg = _evil_package_of(package, tmp_path, sentinel)
    evil = root.parent / "evil.pt2"  # where the attacker keeps it
    evil.write_bytes(evil_pkg)
    os.chmod(evil, 0o644)
    if race == "symlink_after_copy":  # the attacker's package under the victim's hash, in a file it owns
        meta = {**meta, "payload": {**meta["payload"], "sha256": hashlib.sha256(evil_pkg).hexdigest()}}
        meta["payload"]["size"] = len(evil_pkg)

        def publish() -> None:
            with Store.open(root, inline_threshold=1024) as s:
                _publish_engine(s, h, meta, evil_pkg)

        _as_nobody(publish)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        outcome = pool.apply(_racing_victim, (str(root), race, str(evil)))
    assert not sentinel.exists(), f"the attacker's package ran in the victim's process ({outcome})"
    if race == "symlink_after_copy":
        assert outcome.startswith("miss untrusted_engine"), outcome
    else:  # the honest engine, loaded from the copy that was checked
        assert outcome.startswith("hit"), outcome


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a second uid)")
def test_inductor_files_a_racing_member_wrote_are_never_read(tmp_path, monkeypatch):
    """The ``torch_compile`` stage's files (kernels, pickles) under the writer rule: the attacker's blob is a
    link to a root-owned file while the victim judges its writer, and the attacker's file again around that.
    Judged on the descriptor the bytes are read from, it is refused; judged on the path, it was read."""
    from adstore.integration.engine import inductor
    from adstore.integration.engine.index import StageEntries
    from adstore.integration.errors import EngineUnavailable, UntrustedEngine
    from adstore.integration.validity.keys import CacheKey

    shared = Path(tempfile.mkdtemp(prefix="adstore-inductor-", dir="/tmp"))
    os.chmod(shared, 0o755)
    try:
        root = shared / "store"
        root.mkdir()
        _share_with_nobody(root)
        Store.open(root).close()
        _share_with_nobody(root)
        key, files = CacheKey("c" * 64, {"stage": "torch_compile"}), b"\x7fELF attacker's kernels" * 10_000

        def publish() -> None:
            with Store.open(root) as s:
                StageEntries(s, inductor.NAMESPACE, inductor.ARTIFACT).save(key, files, {})

        _as_nobody(publish)
        with Store.open(root) as store:
            blob = str(store.blob_path(hashlib.sha256(files).hexdigest()))
            judge = StoreEngineStorage.check_writer

            def raced(self, *args):
                _as_nobody(lambda: (os.rename(blob, f"{blob}.real"), os.symlink("/etc/passwd", blob)))
                try:
                    return judge(self, *args)
                finally:
                    _as_nobody(lambda: os.replace(f"{blob}.real", blob))

            monkeypatch.setattr(StoreEngineStorage, "check_writer", raced)
            entries = inductor._entries(store)  # the bundle branch of inductor.restore
            with pytest.raises(EngineUnavailable, match="unsealed_entry"):  # its record is not a trusted user's
                entries.manifest(key)
            with pytest.raises(UntrustedEngine, match="uid 65534"):  # and its blob, were the rows believed
                entries.read(key, store.lookup(key.key).manifest, judge=StoreEngineStorage(store).check_writer)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
