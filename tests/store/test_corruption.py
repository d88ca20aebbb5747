"""Damage to blob files and LMDB rows, and hostile index values: named misses, never crashes.

Every kind of damage to a file blob (bit flips, truncation, garbage,
missing, symlink, directory) or to an index row (inline data, blob rows,
manifests, entries) makes the damaged entry a miss with a reason, leaves the
other entries untouched, and ``verify --fix`` repairs it (index damage alone
brings the entry back from its on-disk record, invariant 9).  Values that
decode but break a record's invariants (path traversal digests, zero world
sizes, deeply nested JSON), a data.mdb that is not LMDB, and bit rot at
every offset of a blob are caught too; so is several kinds of damage at once
through the CLI.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from store_helpers import check_hit, save

from adstore.store import BlobMissing, ChecksumMismatch, CorruptRow, Store, StoreError
from adstore.store.index.rows import manifest_key


def _populate(store: Store) -> dict[str, int]:
    return {key: save(store, key, sizes=(100, 70_000)) for key in ("a", "b", "c", "d")}


def _flip(path: Path, offset: int) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def _big_path(store: Store, key: str) -> Path:
    path = store.blob_path(store.lookup(key, count=False).manifest.artifacts["a1"])
    assert path is not None
    return path


def _file_damage(kind: str):
    def damage(store: Store, key: str) -> None:
        path = _big_path(store, key)
        if kind == "flip_first":
            _flip(path, 0)
        elif kind == "flip_middle":
            _flip(path, 35_000)
        elif kind == "flip_last":
            _flip(path, 69_999)
        elif kind == "truncate_zero":
            os.chmod(path, 0o644)
            os.truncate(path, 0)
        elif kind == "truncate_half":
            os.chmod(path, 0o644)
            os.truncate(path, 35_000)
        elif kind == "append":
            os.chmod(path, 0o644)
            with open(path, "ab") as f:
                f.write(b"tail")
        elif kind == "same_size_garbage":
            os.chmod(path, 0o644)
            path.write_bytes(os.urandom(70_000))
        elif kind == "missing":
            path.unlink()
        elif kind == "symlink_elsewhere":
            decoy = store.root.parent / "decoy"
            decoy.write_bytes(b"x" * 70_000)
            path.unlink()
            path.symlink_to(decoy)
        elif kind == "directory":
            path.unlink()
            path.mkdir()
        else:
            raise AssertionError(kind)

    return damage


FILE_DAMAGE = [
    "flip_first",
    "flip_middle",
    "flip_last",
    "truncate_zero",
    "truncate_half",
    "append",
    "same_size_garbage",
    "missing",
    "symlink_elsewhere",
    "directory",
]


def _rows(store: Store, dbname: str, fn) -> None:
    with store.index.env.begin(write=True) as txn:
        fn(txn, store.index.db[dbname])


def _lmdb_damage(kind: str):
    def damage(store: Store, key: str) -> None:
        res = store.lookup(key, count=False)
        m = res.manifest
        small = bytes.fromhex(m.artifacts["a0"].digest)
        mk = manifest_key(key, 0, m.generation)
        if kind == "inline_flip":

            def fn(txn, db):
                data = bytearray(txn.get(small, db=db))
                data[10] ^= 1
                txn.put(small, bytes(data), db=db)

            _rows(store, "blobdata", fn)
        elif kind == "inline_missing":
            _rows(store, "blobdata", lambda txn, db: txn.delete(small, db=db))
        elif kind == "blob_row_short":
            _rows(store, "blobs", lambda txn, db: txn.put(small, b"\x01\x02\x03", db=db))
        elif kind == "blob_row_deleted":
            _rows(store, "blobs", lambda txn, db: txn.delete(small, db=db))
        elif kind == "manifest_not_json":
            _rows(store, "manifests", lambda txn, db: txn.put(mk, b"\x80\x03not json", db=db))
        elif kind == "manifest_wrong_fields":
            _rows(store, "manifests", lambda txn, db: txn.put(mk, b'{"ws": "two", "a": 5}', db=db))
        elif kind == "manifest_artifacts_not_pairs":
            _rows(store, "manifests", lambda txn, db: txn.put(mk, b'{"ws": 1, "c": true, "a": {"a0": 7}}', db=db))
        elif kind == "entry_wrong_fields":
            _rows(
                store,
                "entries",
                lambda txn, db: txn.put(key.encode(), b'{"ns": "x", "ws": 1, "t": 0, "la": 0, "r": [1, 2]}', db=db),
            )
        elif kind == "manifest_deleted":
            _rows(store, "manifests", lambda txn, db: txn.delete(mk, db=db))
        elif kind == "entry_not_json":
            _rows(store, "entries", lambda txn, db: txn.put(key.encode(), b"{{{", db=db))
        elif kind == "entry_wrong_generation":

            def fn(txn, db):
                obj = json.loads(bytes(txn.get(key.encode(), db=db)))
                obj["r"]["0"] = obj["r"]["0"] ^ 12345
                txn.put(key.encode(), json.dumps(obj).encode(), db=db)

            _rows(store, "entries", fn)
        elif kind == "manifest_uncommitted_flag":

            def fn(txn, db):
                obj = json.loads(bytes(txn.get(mk, db=db)))
                obj["c"] = False
                txn.put(mk, json.dumps(obj).encode(), db=db)

            _rows(store, "manifests", fn)
        else:
            raise AssertionError(kind)

    return damage


LMDB_DAMAGE = [
    "inline_flip",
    "inline_missing",
    "blob_row_short",
    "blob_row_deleted",
    "manifest_not_json",
    "manifest_wrong_fields",
    "manifest_artifacts_not_pairs",
    "manifest_deleted",
    "entry_not_json",
    "entry_wrong_fields",
    "entry_wrong_generation",
    "manifest_uncommitted_flag",
]

#: Damage to a blob's row alone, while its content stays intact.
ROW_ONLY_DAMAGE = {"blob_row_short", "blob_row_deleted"}
MISS_REASONS = {"blob_missing", "corrupt_index", "incomplete", "uncommitted", "generation_mismatch", "absent"}


def _read_all(store: Store, key: str) -> None:
    res = store.lookup(key, count=False)
    for m in res.manifests.values():
        for name in m.artifacts:
            store.read_artifact(m, name)


@pytest.mark.parametrize("kind", FILE_DAMAGE + LMDB_DAMAGE)
def test_damage_is_a_named_miss_and_verify_fix_repairs(store, kind):
    gens = _populate(store)
    damage = _file_damage(kind) if kind in FILE_DAMAGE else _lmdb_damage(kind)
    damage(store, "b")
    # 1. The damaged entry is a miss with a reason, at lookup or at the verified read.
    #    This store checked "b" before the damage, so its hit is memoized: damage to
    #    bookkeeping rows alone is not seen until verify, and the content, verified on
    #    read, is served whole; any other damage fails the read, and lookups miss after.
    res = store.lookup("b", count=False)
    if res.hit:
        try:
            _read_all(store, "b")
        except (ChecksumMismatch, BlobMissing, CorruptRow):
            res = store.lookup("b", count=False)
            assert not res.hit and res.reason in MISS_REASONS, (kind, res)
        else:
            assert kind in ROW_ONLY_DAMAGE, kind
    else:
        assert res.reason in MISS_REASONS, (kind, res)
    #    A store that never checked "b" misses at lookup or at the read, whatever the damage.
    with Store.open(store.root, grace_period=0.0) as fresh:
        res = fresh.lookup("b", count=False)
        if res.hit:
            with pytest.raises((ChecksumMismatch, BlobMissing)):
                _read_all(fresh, "b")
        else:
            assert res.reason in MISS_REASONS, (kind, res)
    # 2. Every other entry is untouched.
    for key in ("a", "c", "d"):
        assert check_hit(store, key), key
    # 3. verify sees it, fix repairs it, and the store is clean again.  Damage to the index alone
    #    costs nothing: the entry comes back whole from its on-disk record (invariant 9); a
    #    damaged blob file stays a miss (the record lists it, it does not hold it).
    assert not store.verify().ok, kind
    fixed = store.verify(fix=True)
    assert fixed.ok and fixed.fixed, fixed.to_dict()
    after = store.verify()
    assert after.ok and not after.problems, after.to_dict()
    if kind in FILE_DAMAGE:
        assert not store.lookup("b", count=False).hit
    else:
        assert check_hit(store, "b"), kind
        assert store.lookup("b", count=False).generation == gens["b"]
        assert any("from their on-disk records" in f for f in fixed.fixed), fixed.fixed
    for key in ("a", "c", "d"):
        assert check_hit(store, key), key
    # 4. The key can be saved again and is served whole.
    save(store, "b", sizes=(100, 70_000))
    assert check_hit(store, "b")
    store.plan_sweep().execute()
    assert store.verify().ok
    assert store.lookup("a", count=False).generation == gens["a"]


_DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "kind",
    [
        "manifest_path_traversal_digest",
        "entry_world_size_zero",
        "entry_negative_world_size",
        pytest.param("manifest_deeply_nested"),
        pytest.param("entry_deeply_nested"),
    ],
)
def test_hostile_index_values_are_misses_not_exceptions(store, kind):
    """Values that decode as JSON but break the record's invariants (see bugs-found.md)."""
    gen = save(store, "b")
    save(store, "a")
    mk = manifest_key("b", 0, gen)
    if kind == "manifest_path_traversal_digest":

        def fn(txn, db):
            obj = json.loads(bytes(txn.get(mk, db=db)))
            obj["a"]["a1"][0] = "../../../../../etc/passwd"
            txn.put(mk, json.dumps(obj).encode(), db=db)

        _rows(store, "manifests", fn)
    elif kind == "manifest_deeply_nested":
        _rows(
            store,
            "manifests",
            lambda txn, db: txn.put(mk, f'{{"ws": 1, "c": true, "a": {{}}, "m": {_DEEP}}}'.encode(), db=db),
        )
    elif kind == "entry_deeply_nested":
        _rows(store, "entries", lambda txn, db: txn.put(b"b", f'{{"ns": "x", "r": {_DEEP}}}'.encode(), db=db))
    else:

        def fn(txn, db):
            obj = json.loads(bytes(txn.get(b"b", db=db)))
            obj["ws"] = 0 if kind == "entry_world_size_zero" else -3
            txn.put(b"b", json.dumps(obj).encode(), db=db)

        _rows(store, "entries", fn)
    res = store.lookup("b", count=False)
    assert not res.hit and res.reason == "corrupt_index", res
    assert check_hit(store, "a")
    assert not store.verify().ok
    store.plan_sweep()
    store.plan_eviction(max_size=0)
    assert store.verify(fix=True).ok
    assert store.verify().ok and check_hit(store, "a")


def test_deeply_nested_components_row_is_corrupt_record(store):
    save(store, "b")
    _rows(store, "components", lambda txn, db: txn.put(b"b", f'{{"model": {_DEEP}}}'.encode(), db=db))
    with pytest.raises(CorruptRow):
        store.entry("b")


def test_missing_inline_data_becomes_a_lookup_miss_after_the_failed_read(store):
    save(store, "k")
    small = bytes.fromhex(store.lookup("k", count=False).manifest.artifacts["a0"].digest)
    _rows(store, "blobdata", lambda txn, db: txn.delete(small, db=db))
    with pytest.raises(BlobMissing):
        _read_all(store, "k")
    assert store.lookup("k", count=False).reason == "blob_missing"


def test_garbage_lmdb_file_is_a_store_error_not_a_crash(tmp_path):
    """A data.mdb that is not LMDB at all (overwritten by something else)."""
    root = tmp_path / "store"
    with Store.open(root) as s:
        save(s, "k")
    data = root / "index" / "data.mdb"
    data.write_bytes(os.urandom(8192) * 4)
    with pytest.raises(StoreError):
        Store.open(root)


def test_bit_rot_sweep_over_every_blob_byte_class(store):
    """Flip one bit at 16 spread offsets of one file blob, each in turn; each is caught."""
    save(store, "k", sizes=(100, 70_000))
    ref = store.lookup("k", count=False).manifest.artifacts["a1"]
    original = store.get_bytes(ref)
    caught = 0
    for offset in range(0, 70_000, 70_000 // 16):
        path = store.blob_path(ref)
        _flip(path, offset)
        with pytest.raises(ChecksumMismatch):
            store.get_bytes(ref)
        assert store.lookup("k", count=False).reason == "blob_missing"
        caught += 1
        store.put_bytes(original)  # the next writer of the same content repairs the blob
        assert hashlib.sha256(store.get_bytes(ref)).hexdigest() == ref.digest
        assert check_hit(store, "k")
    assert caught == 16
    fixed = store.verify(fix=True)  # quarantine leftovers are not problems
    assert fixed.ok


def test_cli_verify_fix_repairs_several_kinds_of_damage_at_once(store_root):
    """``adstore verify`` exits 1 on a damaged store, ``verify --fix`` repairs it, then 0."""
    import subprocess
    import sys

    with Store.open(store_root, grace_period=0.0) as store:
        _populate(store)
        _file_damage("flip_middle")(store, "a")
        _lmdb_damage("manifest_not_json")(store, "b")
        _lmdb_damage("inline_flip")(store, "c")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "adstore.daemon", "--root", str(store_root), *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    first = cli("verify")
    assert first.returncode == 1, (first.returncode, first.stdout, first.stderr)
    fixed = cli("verify", "--fix")
    assert fixed.returncode == 0, (fixed.returncode, fixed.stdout, fixed.stderr)
    again = cli("--json", "verify")
    assert again.returncode == 0 and json.loads(again.stdout)["ok"], again.stdout
    with Store.open(store_root, grace_period=0.0) as store:
        assert check_hit(store, "d")
        assert not store.lookup("a", count=False).hit  # its blob file was damaged
        assert check_hit(store, "b") and check_hit(store, "c")  # index damage: back from their records
        for key in ("a", "b", "c"):
            save(store, key)
            assert check_hit(store, key)
        assert store.verify().ok
