"""The Inductor-files bundle: a directory tree round-trips; a hostile or damaged bundle writes nothing."""

from __future__ import annotations

import hashlib
import json
import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adstore.integration.engine import bundle
from adstore.integration.errors import CorruptEngine, TruncatedEngine


def tree(root, files):
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def listing(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def forge(files, *, payload=None):
    """A well-formed bundle whose header lists ``files`` ([path, size, sha256]) exactly as given."""
    header = json.dumps({"format": 1, "files": files}).encode()
    payload = payload if payload is not None else b""
    digest = hashlib.sha256(header + payload).digest()
    return struct.pack(">8sQQ32s", b"ADSTREE1", len(header), len(payload), digest) + header + payload


def test_a_tree_round_trips_and_links_are_left_out(tmp_path):
    src = tree(
        tmp_path / "src",
        {"fz/c1.main.so": b"\x7fELF" + bytes(100), "fxgraph/q4/f/y": b"pickle", "top.py": b"print(1)", "empty": b""},
    )
    (src / "link").symlink_to("/etc/passwd")
    blob = bundle.pack(src)
    dest = tmp_path / "dest"
    dest.mkdir()
    assert bundle.unpack(blob, dest) == 4
    assert listing(dest) == {k: v for k, v in listing(src).items() if k != "link"}
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in dest.rglob("*") if p.is_file())


@settings(max_examples=30, deadline=None)
@given(
    st.dictionaries(
        st.lists(
            st.from_regex(r"[a-z0-9_][a-z0-9._-]{0,8}", fullmatch=True).filter(lambda p: p not in (".", "..")),
            min_size=1,
            max_size=3,
        ).map("/".join),
        st.binary(max_size=64),
        max_size=8,
    )
)
def test_any_tree_round_trips(tmp_path_factory, files):
    paths = sorted(files)
    if any(a != b and b.startswith(a + "/") for a in paths for b in paths):
        return  # a file cannot also be a directory
    src = tree(tmp_path_factory.mktemp("src"), files)
    dest = tmp_path_factory.mktemp("dest")
    assert bundle.unpack(bundle.pack(src), dest) == len(files)
    assert listing(dest) == {k: files[k] for k in sorted(files)}


@pytest.mark.parametrize(
    "path",
    [
        "../escape",
        "/etc/passwd",
        "a/../../b",
        "a//b",
        ".",
        "a/./b",
        "x\\y",
        "",
        "a/" * 20 + "b",
        "nul\x00byte",
        ".hidden/../x",
    ],
)
def test_paths_that_leave_the_directory_are_refused_before_anything_is_written(tmp_path, path):
    data = b"code"
    blob = forge(
        [["ok.py", 4, hashlib.sha256(data).hexdigest()], [path, 4, hashlib.sha256(data).hexdigest()]],
        payload=data + data,
    )
    with pytest.raises(CorruptEngine):
        bundle.unpack(blob, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_damaged_bundles_are_refused_and_write_nothing(tmp_path):
    src = tree(tmp_path / "src", {"a/b.so": bytes(range(256)) * 4, "c.py": b"x = 1"})
    blob = bundle.pack(src)
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(TruncatedEngine):
        bundle.unpack(blob[:-10], dest)
    with pytest.raises(TruncatedEngine):
        bundle.unpack(blob[:20], dest)
    with pytest.raises(CorruptEngine):
        bundle.unpack(blob + b"x", dest)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 1
    with pytest.raises(CorruptEngine):
        bundle.unpack(bytes(flipped), dest)
    with pytest.raises(CorruptEngine):
        bundle.unpack(b"NOTATREE" + blob[8:], dest)
    good = hashlib.sha256(b"abc").hexdigest()
    for files, payload in [
        ([["a", 3, good], ["a", 3, good]], b"abcabc"),  # listed twice
        ([["a", 3, good], ["a/b", 3, good]], b"abcabc"),  # a file that is also a directory
        ([["a", 4, good]], b"abc"),  # sizes do not add up
        ([["a", 3, "0" * 64]], b"abc"),  # content does not match its digest
        ([["a", -3, good]], b""),  # negative size
        ([["a", 3]], b"abc"),  # malformed entry
        ([["a", True, good]], b"a"),  # a bool is not a size
    ]:
        with pytest.raises(CorruptEngine):
            bundle.unpack(forge(files, payload=payload), dest)
    assert list(dest.iterdir()) == []


def test_an_existing_file_or_link_in_the_destination_is_never_written_through(tmp_path):
    blob = bundle.pack(tree(tmp_path / "src", {"d/f": b"new"}))
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "d").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CorruptEngine):
        bundle.unpack(blob, dest)
    os.unlink(dest / "d")
    (dest / "d").mkdir()
    (dest / "d" / "f").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        bundle.unpack(blob, dest)
    assert (dest / "d" / "f").read_bytes() == b"old"
