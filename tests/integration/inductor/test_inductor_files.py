"""The trust rule for Inductor's files, without a compile: who wrote a blob, where a copy may go, what it holds.

These drive :mod:`adstore.integration.placement` and the entries' file
placement on a real store: a blob file owned by another uid, an inline blob
in a group-writable index, a target directory another user owns or that is a
symlink, a parent others can write in, and a blob whose content no longer
hashes to its digest are each refused, and nothing is left under the final
name; a 0775 directory of this user's is tightened, not refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from adstore.integration.errors import UnsafeCacheDir, UntrustedKernel
from adstore.integration.inductor.entries import InductorEntries
from adstore.integration.placement.place import place, read_trusted
from adstore.integration.placement.rule import trusted_uids
from adstore.store import ChecksumMismatch, Store

ME = frozenset({os.geteuid(), 0})


@pytest.fixture
def small_store(tmp_path):
    with Store.open(tmp_path / "store", inline_threshold=64) as s:
        yield s


def _place(store: Store, data: bytes, directory: Path, name: str = "k.so") -> bool:
    return place(store, store.put_bytes(data), directory=directory, name=name, trusted=ME)


def test_a_file_blob_and_an_inline_blob_read_back_and_are_placed_once(small_store, tmp_path):
    big, small = os.urandom(4096), b"tiny kernel source"
    for data in (big, small):
        ref = small_store.put_bytes(data)
        out = tmp_path / "cache" / "ab"
        assert read_trusted(small_store, ref, ME) == data
        assert place(small_store, ref, directory=out, name="x", trusted=ME)
        assert (out / "x").read_bytes() == data
        assert not _place(small_store, b"other bytes", out, "x")  # an existing file is never replaced
        assert (out / "x").read_bytes() == data
        (out / "x").unlink()
    assert not [p for p in (tmp_path / "cache" / "ab").iterdir()], "no temp file left"


def test_a_blob_file_another_uid_owns_is_refused_before_any_byte(small_store):
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    ref = small_store.put_bytes(os.urandom(4096))
    os.chown(small_store.blob_path(ref), 4242, 4242)
    with pytest.raises(UntrustedKernel, match="uid 4242"):
        read_trusted(small_store, ref, ME)
    assert read_trusted(small_store, ref, ME | {4242})  # ADSTORE_TRUSTED_UIDS admits it


def test_an_inline_blob_of_an_index_others_can_write_is_refused(small_store):
    ref = small_store.put_bytes(b"inline")
    if os.geteuid() != 0:
        pytest.skip("chgrp to a shared group needs root")
    os.chown(small_store.root / "index", -1, 65534)  # a group with other members (nogroup: nobody, sync, _apt)
    os.chmod(small_store.root / "index", 0o2775)  # a group-shared store: any member writes the index
    with pytest.raises(UntrustedKernel, match="inline"):
        read_trusted(small_store, ref, ME)


def test_a_blob_that_no_longer_hashes_to_its_digest_is_never_linked_and_is_quarantined(small_store, tmp_path):
    data = os.urandom(4096)
    ref = small_store.put_bytes(data)
    path = small_store.blob_path(ref)
    os.chmod(path, 0o600)
    path.write_bytes(b"evil" + data[4:])  # same size, other bytes: proven damage
    os.chmod(path, 0o444)
    with pytest.raises(ChecksumMismatch):
        place(small_store, ref, directory=tmp_path / "d", name="k.so", trusted=ME)
    assert list((tmp_path / "d").iterdir()) == []
    assert list((small_store.root / "quarantine").iterdir())  # the store's read path quarantined it


def test_a_group_writable_directory_of_this_user_is_tightened_not_refused(tmp_path):
    target = tmp_path / "cache"
    target.mkdir()
    os.chmod(target, 0o2777)  # umask 000 and a setgid bit: still this user's
    with Store.open(tmp_path / "store") as store:
        assert _place(store, b"kernel", target)
    assert (target / "k.so").read_bytes() == b"kernel" and target.stat().st_mode & 0o7777 == 0o2755


@pytest.mark.parametrize("shape", ["symlink", "other_owner", "parent_others_write"])
def test_a_target_directory_others_could_write_is_refused(shape, tmp_path):
    target = tmp_path / "cache"
    if shape == "parent_others_write":  # another user's world-writable directory above ours
        if os.geteuid() != 0:
            pytest.skip("chown to another uid needs root")
        parent = tmp_path / "shared"
        parent.mkdir()
        os.chmod(parent, 0o777)
        os.chown(parent, 4242, 4242)
        target = parent / "cache"
        target.mkdir(mode=0o700)
    elif shape == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        target.symlink_to(tmp_path / "elsewhere")
    else:
        if os.geteuid() != 0:
            pytest.skip("chown to another uid needs root")
        target.mkdir(mode=0o755)
        os.chown(target, 4242, 4242)
    with Store.open(tmp_path / "store") as store, pytest.raises(UnsafeCacheDir):
        _place(store, b"kernel", target)
    assert not (target / "k.so").exists() and not list(tmp_path.glob("elsewhere/*"))


def test_artifact_names_only_lead_into_the_cache_and_header_directories(small_store, tmp_path):
    entries = InductorEntries(small_store, trusted=ME, owns_store=False)
    cache, headers = tmp_path / "cache", tmp_path / "headers"
    good, bad = small_store.put_bytes(b"a" * 100), small_store.put_bytes(b"b" * 100)
    artifacts = {"cache.ab.cabc.main.so": good, "pch.cxyz.h.gch": good, "value": bad, "cache.ab..so": bad}
    artifacts |= {"cache.a.x.so": bad, "cache.abc.x.so": bad, "other.ab.x.so": bad}
    assert entries.materialize(artifacts, cache, headers) == 2
    placed = [p for d in (cache, headers, tmp_path / "ab") for p in d.rglob("*") if p.is_file()]
    assert sorted(str(p.relative_to(tmp_path)) for p in placed) == ["cache/ab/cabc.main.so", "headers/cxyz.h.gch"]


def test_trusted_uids_come_from_the_environment():
    assert trusted_uids({"ADSTORE_TRUSTED_UIDS": "1001, 1002"}) == {os.geteuid(), 0, 1001, 1002}
    with pytest.raises(Exception, match="ADSTORE_TRUSTED_UIDS"):
        trusted_uids({"ADSTORE_TRUSTED_UIDS": "alice"})
