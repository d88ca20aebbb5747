"""Heavier remote-tier tests (``-m slow``): big blobs, many threads, repeated races."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest
from remote_workers import check_one_build, run_race

from adstore.store.remote import Kind, open_remote

pytestmark = pytest.mark.slow


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_a_64_mib_blob_round_trips_verified(kind, request, tmp_path):
    r = open_remote(request.getfixturevalue(f"{kind}_url"), mode="read-write", timeout=30)
    data = os.urandom(64 << 20)
    src = tmp_path / "src"
    src.write_bytes(data)
    d = digest_of(data)
    assert r.push_blob(d, len(data), src).ok
    out = r.fetch_blob(d, len(data), dest=tmp_path / "dst", fsync=True)
    assert out.ok and digest_of(out.value.read_bytes()) == d
    assert r.push_blob(d, len(data), src).value == 0


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_many_threads_share_one_remote(kind, request):
    r = open_remote(request.getfixturevalue(f"{kind}_url"), mode="read-write", timeout=30)
    errors: list[str] = []

    def work(i: int) -> None:
        for j in range(10):
            data = os.urandom(50_000 + i * 100 + j)
            d = digest_of(data)
            if not r.push_blob(d, len(data), data).ok or r.get(Kind.CAS, d).value != data:
                errors.append(f"{i}/{j}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and r.counters["blobs_up"] == 160


@pytest.mark.parametrize("round_", range(3))
@pytest.mark.parametrize("kind", ["s3", "http"])
def test_repeated_lease_races(kind, round_, request, keypair):
    check_one_build(
        run_race(
            request.getfixturevalue(f"{kind}_url"), keypair.private_pem, keypair.public_pem, n=8, build_seconds=0.2
        )
    )
