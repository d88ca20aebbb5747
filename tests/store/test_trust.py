"""The one trust rule (``adstore.store``'s ``file_refusal``, ``dir_refusal``, ``group_private``) on real files.

Real files and directories chowned to other uids and gids (as root): a gid
the group database does not know, a group whose only member is root, world
and group write bits, sticky directories.
"""

from __future__ import annotations

import grp
import os
from pathlib import Path

import pytest

from adstore.store import ConfigError, dir_refusal, file_refusal, group_private, trusted_uids

ME = frozenset({os.geteuid(), 0})
ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="chown to other uids and gids needs root")


def _unknown_gid() -> int:
    """A gid the group database does not know (as a Kubernetes fsGroup or ``docker --group-add`` gid often is)."""
    for gid in range(424242, 425242):
        try:
            grp.getgrgid(gid)
        except KeyError:
            return gid
    raise AssertionError("no unknown gid found")


def _made(path: Path, *, directory: bool, uid: int, gid: int, mode: int) -> os.stat_result:
    if directory:
        path.mkdir()
    else:
        path.write_bytes(b"\x7fELF kernel")
    os.chown(path, uid, gid)
    os.chmod(path, mode)
    return os.lstat(path)


@ROOT
def test_a_gid_the_group_database_does_not_know_is_not_a_private_group(tmp_path):
    # Another uid holding this gid (the container runtime gave it) could rewrite a 0664 kernel in a 2775 directory.
    gid = _unknown_gid()
    assert not group_private(gid, ME)
    d = _made(tmp_path / "kernels", directory=True, uid=0, gid=gid, mode=0o2775)
    f = _made(tmp_path / "kernels" / "k.so", directory=False, uid=0, gid=gid, mode=0o664)
    assert f"writable by group {gid}" in (file_refusal(f, ME) or "")
    assert f"writable by group {gid}" in (dir_refusal(d, ME) or "")
    # the same modes under a group known to hold only trusted users (root's, whose only user is root): accepted
    os.chown(tmp_path / "kernels", 0, 0)
    os.chown(tmp_path / "kernels" / "k.so", 0, 0)
    assert group_private(0, ME)
    assert file_refusal(os.lstat(tmp_path / "kernels" / "k.so"), ME) is None
    assert dir_refusal(os.lstat(tmp_path / "kernels"), ME) is None


@ROOT
def test_a_file_vouches_only_when_regular_trusted_and_writable_by_no_untrusted_user(tmp_path):
    for name, uid, gid, mode, refused in [
        ("mine", 0, 0, 0o444, None),
        ("foreign", 4242, 0, 0o444, "uid 4242"),
        ("world", 0, 0, 0o646, "every user"),
        ("nogroup", 0, 65534, 0o464, "group 65534"),  # nogroup: the primary group of nobody
    ]:
        st = _made(tmp_path / name, directory=False, uid=uid, gid=gid, mode=mode)
        why = file_refusal(st, ME)
        assert (why is None) if refused is None else (refused in (why or "")), (name, why)
    assert file_refusal(os.lstat(tmp_path / "foreign"), ME | {4242}) is None  # ADSTORE_TRUSTED_UIDS=4242
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    assert "regular" in (file_refusal(os.lstat(tmp_path / "link"), ME) or "")


@ROOT
def test_a_directory_is_safe_when_a_trusted_uid_or_root_owns_it_and_no_one_else_renames_in_it(tmp_path):
    for name, uid, gid, mode, refused in [
        ("plain", 0, 0, 0o755, False),
        ("tmp", 0, 0, 0o1777, False),  # sticky: others add entries, never rename ours
        ("open", 0, 0, 0o777, True),
        ("foreign", 4242, 0, 0o755, True),
        ("nogroup", 0, 65534, 0o775, True),
    ]:
        st = _made(tmp_path / name, directory=True, uid=uid, gid=gid, mode=mode)
        assert (dir_refusal(st, ME) is not None) is refused, name
    assert dir_refusal(os.lstat(tmp_path / "plain"), frozenset({4242})) is None  # root's: walked whoever is trusted


def test_one_trusted_set_this_user_root_and_adstore_trusted_uids():
    assert trusted_uids({}) == ME
    assert trusted_uids({"ADSTORE_TRUSTED_UIDS": "1000, 1001"}) == ME | {1000, 1001}
    assert trusted_uids({}, extra=[7]) == ME | {7}
    with pytest.raises(ConfigError):
        trusted_uids({"ADSTORE_TRUSTED_UIDS": "alice"})
