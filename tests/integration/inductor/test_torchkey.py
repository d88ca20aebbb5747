"""torch's source key from a per-host record: the same value torch computes, only while torch's files are unchanged.

``torch_key`` is cached once per process, so the real-torch checks run in
fresh interpreters: one records the key torch computed; another, where
torch's hashing fails, gets a record's value without hashing a file, and
tries every kind of record that must not be used first (foreign, writable
by others, malformed, for other files, a symlink).  The fingerprint's rules are checked on a small
package tree, and so is the binding: a record holds the key of the files its fingerprint describes,
with torch's ``torch_key`` replaced in this process by the same kind of cached function over that
tree, whose files a hook changes between the steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from adstore.integration.validity import torchkey

pytest.importorskip("torch")

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch._inductor.codecache as codecache
    from adstore.integration.validity import torchkey

    if sys.argv[1] == "no-hashing":  # a primed torch_key never hashes torch's files
        def refuse(*args, **kwargs):
            raise AssertionError("torch's files were hashed")
        codecache.build_code_hash = refuse
    statuses = []
    for directory in sys.argv[2:]:
        primed = torchkey.prime(directory)
        if primed.thread is not None:
            primed.thread.join()
        statuses.append(primed.status)
    try:
        key = codecache.torch_key().hex()
    except AssertionError:
        key = None
    print(json.dumps({"statuses": statuses, "key": key}))
    """
)
FAKE_KEY = "ab" * 32


def _child(mode: str, *directories: Path) -> dict[str, object]:
    argv = [sys.executable, "-c", CHILD, mode, *map(str, directories)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _record(directory: Path, damage: str = "") -> None:
    """A record of :data:`FAKE_KEY` for torch as installed here, damaged as named."""
    import torch
    from torch._inductor import codecache

    directory.mkdir()
    digest = torchkey.fingerprint(codecache._TORCH_PATH, version=torch.__version__, commit=torch.version.git_version)
    doc = {"format": 1, "fingerprint": digest, "torch_key": FAKE_KEY}
    record = directory / torchkey.RECORD
    if damage == "symlink":
        (directory / "elsewhere.json").write_text(json.dumps(doc))
        record.symlink_to(directory / "elsewhere.json")
        return
    record.write_text("{not json" if damage == "malformed" else json.dumps(doc))
    os.chmod(record, 0o664 if damage == "group_writable" else 0o644)
    if damage == "group_writable":  # a gid the group database does not know: not a private group
        os.chown(record, 0, 424242)
    elif damage == "foreign_owner":
        os.chown(record, 65534, 65534)
    elif damage == "trusted_owner":  # a uid of ADSTORE_TRUSTED_UIDS
        os.chown(record, 4242, 4242)
    elif damage == "open_directory":
        os.chmod(directory, 0o777)
    elif damage == "other_fingerprint":
        record.write_text(json.dumps({**doc, "fingerprint": "0" * 64}))


def test_the_first_process_records_the_key_torch_computed(tmp_path):
    got = _child("", tmp_path)
    assert got["statuses"] == ["recording"] and len(str(got["key"])) == 64
    assert json.loads((tmp_path / torchkey.RECORD).read_text())["torch_key"] == got["key"]


def test_only_a_trusted_record_of_this_torch_is_used_and_nothing_is_hashed_then(tmp_path, monkeypatch):
    damages = ["group_writable", "foreign_owner", "open_directory", "malformed", "other_fingerprint", "symlink"]
    for damage in damages:
        _record(tmp_path / damage, damage)
    _record(tmp_path / "good")
    _record(tmp_path / "trusted_owner", "trusted_owner")
    monkeypatch.setenv("ADSTORE_TRUSTED_UIDS", "4242")  # the store's one trusted set, read by the child
    for accepted in ("good", "trusted_owner"):
        got = _child("no-hashing", *(tmp_path / d for d in damages), tmp_path / accepted)
        assert got == {"statuses": ["recording"] * len(damages) + ["primed"], "key": FAKE_KEY}, accepted


def _package(root: Path) -> Path:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "include").mkdir()
    (root / "pkg" / "__pycache__").mkdir()
    for name in ("pkg/__init__.py", "pkg/a.py", "pkg/sub/__init__.py", "pkg/sub/b.py"):
        (root / name).write_text(f"# {name}\n")
    (root / "pkg" / "include" / "x.py").write_text("# not a package: torch_key never reads it\n")
    (root / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"written at import")
    (root / "pkg" / "notes.txt").write_text("not a module")
    return root / "pkg"


def test_the_fingerprint_follows_the_module_files_torch_key_reads(tmp_path):
    pkg = _package(tmp_path)
    base = torchkey.fingerprint(pkg, version="1", commit="c")
    assert torchkey.fingerprint(pkg, version="1", commit="c") == base
    (pkg / "include" / "x.py").write_text("changed outside any package")
    (pkg / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"bytecode")
    (pkg / "notes.txt").write_text("changed")
    assert torchkey.fingerprint(pkg, version="1", commit="c") == base
    assert torchkey.fingerprint(pkg, version="2", commit="c") != base
    assert torchkey.fingerprint(pkg, version="1", commit="d") != base


@pytest.mark.parametrize("change", ["edit_same_size", "touch_back", "new_module", "replace"])
def test_any_change_to_a_module_file_changes_the_fingerprint(tmp_path, change):
    pkg = _package(tmp_path)
    target = pkg / "sub" / "b.py"
    base = torchkey.fingerprint(pkg)
    before = os.stat(target)
    if change == "edit_same_size":
        target.write_text(target.read_text().upper())
    elif change == "touch_back":  # same size, mtime set back: the change time still moves
        target.write_text(target.read_text().upper())
        os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    elif change == "new_module":
        (pkg / "sub" / "c.py").write_text("")
    else:
        (pkg / "sub" / "new.py").write_text(target.read_text())
        os.replace(pkg / "sub" / "new.py", target)
    assert torchkey.fingerprint(pkg) != base


def _tree_key(root: Path) -> bytes:
    """What the stand-in ``torch_key`` computes: a hash of the tree's module files as they are now."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.digest()


def _stand_in(monkeypatch, root: Path, while_hashing=lambda: None):
    """torch's ``torch_key`` over ``root`` instead of torch: the same process cache, ``while_hashing`` run first."""
    from torch._inductor import codecache
    from torch.utils._functools import prefetchable_cache

    def torch_key() -> bytes:
        while_hashing()
        return _tree_key(root)

    cached = prefetchable_cache(torch_key)
    monkeypatch.setattr(codecache, "torch_key", cached)
    monkeypatch.setattr(codecache, "_TORCH_PATH", str(root))
    return cached


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)
    path.chmod(0o700)
    return path


@pytest.mark.parametrize("first", ["computed", "primed"])
def test_a_late_enable_records_the_key_of_the_files_as_they_are_not_the_one_this_process_has(
    tmp_path, monkeypatch, first
):
    """torch_key known in this process (computed, or primed by an earlier enable), then torch changes, then enable()."""
    pkg, records = _package(tmp_path), _private_dir(tmp_path / "inductor")
    torch_key = _stand_in(monkeypatch, pkg)
    if first == "computed":
        torch_key()
    else:
        primed = torchkey.prime(records)
        assert primed.status == "recording" and primed.thread is not None
        primed.thread.join()
    held = torch_key()  # the value this process keeps, of the files as they were
    (pkg / "sub" / "b.py").write_text("# torch upgraded while this process ran\n")
    late = torchkey.prime(records)
    assert late.status == "recording" and late.thread is not None
    late.thread.join()
    recorded = bytes.fromhex(json.loads((records / torchkey.RECORD).read_text())["torch_key"])
    assert recorded == _tree_key(pkg) != held

    def refuse() -> None:
        raise AssertionError("the next process hashed the files")

    after = _stand_in(monkeypatch, pkg, while_hashing=refuse)  # the next process, on the files as they are
    assert torchkey.prime(records).status == "primed" and after() == _tree_key(pkg)


def test_files_that_change_while_the_key_is_computed_are_no_record(tmp_path, monkeypatch):
    pkg, records = _package(tmp_path), _private_dir(tmp_path / "inductor")

    def upgrade() -> None:  # between the fingerprint (before the key) and the hashing
        (pkg / "sub" / "b.py").write_text("# changed while torch_key was computed\n")

    torch_key = _stand_in(monkeypatch, pkg, while_hashing=upgrade)
    primed = torchkey.prime(records)
    assert primed.status == "recording" and primed.thread is not None
    primed.thread.join()
    assert not (records / torchkey.RECORD).exists()
    assert torch_key() == _tree_key(pkg)  # torch computes its own, nothing was given to it


def test_the_recording_process_hashes_torchs_files_once(tmp_path, monkeypatch):
    """The thread's value is given to torch: adstore's own first ask waits for it rather than hashing again."""
    pkg, records = _package(tmp_path), _private_dir(tmp_path / "inductor")
    hashed: list[int] = []
    torch_key = _stand_in(monkeypatch, pkg, while_hashing=lambda: hashed.append(1))
    assert torchkey.prime(records).status == "recording"
    torchkey.wait_recorded()
    assert torch_key() == _tree_key(pkg) and len(hashed) == 1
