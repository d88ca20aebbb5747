"""One contract for every backend: S3 (moto_server), HTTP (wsgidav) and memory.

get / get_to / put / head / put_if_absent / delete on both kinds, file and
bytes bodies, bounded downloads, missing objects, and digests validated
before anything is sent.
"""

from __future__ import annotations

import hashlib
import io
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adstore.store import InvalidDigest
from adstore.store.remote import Kind, RemoteChecksumMismatch, open_remote


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_put_get_head_round_trip(writer):
    b = writer.backend
    data = os.urandom(1000)
    d = digest_of(data)
    assert b.head(Kind.CAS, d) is None
    assert b.put(Kind.CAS, d, data) == 1000
    assert b.head(Kind.CAS, d) == 1000
    assert b.get(Kind.CAS, d) == data
    buf = io.BytesIO()
    assert b.get_to(Kind.CAS, d, buf, 1000) == 1000
    assert buf.getvalue() == data


def test_missing_objects_are_none(writer):
    b = writer.backend
    d = digest_of(b"never stored")
    for kind in Kind:
        assert b.get(kind, d) is None
        assert b.head(kind, d) is None
        assert b.get_to(kind, d, io.BytesIO(), 10) is None
        b.delete(kind, d)  # deleting nothing is fine


def test_kinds_are_separate_namespaces(writer):
    b = writer.backend
    d = digest_of(b"x")
    b.put(Kind.AC, d, b"a record")
    assert b.get(Kind.CAS, d) is None
    assert b.get(Kind.AC, d) == b"a record"


def test_put_replaces_and_delete_removes(writer):
    b = writer.backend
    d = digest_of(b"name")
    b.put(Kind.AC, d, b"one")
    b.put(Kind.AC, d, b"two, longer")
    assert b.get(Kind.AC, d) == b"two, longer"
    b.delete(Kind.AC, d)
    assert b.head(Kind.AC, d) is None


def test_file_bodies_stream_both_ways(writer, tmp_path):
    data = os.urandom((5 << 20) // 2)  # several transfer chunks
    d = digest_of(data)
    src = tmp_path / "src"
    src.write_bytes(data)
    with open(src, "rb") as f:
        assert writer.backend.put(Kind.CAS, d, f) == len(data)
    with open(tmp_path / "dst", "wb") as f:
        assert writer.backend.get_to(Kind.CAS, d, f, len(data)) == len(data)
    assert (tmp_path / "dst").read_bytes() == data


def test_get_to_never_writes_past_max_bytes(writer):
    data = os.urandom(300_000)
    d = digest_of(data)
    writer.backend.put(Kind.CAS, d, data)
    buf = io.BytesIO()
    with pytest.raises(RemoteChecksumMismatch) as info:
        writer.backend.get_to(Kind.CAS, d, buf, 1000)
    assert len(buf.getvalue()) <= 1000 and info.value.got_digest is None


def test_put_if_absent_creates_once(writer):
    b = writer.backend
    d = digest_of(b"lease name")
    assert b.put_if_absent(Kind.AC, d, b"first") is True
    assert b.put_if_absent(Kind.AC, d, b"second") is False
    assert b.get(Kind.AC, d) == b"first"


@pytest.mark.parametrize(
    "bad", ["", "abc", "A" * 64, "g" * 64, "../" + "a" * 61, "a" * 63 + "/", 42, None, "a" * 64 + "\n"]
)
def test_digests_are_validated_before_anything_is_sent(remote_url, bad):
    r = open_remote(remote_url, mode="read-write", timeout=2)
    b = r.backend
    for call in (
        lambda: b.get(Kind.CAS, bad),
        lambda: b.head(Kind.AC, bad),
        lambda: b.put(Kind.CAS, bad, b"x"),
        lambda: b.put_if_absent(Kind.AC, bad, b"x"),
        lambda: b.delete(Kind.CAS, bad),
        lambda: b.get_to(Kind.CAS, bad, io.BytesIO(), 1),
    ):
        with pytest.raises(InvalidDigest):
            call()
    # the public layer turns it into an outcome, and nothing reached the server
    assert r.get(Kind.CAS, bad).reason == "bad_digest"
    assert not any(k.startswith("calls.") for k in r.counters)


def test_remote_get_verifies_blobs(writer):
    data = b"the real content"
    d = digest_of(data)
    writer.backend.put(Kind.CAS, d, b"other bytes")  # the server holds something else under d
    out = writer.get(Kind.CAS, d)
    assert out.reason == "remote_checksum" and out.value is None
    writer.backend.put(Kind.CAS, d, data)
    assert writer.get(Kind.CAS, d).value == data


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=3000))
def test_round_trip_any_bytes(writer, data):
    d = digest_of(data)
    assert writer.put(Kind.CAS, d, data).ok
    got = writer.get(Kind.CAS, d)
    assert got.ok and got.value == data and writer.head(Kind.CAS, d).value == len(data)


def test_s3_large_file_bodies_go_up_in_parts(s3_url, tmp_path):
    """Above the multipart threshold a file is a multipart upload (one PUT takes at most 5 GiB)."""
    r = open_remote(s3_url, mode="read-write", multipart_threshold=1 << 20)
    data = os.urandom(3 << 20)
    src = tmp_path / "big"
    src.write_bytes(data)
    assert r.push_blob(digest_of(data), len(data), src).nbytes == len(data)
    assert r.fetch_blob(digest_of(data), len(data), dest=tmp_path / "back").value.read_bytes() == data


def test_http_credentials_in_the_url_become_basic_auth_and_leave_the_url(dav_server):
    r = open_remote(dav_server.endpoint.replace("http://", "http://user:s%40cret@") + "/auth")
    assert "cret" not in r.url and "user" not in r.url
    assert r.backend._headers["Authorization"] == "Basic dXNlcjpzQGNyZXQ="
    assert r.head(Kind.CAS, digest_of(b"x")).ok  # the anonymous test server ignores it
