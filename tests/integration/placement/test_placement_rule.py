"""The rule for files that become code, on real directories and files: walk, tighten, capture, refuse.

No torch here: directories owned by other uids (chown, as root), group
and world write bits, sticky directories, symlinks, and files captured
into a real store, whose bytes must be the ones judged.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from adstore.integration.errors import UnsafeCacheDir, UntrustedKernel, VllmTreeError, failure_reason
from adstore.integration.placement.capture import capture_files
from adstore.integration.placement.dirs import open_dir
from adstore.integration.placement.rule import Writer, dir_refusal, group_private
from adstore.store import BlobMissing, Reason, Store

ME = frozenset({os.geteuid(), 0})
ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="chown to other uids needs root")


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_group_only_trusted_users_belong_to_is_private_and_one_with_others_is_not():
    assert group_private(0, ME)  # root's group: no member by name, root's primary group only
    assert not group_private(424242, ME)  # a gid the group database does not know: not known to be private
    assert not group_private(65534, ME)  # nogroup: the primary group of nobody (65534)
    assert group_private(65534, ME | {4, 42, 65534})  # sync, _apt and nobody all trusted


@ROOT
def test_a_directory_is_safe_when_trusted_users_own_it_and_no_one_else_renames_in_it(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for mode, gid, owner, refused in [
        (0o755, 0, 0, False),
        (0o1777, 0, 0, False),  # /tmp: others add entries, never rename ours
        (0o777, 0, 0, True),
        (0o775, 65534, 0, True),  # a group with an untrusted member
        (0o775, 0, 0, False),  # a group of trusted users only (a user-private group under umask 002)
        (0o775, 424242, 0, True),  # a gid the group database does not know (a container's fsGroup)
        (0o755, 0, 4242, True),  # another user's
    ]:
        os.chown(d, owner, gid)
        os.chmod(d, mode)
        assert (dir_refusal(os.lstat(d), ME) is not None) is refused, (oct(mode), gid, owner)


def test_a_group_writable_directory_of_this_user_is_tightened_on_its_descriptor(tmp_path):
    d = tmp_path / "cache" / "ab"
    d.mkdir(parents=True)
    os.chmod(d, 0o777)
    os.close(open_dir(d, ME, own=True))
    assert _mode(d) == 0o755
    made = tmp_path / "new" / "deeper"
    os.close(open_dir(made, ME, create=True))
    assert _mode(made) == 0o700 and _mode(made.parent) == 0o700


@ROOT
@pytest.mark.parametrize("shape", ["foreign_parent", "foreign_leaf", "symlink", "world_writable_parent"])
def test_a_directory_another_user_could_swap_is_refused(tmp_path, shape):
    parent = tmp_path / "p"
    parent.mkdir()
    leaf = parent / "leaf"
    leaf.mkdir()
    if shape == "foreign_parent":
        os.chown(parent, 4242, 4242)
    elif shape == "foreign_leaf":
        os.chown(leaf, 4242, 4242)
    elif shape == "world_writable_parent":
        os.chown(parent, 4242, 4242)
        os.chmod(parent, 0o777)
    else:
        (tmp_path / "alias").symlink_to(parent)
        leaf = tmp_path / "alias" / "leaf"
    with pytest.raises(UnsafeCacheDir):
        os.close(open_dir(leaf, ME, own=False))


@ROOT
def test_capture_stores_only_files_the_rule_accepts_and_the_bytes_it_judged(tmp_path):
    with Store.open(tmp_path / "store", inline_threshold=64) as store:
        mine = tmp_path / "mine"
        mine.mkdir()
        good, small = mine / "k.so", mine / "small.cpp"
        good.write_bytes(os.urandom(4096))
        small.write_bytes(b"inline")
        foreign, writable, link = mine / "foreign.so", mine / "writable.so", mine / "link.so"
        foreign.write_bytes(b"x" * 1000)
        os.chown(foreign, 4242, 4242)
        writable.write_bytes(b"y" * 1000)
        os.chmod(writable, 0o666)
        link.symlink_to(good)
        hostile = tmp_path / "hostile"  # another user's world-writable directory: /tmp/torchinductor_$USER made first
        hostile.mkdir()
        os.chmod(hostile, 0o777)
        os.chown(hostile, 4242, 4242)
        planted = hostile / "ab"
        planted.mkdir()
        (planted / "k.so").write_bytes(b"z" * 1000)  # even a file of this user's is refused there
        paths = [str(p) for p in (good, small, foreign, writable, link, planted / "k.so")]
        captured = capture_files(store, paths, ME)
        assert set(captured.refs) == {str(good), str(small)}
        assert store.get_bytes(captured.refs[str(good)]) == good.read_bytes()
        assert store.get_bytes(captured.refs[str(small)]) == b"inline"
        reasons = {Path(p).name: failure_reason(e) for p, e in captured.refused.items()}
        assert reasons == {
            "foreign.so": "untrusted_engine",
            "writable.so": "untrusted_engine",
            "link.so": "unsafe_root",
            "k.so": "unsafe_root",
        }, captured.refused
        with pytest.raises(BlobMissing):  # the planted file's bytes never entered the store
            store.get_bytes(hashlib.sha256(b"z" * 1000).hexdigest())


def test_a_files_writer_is_judged_by_one_rule():
    assert Writer(None).refusal(ME) is not None
    assert Writer(os.geteuid(), stat.S_IFREG | 0o644, 0).refusal(ME) is None
    assert "regular" in (Writer(os.geteuid(), stat.S_IFLNK | 0o777, 0).refusal(ME) or "")
    assert "uid 4242" in (Writer(4242, stat.S_IFREG | 0o444, 0).refusal(ME) or "")
    assert "every user" in (Writer(0, stat.S_IFREG | 0o666, 0).refusal(ME) or "")


def test_one_mapping_from_an_exception_to_a_reason():
    assert failure_reason(UnsafeCacheDir("/x", "why")) == Reason.UNSAFE_ROOT
    assert failure_reason(UntrustedKernel("0" * 64, "why")) == Reason.UNTRUSTED_ENGINE
    assert failure_reason(VllmTreeError("unsafe_path", "why")) == "unsafe_path"
    assert failure_reason(PermissionError("denied")) == Reason.IO_ERROR
    assert failure_reason(ValueError("x")) == Reason.INTEGRATION_ERROR
    assert failure_reason(ValueError("x"), Reason.ENGINE_ERROR) == Reason.ENGINE_ERROR
    odd = RuntimeError("an exception with a reason that is not ours")
    odd.reason = "Not Found"  # type: ignore[attr-defined]
    assert failure_reason(odd, Reason.ERROR) == Reason.ERROR
