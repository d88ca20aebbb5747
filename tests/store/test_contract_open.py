"""The store's contract, opening: layout, root, and the stores and roots it refuses."""

from __future__ import annotations

import os

import pytest

from adstore.store import Store, default_root


def test_layout_and_cachedir_tag(store):
    for d in ("index", "blobs", "tmp", "quarantine"):
        assert (store.root / d).is_dir()
    assert (store.root / "CACHEDIR.TAG").read_bytes().startswith(b"Signature: 8a477f597d28d172789f06886806bc55")


def test_default_root_follows_environment(tmp_path):
    assert default_root({"ADSTORE_ROOT": str(tmp_path / "x")}) == tmp_path / "x"
    assert default_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "adstore"
    assert default_root({"HOME": "/h"}).name == "adstore"


def test_open_uses_adstore_root(store_root):
    with Store.open() as s:
        assert s.root == store_root


def test_network_filesystem_is_refused(tmp_path, monkeypatch):
    import psutil

    from adstore.store import UnsupportedFilesystem

    real = psutil.disk_partitions

    def with_nfs(all=False):  # the machine's mounts plus one NFS mount over tmp_path
        parts = real(all=all)
        nfs = type(parts[0])(device="server:/export", mountpoint=str(tmp_path), fstype="nfs4", opts="rw")
        return [*parts, nfs]

    monkeypatch.setattr(psutil, "disk_partitions", with_nfs)
    with pytest.raises(UnsupportedFilesystem, match="nfs4"):
        Store.open(tmp_path / "s")


def test_world_writable_root_is_refused(tmp_path):
    from adstore.store import UnsafeRoot

    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeRoot):
        Store.open(root)


def test_index_of_another_schema_is_refused_and_left_alone(store_root):
    import lmdb

    from adstore.store import IncompatibleStore

    Store.open(store_root).close()
    env = lmdb.open(str(store_root / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"1", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(IncompatibleStore, match="schema 1") as err:
        Store.open(store_root)
    assert err.value.reason == "incompatible_store" and "delete" in str(err.value)
    env = lmdb.open(str(store_root / "index"), max_dbs=16)
    with env.begin() as txn:  # refused, not rewritten
        assert txn.get(b"schema", db=env.open_db(b"meta", txn=txn)) == b"1"
    env.close()
