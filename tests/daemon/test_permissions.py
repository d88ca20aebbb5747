"""A store shared by two real unix users through a group, and roots that must be refused.

Run as root: the test creates a group and three users with ``groupadd`` /
``useradd`` (removed again at the end) and runs each user's operations in a
forked child that drops to that user with ``setgroups``/``setgid``/``setuid``
(the interpreter lives under ``/root``, which other users cannot traverse, so
``runuser python`` would not start; a forked child already has it loaded).
Each child uses the public store API (and leases, gc) on a shared root set up
as docs/configuration.md, "A store shared by several users" says: group-owned, mode ``2775``, users with umask ``002``.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from adstore.daemon.lock import InstanceLock
from adstore.store import Store, UnsafeRoot
from adstore.store.fsutil import check_root_permissions

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None, reason="needs root and useradd to create the two test users"
)


class Users:
    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.group = f"adsg{tag}"
        self.names = {"alice": f"adsa{tag}", "bob": f"adsb{tag}", "eve": f"adse{tag}"}
        subprocess.run(["groupadd", self.group], check=True, capture_output=True)
        self.gid = grp.getgrnam(self.group).gr_gid
        for role, name in self.names.items():
            cmd = ["useradd", "-M", "-s", "/usr/sbin/nologin", name]
            if role != "eve":  # eve is not in the group
                cmd[1:1] = ["-g", self.group]
            subprocess.run(cmd, check=True, capture_output=True)

    def ids(self, role: str) -> tuple[int, int]:
        pw = pwd.getpwnam(self.names[role])
        return pw.pw_uid, pw.pw_gid

    def remove(self) -> None:
        for name in self.names.values():
            subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", self.group], capture_output=True)


@pytest.fixture(scope="module")
def users():
    u = Users()
    try:
        yield u
    finally:
        u.remove()


@pytest.fixture
def shared_dir():
    base = Path(f"/tmp/adstore-perm-{uuid.uuid4().hex[:8]}")
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


_WARM: list[bool] = []


def _warm_imports() -> None:
    """Import everything the store loads lazily while we are still root (see module doc)."""
    if _WARM:
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _save(tmp, "warm", "w")
        _read(tmp, "warm")
        _verify_and_gc(tmp)
        _remove(tmp, "warm")
        _hold_lease(tmp, "warm2", 0.0)
    _WARM.append(True)


def as_user(users: Users, role: str, fn, *args, umask: int = 0o002, timeout: float = 60.0):
    """Run ``fn(*args)`` in a forked child as ``role``; returns its JSON-able result or raises."""
    _warm_imports()
    uid, gid = users.ids(role)
    groups = [gid] + ([users.gid] if role != "eve" else [])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        out: dict
        records: list[str] = []
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            os.umask(umask)

            class Grab(logging.Handler):
                def emit(self, record: logging.LogRecord) -> None:
                    records.append(record.getMessage())

            logging.getLogger("adstore").addHandler(Grab(level=logging.WARNING))
            value = fn(*args)
            out = {"ok": True, "value": value, "warnings": records}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = {
                "ok": False,
                "error": type(exc).__name__,
                "reason": getattr(exc, "reason", None),
                "message": str(exc)[:500],
                "warnings": records,
            }
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
        if time.monotonic() > deadline:
            break
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks).decode() or '{"ok": false, "error": "no result"}')


# -- operations run as the users --------------------------------------------------------------


def _save(root: str, key: str, text: str) -> dict:
    with Store.open(root, grace_period=0.0) as store:
        gen = store.new_generation()
        arts = {
            "small.json": store.put_bytes(text.encode()),
            "big.bin": store.put_bytes((text.encode() + b"\0") * (100_000 // (len(text) + 1) + 1)),
        }
        store.publish(key, generation=gen, artifacts=arts, namespace="pipeline", components={"by": os.getuid()})
        store.commit(key, generation=gen)
        return {"uid": os.getuid(), "generation": gen}


def _read(root: str, key: str) -> dict:
    with Store.open(root, grace_period=0.0) as store:
        res = store.lookup(key)
        if not res.hit:
            return {"hit": False, "reason": res.reason}
        return {
            "hit": True,
            "small": store.read_artifact(res.manifest, "small.json").decode(),
            "big_ok": store.read_artifact(res.manifest, "big.bin").startswith(
                store.read_artifact(res.manifest, "small.json")
            ),
        }


def _verify_and_gc(root: str) -> dict:
    with Store.open(root, grace_period=0.0) as store:
        rep = store.verify()
        store.plan_sweep().execute()
        return {"ok": rep.ok, "problems": rep.problems, "after": store.verify().ok}


def _remove(root: str, key: str) -> dict:
    with Store.open(root, grace_period=0.0) as store:
        plan = store.plan_remove([key])
        return {"victims": [e.key for e in plan.victims], "skipped": plan.skipped, "freed": plan.execute()}


def _hold_lease(root: str, key: str, seconds: float) -> dict:
    with Store.open(root) as store, store.lease(key):
        time.sleep(seconds)
    return {}


def _open_only(root: str) -> dict:
    Store.open(root).close()
    return {}


def _take_daemon_lock(root: str) -> dict:
    """What ``adstore daemon`` does first: take ``daemon.lock`` and record its pid."""
    with InstanceLock.acquire(Path(root)) as lock:
        st = os.stat(lock.path, follow_symlinks=False)
        return {"mode": stat.S_IMODE(st.st_mode), "pid": lock.path.read_text().strip()}


def _plant_symlink(link: str, target: str) -> dict:
    os.symlink(target, link)
    return {}


def _private_file(path: str, text: str) -> dict:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, text.encode())
    os.close(fd)
    return {}


# -- tests --------------------------------------------------------------------------------------


def _shared_root(users: Users, base: Path) -> Path:
    root = base / "store"
    root.mkdir()
    os.chown(root, 0, users.gid)
    os.chmod(root, 0o2775)
    return root


def test_two_users_share_a_group_store(users, shared_dir):
    root = _shared_root(users, shared_dir)
    a = as_user(users, "alice", _save, str(root), "from-alice", "alice was here")
    assert a["ok"], a
    b = as_user(users, "bob", _read, str(root), "from-alice")
    assert b["ok"] and b["value"] == {"hit": True, "small": "alice was here", "big_ok": True}, b
    b2 = as_user(users, "bob", _save, str(root), "from-bob", "bob too")
    assert b2["ok"], b2
    a2 = as_user(users, "alice", _read, str(root), "from-bob")
    assert a2["ok"] and a2["value"]["hit"] and a2["value"]["small"] == "bob too", a2
    # Same content saved by both users is one blob (deduplicated across users).
    a3 = as_user(users, "alice", _save, str(root), "dup", "same")
    b3 = as_user(users, "bob", _save, str(root), "dup2", "same")
    assert a3["ok"] and b3["ok"], (a3, b3)
    # Files created by either user carry the store's group (setgid) and are group-usable.
    uid_a, _ = users.ids("alice")
    uid_b, _ = users.ids("bob")
    owners = set()
    for path in root.rglob("*"):
        st = path.stat()
        owners.add(st.st_uid)
        assert st.st_gid == users.gid, (path, st.st_gid)
        if path.is_dir():
            assert st.st_mode & stat.S_IWGRP and st.st_mode & stat.S_ISGID, (path, oct(st.st_mode))
    assert {uid_a, uid_b} <= owners
    # Either user can verify and garbage-collect the other's files.
    v = as_user(users, "bob", _verify_and_gc, str(root))
    assert v["ok"] and v["value"]["ok"] and v["value"]["after"], v
    rm = as_user(users, "bob", _remove, str(root), "from-alice")
    assert rm["ok"] and rm["value"]["victims"] == ["from-alice"], rm
    gone = as_user(users, "alice", _read, str(root), "from-alice")
    assert gone["ok"] and gone["value"] == {"hit": False, "reason": "absent"}


def test_a_lease_held_by_another_users_process_is_honoured(users, shared_dir):
    root = _shared_root(users, shared_dir)
    assert as_user(users, "alice", _save, str(root), "leased", "x")["ok"]
    uid, gid = users.ids("alice")
    _warm_imports()
    pid = os.fork()
    if pid == 0:  # alice restores for a while
        try:
            os.setgroups([gid, users.gid])
            os.setgid(gid)
            os.setuid(uid)
            os.umask(0o002)
            _hold_lease(str(root), "leased", 6.0)
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with Store.open(root, check_permissions=False) as s:
                if s.stats().leases:
                    break
            time.sleep(0.1)
        rm = as_user(users, "bob", _remove, str(root), "leased")
        assert rm["ok"] and rm["value"]["victims"] == [] and rm["value"]["skipped"] == ["leased"], rm
        assert as_user(users, "bob", _read, str(root), "leased")["value"]["hit"]
    finally:
        os.waitpid(pid, 0)
    # Alice's process is gone: now bob may remove it.
    rm = as_user(users, "bob", _remove, str(root), "leased")
    assert rm["ok"] and rm["value"]["victims"] == ["leased"], rm


def test_world_writable_root_is_refused_for_every_user(users, shared_dir):
    root = shared_dir / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeRoot):
        Store.open(root)
    for role in ("alice", "eve"):
        res = as_user(users, role, _open_only, str(root))
        assert not res["ok"] and res["error"] == "UnsafeRoot" and res["reason"] == "unsafe_root", res
    # Nothing was created inside the refused root.
    assert not any(root.iterdir()), list(root.iterdir())
    # The CLI maps it to its exit code (7: root refused) with a one-line message
    # (gc would create a store; a read-only command just finds none: 13).
    out = subprocess.run(
        [sys.executable, "-m", "adstore.daemon", "--root", str(root), "gc"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 7, (out.returncode, out.stderr)
    assert "world-writable" in out.stderr and "Traceback" not in out.stderr


def test_refused_root_is_left_untouched(shared_dir):
    root = shared_dir / "open2"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeRoot):
        Store.open(root)
    assert not any(root.iterdir()), sorted(p.name for p in root.iterdir())


def test_foreign_owned_root_warns(users, shared_dir):
    root = shared_dir / "alices"
    root.mkdir()
    uid, gid = users.ids("alice")
    os.chown(root, uid, gid)
    os.chmod(root, 0o755)
    assert as_user(users, "alice", _open_only, str(root))["ok"]
    # eve (not in alice's group) gets a warning naming the owner; she cannot write anyway.
    res = as_user(users, "eve", _open_only, str(root))
    text = json.dumps(res)
    assert f"owned by uid {uid}" in text, res
    # bob shares alice's group, but the root is not group-writable: also warned.
    assert check_root_permissions(root) == []  # root itself is never warned
    res_b = as_user(users, "bob", _open_only, str(root))
    assert f"owned by uid {uid}" in json.dumps(res_b), res_b


def test_a_member_with_umask_022_does_not_lock_the_group_out(users, shared_dir):
    """A user with umask 022 creates blob directories and index files; the other member
    must still be able to save into them (the store keeps a setgid root group-writable)."""
    root = _shared_root(users, shared_dir)
    a = as_user(users, "alice", _save, str(root), "k1", "alice" * 3, umask=0o022)
    assert a["ok"], a
    # Bob writes content whose blob directory alice may have created with 0755.
    results = [as_user(users, "bob", _save, str(root), f"k{i}", f"bob {i}" * 5) for i in range(2, 12)]
    failures = [r for r in results if not r["ok"]]
    assert not failures, failures[:3]
    for i in range(2, 12):
        res = as_user(users, "alice", _read, str(root), f"k{i}", umask=0o022)
        assert res["ok"] and res["value"]["hit"], res


def test_daemon_lock_of_a_member_with_umask_077_locks_no_one_out(users, shared_dir):
    """The first daemon's lock file gets the group-shared mode whatever its umask; the next member's
    daemon (after the first stopped) takes it and records its own pid."""
    root = _shared_root(users, shared_dir)
    a = as_user(users, "alice", _take_daemon_lock, str(root), umask=0o077)
    assert a["ok"] and a["value"]["mode"] == 0o664, a
    b = as_user(users, "bob", _take_daemon_lock, str(root), umask=0o077)
    assert b["ok"] and b["value"]["mode"] == 0o664 and b["value"]["pid"].isdigit(), b
    assert a["value"]["pid"] != b["value"]["pid"]


def test_a_members_symlinked_lock_never_touches_another_users_file(users, shared_dir):
    """bob points daemon.lock at alice's private file; alice's daemon refuses (unsafe_root), the file is intact."""
    root = _shared_root(users, shared_dir)
    private = shared_dir / "alice-private"
    os.chmod(shared_dir, 0o777)  # alice may create her file beside the store
    assert as_user(users, "alice", _private_file, str(private), "alice's secret")["ok"]
    assert as_user(users, "bob", _plant_symlink, str(root / "daemon.lock"), str(private))["ok"]
    res = as_user(users, "alice", _take_daemon_lock, str(root))
    assert not res["ok"] and res["reason"] == "unsafe_root" and "symbolic link" in res["message"], res
    assert private.read_text() == "alice's secret"
