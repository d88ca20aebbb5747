"""Hostile paths and damage, store side, in-process (docs/operations.md, "Damage and repair").

Symlinked store directories are refused, a symlinked blob file is never
served or followed, removed directories are recreated by the next writer,
the ballast is never written through a symlink, and LMDB errors leave the
store only as its own errors.  The child-process cases live in ``test_damage.py``.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import time

import lmdb
import pytest
from store_helpers import save, writer_forever

from adstore.store import CorruptRow, Store, UnsafeRoot
from adstore.store.index.ballast import Ballast
from adstore.store.index.file import check_data_file, check_pages, read_meta
from adstore.store.reasons import Reason


@pytest.mark.parametrize("sub", ["blobs", "index", "tmp", "quarantine"])
def test_a_symlinked_directory_refuses_the_root(tmp_path, sub):
    root = tmp_path / "store"
    Store.open(root).close()
    outside = tmp_path / "outside"
    shutil.move(root / sub, outside)
    os.symlink(outside, root / sub)
    with pytest.raises(UnsafeRoot) as info:
        Store.open(root)
    assert info.value.reason == Reason.UNSAFE_ROOT and f"{sub}/ is a symlink" in str(info.value)
    with pytest.raises(UnsafeRoot):
        Store.repair_index(root)


def test_a_symlinked_blob_file_is_never_served_and_fix_quarantines_the_link(tmp_path):
    root = tmp_path / "store"
    with Store.open(root, grace_period=0.0) as store:
        save(store, "k", sizes=(70_000,))
        blob = next((root / "blobs").glob("*/*"))
        outside = tmp_path / "outside-blob"
        shutil.copyfile(blob, outside)
        blob.unlink()
        os.symlink(outside, blob)
        res = store.lookup("k", count=False)
        assert not res.hit and res.reason == Reason.BLOB_MISSING
        report = store.verify()
        assert any("is a symlink" in p for p in report.problems)
        assert store.verify(fix=True).ok and store.verify().ok
        assert not os.path.lexists(blob) and outside.read_bytes()  # the link moved, its target untouched
        assert any(p.is_symlink() for p in (root / "quarantine").iterdir())


def test_removed_directories_are_recreated_by_the_next_put(tmp_path):
    root = tmp_path / "store"
    with Store.open(root, grace_period=0.0) as store:
        save(store, "before", sizes=(70_000,))
        shutil.rmtree(root / "tmp")
        shutil.rmtree(root / "blobs")
        ref = store.put_bytes(os.urandom(100_000))
        assert store.get_bytes(ref) and (root / "tmp").is_dir()
        shutil.rmtree(root / "tmp")
        assert store.put_stream([os.urandom(80_000)]).size == 80_000
        assert not store.lookup("before", count=False).hit  # its blob went with blobs/: a miss, no error


def test_the_ballast_is_created_with_the_store_and_never_through_a_symlink(tmp_path):
    root = tmp_path / "store"
    Store.open(root).close()
    ballast = Ballast(root)
    assert ballast.present() and (root / "ballast").stat().st_size == ballast.size
    assert (root / "ballast").stat().st_blocks * 512 >= ballast.size  # real blocks, not a sparse file
    assert ballast.release() and not ballast.present()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    os.symlink(victim, root / "ballast")
    assert not ballast.ensure() and victim.read_bytes() == b"keep"
    assert not ballast.release() and (root / "ballast").is_symlink()


def test_a_file_cut_before_a_reachable_page_is_a_damaged_index(tmp_path):
    root = tmp_path / "store"
    with Store.open(root) as store:
        for i in range(20):
            save(store, f"k{i}")
    data = root / "index" / "data.mdb"
    meta = read_meta(data)
    assert meta is not None and meta.min_file_size == data.stat().st_size
    os.truncate(data, meta.min_file_size // 2)
    with pytest.raises(CorruptRow) as info:
        check_data_file(root / "index")
    assert info.value.reason == Reason.CORRUPT_INDEX and "truncated" in str(info.value)
    assert "reaches page" in str(info.value)


def test_a_file_that_ends_before_never_written_pages_is_sound(tmp_path):
    """LMDB counts pages a transaction allocated and freed again (never written) in its last page
    number, so a sound ``data.mdb`` can end before it; the CI's kill-point run met one.  Made here by
    raising both meta pages' last page number past the end: the extra pages are reachable from no tree."""
    root = tmp_path / "store"
    with Store.open(root) as store:
        save(store, "k")
    data = root / "index" / "data.mdb"
    meta = read_meta(data)
    assert meta is not None and meta.min_file_size == data.stat().st_size
    with open(data, "r+b") as f:
        for page in (0, 1):
            f.seek(page * meta.page_size + 136)  # mm_last_pg (64-bit LMDB)
            f.write((meta.last_page + 3).to_bytes(8, "little"))
    assert read_meta(data).min_file_size == data.stat().st_size + 3 * meta.page_size
    assert check_data_file(root / "index") is not None
    with Store.open(root) as store:
        assert store.lookup("k", count=False).hit
        save(store, "k2")
        assert store.lookup("k2", count=False).hit and store.verify().ok


def test_the_page_checks_pass_sound_indexes_even_under_writers(tmp_path, monkeypatch):
    """``check_pages`` (``verify`` runs it: the table pages and the free-page list) must never call a sound
    index damaged: not one whose eviction freed hundreds of pages at once (a free-page record in overflow pages),
    nor one that two processes save to and evict from while they walk (a damaged verdict would rebuild a
    sound index)."""
    root = tmp_path / "store"
    data = root / "index" / "data.mdb"
    with Store.open(root, grace_period=0.0) as store:
        for i in range(400):
            save(store, f"k{i}", sizes=(100, 200))
        assert check_pages(data) is None
        store.plan_eviction(max_size=0).execute()
        assert check_pages(data) is None
        for i in range(20):
            save(store, f"x{i}", sizes=(100, 300))
    monkeypatch.setenv("ADSTORE_TEST_EVICT", "1")
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=writer_forever, args=(str(root), seed)) for seed in range(2)]
    for w in writers:
        w.start()
    try:
        verdicts = []
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:
            verdicts.append(check_pages(data))
        # Each writer saved until killed: one evicting cut the other's save between its publish and its
        # commit ("no manifest to commit for k0 rank 0 generation ..."), and the writer died of it.
        died = [w.exitcode for w in writers if not w.is_alive()]
    finally:
        for w in writers:
            w.kill()
            w.join()
    assert not died, f"a writer died (exit {died}); its traceback is in the captured stderr"
    assert len(verdicts) > 50 and not [v for v in verdicts if v is not None], set(verdicts)


def test_lmdb_errors_in_reads_become_the_stores_own(tmp_path, monkeypatch):
    root = tmp_path / "store"
    with Store.open(root) as store:
        save(store, "k")
        from adstore.store.index import tables

        def broken(self, *args, **kwargs):
            raise lmdb.CorruptedError("mdb_get: MDB_CORRUPTED: Located page was wrong type")

        monkeypatch.setattr(tables.Txn, "entry_row", broken)
        res = store.lookup("k", count=False)
        assert not res.hit and res.reason == Reason.CORRUPT_INDEX
        with pytest.raises(CorruptRow) as info:
            store.resolve_key("k")
        assert not isinstance(info.value, lmdb.Error) and info.value.reason == Reason.CORRUPT_INDEX
