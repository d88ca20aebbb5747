"""A read that fails for a reason other than damage leaves the blob alone.

Only proof of damage quarantines a blob: content that does not hash to its
digest, a file the codec rejects, something that is not a regular file.  A
read that runs out of file descriptors, or may not open the file, is a
:class:`StoreError` carrying the errno, and the next read, once the cause is
gone, serves the same bytes.  Each fault is real: ``RLIMIT_NOFILE`` lowered
in a child process, a file this uid may not read (a child that drops root).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from adstore.store import Store


def compressible(size: int, seed: int = 0) -> bytes:
    rnd = random.Random(seed)
    words = [b"node_%d(" % i for i in range(2000)]
    return b" ".join(rnd.choices(words, k=size // 8 + 1))[:size]


@pytest.fixture
def stored(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A store with a 1 MiB blob kept compressed and one kept raw; their digests by name."""
    root = tmp_path / "store"
    digests = {}
    with Store.open(root, grace_period=0.0) as store:
        for name, data in (("zstd", compressible(1 << 20)), ("raw", random.Random(1).randbytes(1 << 20))):
            ref = store.put_bytes(data)
            row = store.stored_blob(ref)
            assert row is not None and row.encoding == name
            digests[name] = ref.digest
    return root, digests


CHILD = textwrap.dedent(
    """
    import hashlib, json, os, resource, sys
    from adstore.store import Store
    from adstore.store.errors import StoreError

    root, digests, how = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    out = {}
    with Store.open(root) as store:
        for name, digest in digests.items():
            held = []
            if how in ("emfile", "verify"):
                soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
                try:
                    while True:
                        held.append(os.open(os.devnull, os.O_RDONLY))
                except OSError:
                    pass
            elif how == "eacces":
                os.setresuid(65534, 65534, 0)  # a reader that may not open the file (and back, to report)
            try:
                if how == "verify":
                    report = store.verify(fix=True)
                    first = {"error": None, "problems": report.problems}
                else:
                    store.get_bytes(digest)
                    first = {"error": None}
            except (StoreError, OSError) as exc:
                first = {"error": type(exc).__name__, "errno": getattr(exc, "errno", None)}
            finally:
                for fd in held:
                    os.close(fd)
                if how in ("emfile", "verify"):
                    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                elif how == "eacces":
                    os.setresuid(0, 0, 0)
            if how != "verify":  # the cause gone, the same process reads the same blob
                first["again"] = hashlib.sha256(store.get_bytes(digest)).hexdigest() == digest
            out[name] = first
    print(json.dumps(out))
    """
)


def _quarantined(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "quarantine").iterdir()) if (root / "quarantine").exists() else []


def _served_again(root: Path, digests: dict[str, str]) -> None:
    with Store.open(root) as store:
        for digest in digests.values():
            assert hashlib.sha256(store.get_bytes(digest)).hexdigest() == digest
            assert store.has_blob(digest)


@pytest.mark.parametrize(("how", "errno_name"), [("emfile", "EMFILE"), ("eacces", "EACCES")])
def test_a_read_that_fails_without_damage_keeps_the_blob(stored, how, errno_name):
    root, digests = stored
    if how == "eacces":
        if os.geteuid() != 0:
            pytest.skip("needs root to play a reader of another uid")
        for digest in digests.values():
            os.chmod(root / "blobs" / digest[:2] / digest, 0)
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), json.dumps(digests), how], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    for name in digests:
        assert got[name]["error"] == "BlobUnreadable", got  # a StoreError, neither damage nor a raw OSError
        assert got[name]["errno"] == getattr(errno, errno_name), got
        assert got[name]["again"] is True, got
    assert _quarantined(root) == []
    if how == "eacces":
        for digest in digests.values():
            os.chmod(root / "blobs" / digest[:2] / digest, 0o444)
    _served_again(root, digests)


def test_verify_fix_out_of_descriptors_quarantines_nothing(stored):
    """``verify --fix`` that cannot open a blob file reports it and leaves it: not damage."""
    root, digests = stored
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), json.dumps({"zstd": digests["zstd"]}), "verify"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert _quarantined(root) == []
    _served_again(root, digests)


REBUILD_CHILD = textwrap.dedent(
    """
    import json, os, resource, sys
    from adstore.store.errors import StoreError
    from adstore.store.layout import Layout
    from adstore.store.records.rebuild import plan_rebuild

    from pathlib import Path

    plan = plan_rebuild(Layout(Path(sys.argv[1])), "test: a damaged index")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    try:
        plan.execute()
        out = {"error": None}
    except (StoreError, OSError) as exc:
        out = {"error": type(exc).__name__, "errno": getattr(exc, "errno", None)}
    for fd in held:
        os.close(fd)
    print(json.dumps(out))
    """
)


def test_a_rebuild_that_cannot_read_a_blob_changes_nothing(stored):
    """A rebuild that cannot read a blob file now stops before it moves the index: had it gone on, the
    blob would be left unregistered, its entries lost, and the file swept later as an orphan."""
    root, digests = stored
    with Store.open(root) as store:
        ref = store.put_bytes(compressible(200_000, seed=3))
        store.save("k", {"a": ref}, components={})
    before = sorted(str(p.relative_to(root)) for p in (root / "blobs").rglob("*") if p.is_file())
    res = subprocess.run([sys.executable, "-c", REBUILD_CHILD, str(root)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["error"] == "BlobUnreadable" and got["errno"] == errno.EMFILE, got
    assert (root / "index" / "data.mdb").is_file() and _quarantined(root) == []  # the index was not moved aside
    assert sorted(str(p.relative_to(root)) for p in (root / "blobs").rglob("*") if p.is_file()) == before
    with Store.open(root) as store:
        assert store.lookup("k").hit
