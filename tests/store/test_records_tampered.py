"""Tampered and hostile record files: skipped with a reason, quarantined, never a crash.

A record file damaged or rewritten as a well-formed lie (bad checksum, newer
format, path traversal in digests, names or keys, lying inline bytes, ...)
is skipped by a rebuild with a reason and moved to quarantine by ``verify
--fix``; records out of step with a sound index are reported and repaired;
hostile keys in the index, a symlinked records directory and tampered
obsolete lists name nothing outside the records.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
from store_helpers import run_cli, save, served_digests

from adstore.store import Reason, Store, UnsafeRoot
from adstore.store.index.rows import MANIFEST_SUFFIX, manifest_key
from adstore.store.layout import Layout
from adstore.store.records.files import RecordFiles, RecordState
from adstore.store.records.format import RECORD_FORMAT, BadRecord, decode_record, encode_record


def _rewrite(path: Path, edit) -> None:
    """Replace a record file with ``edit(payload)``, checksummed again (a deliberate, well-formed lie)."""
    payload = json.loads(path.read_bytes())["record"]
    edit(payload)
    os.chmod(path, 0o644)
    path.write_bytes(encode_record(payload))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


def _relocate(path: Path, other: Path) -> None:
    """Put this key's record where another key's belongs (same content, another name)."""
    os.chmod(other, 0o644)
    shutil.copyfile(path, other)


TAMPER = {
    "bad_checksum": (_flip_byte, Reason.CORRUPT_RECORD),
    "newer_format": (lambda p: _rewrite(p, lambda d: d.update(format=RECORD_FORMAT + 1)), Reason.NEWER_RECORD),
    "digest_path_traversal": (
        lambda p: _rewrite(p, lambda d: d["artifacts"]["a1"].__setitem__(0, "../../../etc/passwd")),
        Reason.CORRUPT_RECORD,
    ),
    "artifact_name_path": (
        lambda p: _rewrite(p, lambda d: d["artifacts"].__setitem__("../../evil", d["artifacts"]["a1"])),
        Reason.CORRUPT_RECORD,
    ),
    "key_path_traversal": (lambda p: _rewrite(p, lambda d: d.update(key="../../../tmp/x")), Reason.CORRUPT_RECORD),
    "key_of_another_entry": (lambda p: _rewrite(p, lambda d: d.update(key="one")), Reason.CORRUPT_RECORD),
    "inline_bytes_lie": (
        lambda p: _rewrite(p, lambda d: d["inline"].update({k: "QUFBQQ==" for k in d["inline"]})),
        Reason.CORRUPT_RECORD,
    ),
    "negative_size": (lambda p: _rewrite(p, lambda d: d["artifacts"]["a1"].__setitem__(1, -5)), Reason.CORRUPT_RECORD),
    "world_size_zero": (lambda p: _rewrite(p, lambda d: d.update(world_size=0)), Reason.CORRUPT_RECORD),
    "deep_components": (
        lambda p: _rewrite(p, lambda d: d.update(components=json.loads("[" * 500 + "]" * 500))),
        Reason.CORRUPT_RECORD,
    ),
    "not_json": (lambda p: (os.chmod(p, 0o644), p.write_bytes(b"\x00\xff" * 100)), Reason.CORRUPT_RECORD),
    "empty": (lambda p: (os.chmod(p, 0o644), p.write_bytes(b"")), Reason.CORRUPT_RECORD),
    "symlink": (lambda p: (p.unlink(), os.symlink("/etc/passwd", p)), Reason.CORRUPT_RECORD),
    "directory": (lambda p: (p.unlink(), p.mkdir()), Reason.CORRUPT_RECORD),
}


@pytest.mark.parametrize("kind", sorted(TAMPER))
def test_a_tampered_record_is_skipped_with_a_reason(store_root, kind):
    with Store.open(store_root, grace_period=0.0) as store:
        save(store, "one", sizes=(100, 70_000))
        save(store, "victim", sizes=(100, 70_000))
        want = served_digests(store, "one")
    files = RecordFiles(Layout(store_root))
    (path,) = [f.path for f in files.scan() if f.key == "victim"]
    damage, reason = TAMPER[kind]
    damage(path)
    os.truncate(store_root / "index" / "data.mdb", 4096)
    why, report = Store.repair_index(store_root)
    assert report.entries == 1, report
    assert [s.reason for s in report.skipped] == [reason], report.skipped
    assert "victim" in report.skipped[0].path
    with Store.open(store_root, grace_period=0.0) as store:
        assert served_digests(store, "one") == want
        assert store.lookup("victim", count=False).reason == Reason.ABSENT
        rep = store.verify()  # the tampered file is a problem until --fix moves it to quarantine/
        assert not rep.ok and any(f.kind is Reason.CORRUPT_RECORD for f in rep.findings), rep.to_dict()
        fixed = store.verify(fix=True)
        assert fixed.ok, fixed.to_dict()
        after = store.verify()
        assert after.ok and not after.warnings, after.to_dict()
        assert served_digests(store, "one") == want
    assert not os.path.lexists(path)


def test_a_symlinked_records_directory_is_refused(store_root, tmp_path):
    """Records would be written through it, wherever it points (invariant 10)."""
    with Store.open(store_root) as store:
        save(store, "k")
    outside = tmp_path / "outside"
    shutil.move(store_root / "records", outside)
    os.symlink(outside, store_root / "records")
    with pytest.raises(UnsafeRoot, match="records/ is a symlink"):
        Store.open(store_root)
    assert run_cli(store_root, "verify", "--fix").returncode == 7


def test_decode_record_refuses_a_file_too_large_or_without_a_checksum():
    with pytest.raises(BadRecord, match="no record and checksum"):
        decode_record(b'{"record": {"format": 1}}', "x")
    with pytest.raises(BadRecord, match="more than any record"):
        decode_record(b" " * ((64 << 20) + 1), "x")


def test_verify_reports_and_fix_repairs_records_out_of_step(store):
    save(store, "a")
    save(store, "b")
    save(store, "c")
    store.pin("c")
    files = RecordFiles(Layout(store.root))
    by_key = {f.key: f for f in files.scan() if f.state is RecordState.COMMITTED}
    by_key["a"].path.unlink()  # a record lost: the entry would not survive a rebuild
    orphan = by_key["b"].path.with_name(f"b.0.{by_key['b'].generation + 1}")
    shutil.copyfile(by_key["b"].path, orphan)
    _rewrite(orphan, lambda d: d.update(generation=d["generation"] + 1))  # a record the index knows nothing of
    files.set_pinned("c", False)  # a pin marker lost
    rep = store.verify()
    kinds = {f.kind for f in rep.findings}
    assert rep.ok and {Reason.MISSING_RECORD, Reason.ORPHAN_RECORDS} <= kinds, rep.to_dict()
    fixed = store.verify(fix=True)
    assert fixed.ok and len(fixed.fixed) >= 3, fixed.to_dict()
    assert not store.verify().warnings
    assert by_key["a"].path.exists() and not orphan.exists() and files.pin_path("c").exists()


def test_a_damaged_record_of_a_sound_index_is_quarantined_and_written_again(store):
    save(store, "k", sizes=(100, 70_000))
    files = RecordFiles(Layout(store.root))
    (found,) = [f for f in files.scan() if f.state is RecordState.COMMITTED]
    good = files.read(found.path)
    _flip_byte(found.path)
    rep = store.verify()
    assert not rep.ok and [f.kind for f in rep.findings if f.problem] == [Reason.CORRUPT_RECORD], rep.to_dict()
    assert store.verify(fix=True).ok
    again = files.read(found.path)  # written again from the index, marked so (a repaired record seals nothing)
    assert dataclasses.replace(again, producer=good.producer) == good
    assert again.producer == {**good.producer, "repaired_from_index": True}
    assert any(p.name.startswith("record.") for p in (store.root / "quarantine").iterdir())
    assert store.verify().ok and not store.verify().warnings


def test_a_hostile_key_in_the_index_names_no_record_file(store, tmp_path):
    """Rows copied under a key that is a path: verify and --fix must not write or move anything outside."""
    from adstore.store.index.rows import manifest_key

    gen = save(store, "k")
    evil = "../../../evil"  # from records/<ab>/: beside the store root, in tmp_path
    with store.index.env.begin(write=True) as txn:
        db = store.index.db
        txn.put(evil.encode(), txn.get(b"k", db=db["entries"]), db=db["entries"])
        txn.put(manifest_key(evil, 0, gen), txn.get(manifest_key("k", 0, gen), db=db["manifests"]), db=db["manifests"])
    with pytest.raises(ValueError):
        RecordFiles(Layout(store.root)).committed_path(evil, 0, gen)
    store.verify()
    store.verify(fix=True)
    store.plan_sweep().execute()
    assert store.root.parent == tmp_path and not list(tmp_path.glob("evil*"))
    assert store.lookup("k", count=False).hit


def test_a_tampered_obsolete_list_names_nothing_outside_the_records(store, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    save(store, "live")
    files = RecordFiles(Layout(store.root))
    (live,) = files.scan()
    suffix = MANIFEST_SUFFIX.pack(0, 1)
    hostile = [
        b"../../victim\x00" + suffix,
        f"{tmp_path}/victim".encode() + b"\x00" + suffix,
        b"ab/../../../victim\x00" + suffix,
        b"live\x00" + suffix[:5],
        b"live",
        b"\x00",
        "é".encode() + b"\x00" + suffix,
        b"li\nve\x00" + suffix,
        b"\xff\xfe\x00" + suffix,
    ]
    files.write_obsolete_list([(mk, 3) for mk in hostile] + [(manifest_key("live", 0, live.generation), 1)])
    (listed,) = files.obsolete_files()
    with open(listed, "ab") as f:
        f.write(b"\x01\xff\xffab/../victim")  # a torn or lying last item
    (files.obsolete / "evil.list").write_bytes(b"ab/live.0.1\n" + bytes(100))  # not a list at all
    assert set(files.obsoleted()) == {f"{live.path.parent.name}/{live.path.name}"}
    store.plan_sweep().execute()  # the live record keeps its manifest row: gc keeps the file
    assert victim.read_bytes() == b"keep" and live.path.exists() and files.obsolete_files() == []
    assert store.verify().ok and store.lookup("live", count=False).hit
