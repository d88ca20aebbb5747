"""A store on a read-only mount serves hits; every write is ``read_only``, never ``corrupt_index``.

The store is built as root, then bind-mounted read-only in a private mount
namespace (``unshare -m``; a plain bind mount, unmounted afterwards, where
namespaces are unavailable) and read by a child process
(``read_only_child.py``): as root, and as uid 1001 reading a store root baked.
A seed store (``ADSTORE_SEED``) on the read-only mount serves a writable
store's misses, and new saves go to the writable one.  A read-only mount is
read without LMDB's lock only when the store was frozen where it was built:
the same filesystem may be written elsewhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from other_users import user_argv  # tests/other_users.py

from adstore.daemon.cli import main as cli_main
from adstore.store import ReadOnlyStore, Store

CHILD = Path(__file__).with_name("read_only_child.py")
OTHER_UID = 1001

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True, check=False)
    return probe.returncode == 0


NAMESPACES = _unshare_works()


def run_on_read_only_mount(src: Path, dst: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """Bind-mount ``src`` read-only at ``dst`` and run the child there (as ``spec["uid"]``, if given); its report."""
    dst.mkdir(exist_ok=True)
    uid = spec.pop("uid", None)
    s, d = shlex.quote(str(src)), shlex.quote(str(dst))
    mount = [f"mount --bind {s} {d}", f"mount -o remount,bind,ro {d}"]
    if NAMESPACES:  # the mount lives and dies with the namespace; setpriv starts the child as ``uid``
        child = [sys.executable, str(CHILD), json.dumps({**spec, "ro": str(dst)})]
        argv = user_argv(uid, child, steps=mount, stash=dst.parent / "python-stash")
        res = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    else:  # the child imports as root, then drops to ``uid`` itself
        child = [sys.executable, str(CHILD), json.dumps({**spec, "ro": str(dst), "uid": uid})]
        subprocess.run(["sh", "-c", " && ".join(mount)], check=True)
        try:
            res = subprocess.run(child, capture_output=True, text=True, timeout=300, check=False)
        finally:
            subprocess.run(["umount", str(dst)], check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory every uid may traverse (pytest's own tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="adstore-ro-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def build(root: Path, *, frozen: bool = True) -> dict[str, dict[str, str]]:
    """A store with an inline blob, a raw file blob, a compressed file blob, and an entry of two ranks; frozen
    (``Store.freeze``) as an image build leaves it, unless ``frozen=False``."""
    artifacts = {"small": b"tiny", "random": os.urandom(300_000), "text": b"compressible kernel source\n" * 20_000}
    keys: dict[str, dict[str, str]] = {}
    with Store.open(root) as store:
        refs = {name: store.put_bytes(data) for name, data in artifacts.items()}
        store.save("a" * 64, refs, namespace="inductor", components={"torch": "2.9", "isa": "avx2"})
        keys["a" * 64] = {name: hashlib.sha256(data).hexdigest() for name, data in artifacts.items()}
        gen = store.new_generation()
        for rank in range(2):
            blob = f"rank {rank} shard".encode() * 10_000
            store.save("b" * 64, {"shard": store.put_bytes(blob)}, rank=rank, world_size=2, generation=gen)
        keys["b" * 64] = {"shard": hashlib.sha256(b"rank 0 shard" * 10_000).hexdigest()}
        if frozen:
            store.freeze()
    return keys


def test_hits_and_verified_reads_from_a_read_only_mount_and_every_write_is_read_only(shared_tmp):
    keys = build(shared_tmp / "src")
    report = run_on_read_only_mount(shared_tmp / "src", shared_tmp / "ro", {"keys": keys, "cli": True})
    assert report["read_only"] and report["lockless"]
    for reads in (report["reads"], report["again"]):
        assert reads == {k: {"hit": True, "reason": None, "intact": True} for k in keys}, reads
    assert report["writes"] == {
        "put_bytes": "ReadOnlyStore:read_only",
        "save": "ReadOnlyStore:read_only",
        "pin": "ReadOnlyStore:read_only",
        "gc": "ReadOnlyStore:read_only",
        "verify_fix": "ReadOnlyStore:read_only",
    }
    assert report["verify_ok"] and report["hits_in_memory"] == 4  # counted in memory: nothing is written
    cli = report["cli"]
    for name in ("ls", "stats", "inspect", "explain", "verify"):
        assert cli[name]["code"] == 0, (name, cli[name])
        assert "corrupt" not in cli[name]["out"] + cli[name]["err"]
    assert {e["key"] for e in json.loads(cli["ls_json"]["out"])["entries"]} == set(keys)
    assert "store is consistent" in cli["verify"]["out"] and "inductor" in cli["ls"]["out"]
    assert "torch" in cli["explain"]["out"] and "Entries        2" in cli["stats"]["out"]
    for name in ("verify_fix", "gc", "rm", "pin"):
        assert cli[name]["code"] == 15 and "read-only" in cli[name]["err"], (name, cli[name])
        assert len(cli[name]["err"].strip().splitlines()) == 1
    built = sorted(str(p.relative_to(shared_tmp / "src")) for p in (shared_tmp / "src").rglob("*"))
    assert report["files_after"] == built  # no lock file, temp file, ballast or stats file appeared


def test_another_uid_reads_a_store_root_baked(shared_tmp):
    keys = build(shared_tmp / "src")
    report = run_on_read_only_mount(shared_tmp / "src", shared_tmp / "ro", {"keys": keys, "uid": OTHER_UID})
    assert report["uid"] == OTHER_UID and report["read_only"]
    assert report["reads"] == {k: {"hit": True, "reason": None, "intact": True} for k in keys}
    assert set(report["writes"].values()) == {"ReadOnlyStore:read_only"}


def test_a_seed_store_serves_a_writable_store_and_new_saves_stay_in_the_writable_one(shared_tmp):
    keys = build(shared_tmp / "src")
    writable = shared_tmp / "home-cache"
    writable.mkdir()
    os.chown(writable, OTHER_UID, OTHER_UID)
    spec = {"keys": keys, "uid": OTHER_UID, "writable": str(writable / "adstore")}
    report = run_on_read_only_mount(shared_tmp / "src", shared_tmp / "ro", spec)
    assert report["seeded"] == {k: {"hit": True, "reason": None, "intact": True} for k in keys}, report
    assert set(report["seed_meta"].values()) == {str(shared_tmp / "ro")}
    assert report["new_in_writable"] and report["new_in_seed"] == "absent"
    assert report["counters"]["seed.hits"] == 2
    with Store.open(writable / "adstore", create=False) as store:  # the copies are the writable store's own
        assert {e.key for e in store.entries()} == {*keys, "new-key"}
        assert store.entry("a" * 64).components == {"torch": "2.9", "isa": "avx2"}
        for ref in store.manifests("a" * 64)[0].artifacts.values():
            path = store.blob_path(ref)
            assert path is None or path.stat().st_uid == OTHER_UID
    with Store.open(shared_tmp / "src", create=False) as seed:
        assert {e.key for e in seed.entries()} == set(keys)


def test_a_seed_is_another_store_and_a_missing_one_is_logged_not_raised(tmp_path, caplog):
    from adstore.store import ConfigError

    with pytest.raises(ConfigError):
        Store.open(tmp_path / "s", seed=tmp_path / "s")
    env = {"ADSTORE_ROOT": str(tmp_path / "w"), "ADSTORE_SEED": str(tmp_path / "none")}
    with Store.from_env(env) as store:
        assert store.seed is None and not store.lookup("c" * 64).hit
    assert "seed store disabled" in caplog.text


def test_an_explicitly_read_only_store_on_a_writable_disk_keeps_its_lock_and_refuses_writes(tmp_path):
    keys = build(tmp_path / "s")
    with Store.open(tmp_path / "s", read_only=True) as store:
        assert store.read_only and not store.index.lockless
        assert store.lookup("a" * 64).hit
        with pytest.raises(Exception) as info:
            store.put_bytes(b"x")
        assert getattr(info.value, "reason", None) == "read_only"
    assert keys


def test_a_seed_blob_no_trusted_user_wrote_is_not_copied(tmp_path, monkeypatch):
    keys = build(tmp_path / "seed")
    with Store.open(tmp_path / "seed", create=False) as seed:
        refs = seed.manifests("a" * 64)[0].artifacts
        path = seed.blob_path(refs["random"])
    assert path is not None
    os.chown(path, 65534, 65534)  # planted by another user
    monkeypatch.delenv("ADSTORE_TRUSTED_UIDS", raising=False)
    with Store.open(tmp_path / "w", seed=tmp_path / "seed") as store:
        missed = store.lookup("a" * 64)
        assert not missed.hit and missed.reason == "unsafe_root"
        assert store.lookup("b" * 64).hit  # the other entry's blobs are root's
        assert not store.has_blob(refs["random"]) and store.stats().counters["seed.misses.unsafe_root"] == 1
    monkeypatch.setenv("ADSTORE_TRUSTED_UIDS", "65534")
    with Store.open(tmp_path / "w2", seed=tmp_path / "seed") as store:
        assert store.lookup("a" * 64).hit
    assert keys


def test_the_seed_is_searched_before_the_remote_and_its_copies_are_not_pushed(tmp_path):
    from adstore.store.remote import MemoryBackend, Remote, Signer, TrustedKeys, generate_keypair

    keys = build(tmp_path / "seed")
    pair = generate_keypair()
    backend = MemoryBackend()
    signer, trusted = Signer.from_pem(pair.private_pem), TrustedKeys.from_pem(pair.public_pem)
    remote = Remote(backend, mode="read-write", signer=signer, trusted=trusted)
    with Store.open(tmp_path / "builder", remote=remote) as builder:  # a key only the remote has
        builder.save("c" * 64, {"x": builder.put_bytes(b"from the remote")})
    pushed = len(backend.writes())
    with Store.open(tmp_path / "w", seed=tmp_path / "seed", remote=remote) as store:
        assert store.lookup("a" * 64).hit and store.lookup("b" * 64).hit  # from the seed, no remote call
        assert len(backend.writes()) == pushed  # the copies were not pushed back
        assert not any(op == "get" for op, _ in backend.ops)
        found = store.lookup("c" * 64)  # the seed misses; the remote restores it
        assert found.hit and store.read_artifact(found.manifest, "x") == b"from the remote"
        counters = store.stats().counters
        assert counters["seed.hits"] == 2 and counters["remote.hits"] == 1
    assert keys


def test_a_local_lookup_copies_from_neither_the_seed_nor_the_remote(tmp_path):
    """``lookup(local=True)``: this store's rows only (a caller merging into what is here downloads nothing)."""
    from adstore.store.remote import MemoryBackend, Remote, Signer, TrustedKeys, generate_keypair

    build(tmp_path / "seed")
    pair = generate_keypair()
    backend = MemoryBackend()
    signer, trusted = Signer.from_pem(pair.private_pem), TrustedKeys.from_pem(pair.public_pem)
    remote = Remote(backend, mode="read-write", signer=signer, trusted=trusted)
    with Store.open(tmp_path / "builder", remote=remote) as builder:
        builder.save("c" * 64, {"x": builder.put_bytes(b"from the remote")})
    with Store.open(tmp_path / "w", seed=tmp_path / "seed", remote=remote) as store:
        for key in ("a" * 64, "c" * 64):  # the seed's, the remote's
            assert store.lookup(key, count=False, local=True).reason == "absent"
            assert store.entry(key) is None
        assert not any(op == "get" for op, _ in backend.ops)
        assert store.lookup("a" * 64).hit and store.lookup("c" * 64).hit  # without ``local``: both mend the miss
        assert store.lookup("c" * 64, local=True).hit  # and now it is here
        counters = store.stats().counters
        assert counters["seed.hits"] == 1 and counters["remote.hits"] == 1


def test_an_index_on_a_read_only_mount_under_a_writable_root_is_read_only_not_corrupt(shared_tmp):
    build(shared_tmp / "src", frozen=False)  # a writer meets its read-only index
    index = shlex.quote(str(shared_tmp / "src" / "index"))
    code = (
        "import sys; from adstore.store import Store, StoreError\n"
        "try:\n    Store.open(sys.argv[1])\nexcept StoreError as exc:\n    print(exc.reason)\n"
    )
    script = f"mount --bind {index} {index} && mount -o remount,bind,ro {index} && exec {shlex.quote(sys.executable)}"
    argv = ["sh", "-c", f"{script} -c {shlex.quote(code)} {shlex.quote(str(shared_tmp / 'src'))}"]
    if not NAMESPACES:
        pytest.skip("needs a private mount namespace (unshare -m)")
    res = subprocess.run(
        ["unshare", "-m", "--propagation", "private", *argv], capture_output=True, text=True, check=False
    )
    assert res.stdout.strip() == "read_only", res.stderr[-2000:]


def test_a_damaged_index_on_a_read_only_mount_is_still_corrupt_index(shared_tmp):
    build(shared_tmp / "src")
    data = shared_tmp / "src" / "index" / "data.mdb"
    with open(data, "r+b") as f:  # cut the file short of its last pages: a read there would be a SIGBUS
        f.truncate(data.stat().st_size // 2)
    if not NAMESPACES:
        pytest.skip("needs a private mount namespace (unshare -m)")
    src, dst = shlex.quote(str(shared_tmp / "src")), shlex.quote(str(shared_tmp / "ro"))
    (shared_tmp / "ro").mkdir()
    code = (
        "import sys; from adstore.store import Store, StoreError\n"
        "try:\n    Store.open(sys.argv[1], create=False)\nexcept StoreError as exc:\n    print(exc.reason)\n"
    )
    script = f"mount --bind {src} {dst} && mount -o remount,bind,ro {dst} && exec {shlex.quote(sys.executable)}"
    res = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", f"{script} -c {shlex.quote(code)} {dst}"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0 and res.stdout.strip() == "corrupt_index", (res.stdout, res.stderr[-2000:])


def _forge_seed_row(seed_root: Path, key: str, other: str) -> None:
    """What a group member of the seed's builder can do: rewrite ``key``'s manifest row in the seed's index,
    pointing it at ``other``'s blob with meta of its choice (ISA answers), its record left as the builder wrote it."""
    with Store.open(seed_root, create=False) as seed:
        m = seed.lookup(key).manifest
        shard = seed.lookup(other, rank=0).manifest.artifacts["shard"]
        forged = dataclasses.replace(m, artifacts={**m.artifacts, "random": shard}, meta={"isa": {"avx512": True}})
        seed._tables.write(lambda t: t.put_manifest(forged))
        assert seed.lookup(key).manifest.meta == {"isa": {"avx512": True}}  # the rows now say so


def test_a_seed_row_its_own_records_do_not_vouch_for_is_not_copied(tmp_path, monkeypatch):
    keys = build(tmp_path / "seed", frozen=False)  # a seed its builder's group may still write
    _forge_seed_row(tmp_path / "seed", "a" * 64, "b" * 64)
    monkeypatch.delenv("ADSTORE_TRUSTED_UIDS", raising=False)
    me = frozenset({os.geteuid(), 0})
    with Store.open(tmp_path / "w", seed=tmp_path / "seed") as store:
        for trusted in (me, None):  # the copy would be sealed as this user's: judged whatever the caller trusts
            missed = store.lookup("a" * 64, trusted=trusted)
            assert not missed.hit and missed.reason == "unsealed_entry", missed
        assert store.entry("a" * 64) is None and store.stats().counters["seed.misses.unsealed_entry"] == 2
        assert not any(store.has_blob(d) for d in keys["a" * 64].values())  # nothing copied
        found = store.lookup("b" * 64, trusted=me)  # the genuine entry still copies, and is sealed here
        assert found.hit and store.read_artifact(found.manifest, "shard") == b"rank 0 shard" * 10_000
        assert store.stats().counters["seed.hits"] == 1


def _open_on_read_only_mount(src: Path, dst: Path, code: str) -> str:
    """Run ``code`` (``sys.argv[1]``: the mount) in a private mount namespace where ``src`` is read-only at ``dst``."""
    if not NAMESPACES:
        pytest.skip("needs a private mount namespace (unshare -m)")
    dst.mkdir()
    s, d = shlex.quote(str(src)), shlex.quote(str(dst))
    script = f"mount --bind {s} {d} && mount -o remount,bind,ro {d} && exec {shlex.quote(sys.executable)}"
    res = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", f"{script} -c {shlex.quote(code)} {d}"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip()


def test_a_read_only_mount_of_a_store_that_is_not_frozen_is_not_read_lock_free(shared_tmp):
    """A read-only bind mount of a volume a builder still writes: a lock-free reader would read pages the
    writer reuses, so an unfrozen store that cannot be locked is refused (``unsafe_root``), and a seed of
    that kind is left out; the same store frozen is read lock-free."""
    build(shared_tmp / "src", frozen=False)
    code = (
        "import sys; from adstore.store import Store, StoreError\n"
        "try:\n    Store.open(sys.argv[1], create=False)\nexcept StoreError as exc:\n    print(exc.reason)\n"
        "env = {'ADSTORE_ROOT': sys.argv[1] + '-w', 'ADSTORE_SEED': sys.argv[1]}\n"
        "print(Store.from_env(env).seed)\n"
    )
    assert _open_on_read_only_mount(shared_tmp / "src", Path("/tmp") / f"{shared_tmp.name}-ro", code).split() == [
        "unsafe_root",
        "None",
    ]
    assert cli_main(["--root", str(shared_tmp / "src"), "freeze"]) == 0  # where it is built
    assert cli_main(["--root", str(shared_tmp / "src"), "freeze"]) == 15  # read_only: frozen already
    code = "import sys; from adstore.store import Store\ns = Store.open(sys.argv[1], create=False)\n"
    code += "print(s.read_only, s.index.lockless, s.lookup('a' * 64).hit)\n"
    assert _open_on_read_only_mount(shared_tmp / "src", shared_tmp / "ro2", code) == "True True True"


def test_a_frozen_store_opens_read_only_on_a_writable_disk_and_keeps_its_lock(tmp_path):
    build(tmp_path / "s")
    with Store.open(tmp_path / "s") as store:
        assert store.read_only and not store.index.lockless and store.lookup("a" * 64).hit
        with pytest.raises(ReadOnlyStore):
            store.put_bytes(b"x")
        with pytest.raises(ReadOnlyStore):
            store.freeze()
    (tmp_path / "s" / "FROZEN").unlink()  # thawed by whoever writes it again
    with Store.open(tmp_path / "s") as store:
        assert not store.read_only and store.put_bytes(b"x")


def test_a_seed_copy_another_process_committed_first_is_a_hit_not_a_store_error(tmp_path):
    """Two processes of one host (``torchrun``'s ranks) miss the same key and both copy it from the seed.

    The later copy's commit finds the entry committed under the seed's
    generation (``StoreError: … already committed``); seen as a miss
    ``store_error`` on a ``torchrun`` host fed by a seed
    (tests/integration/inductor/test_programs.py).  The store holds the
    entry it wanted, so the lookup is a hit.  Replayed in order here: this
    process's miss, the other process's copy, then this process's copy.
    """
    build(tmp_path / "seed")
    key = "b" * 64
    with Store.open(tmp_path / "w", seed=tmp_path / "seed") as store:
        assert store.seed is not None
        missed = store.lookup(key, count=False, local=True)  # what this process saw
        assert missed.reason == "absent"
        assert store.lookup(key).hit  # the other process copied it in first
        late = store.seed.fallback(store, key, None, missed)  # this process's copy, begun on its miss
        assert late.hit and sorted(late.manifests) == [0, 1], late
        counters = store.stats().counters
        assert not any(name.startswith("seed.misses") for name in counters), counters
