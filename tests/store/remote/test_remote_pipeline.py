"""The pipeline cache with a remote tier: two spawned "hosts" with separate roots share one remote.

Host A (read-write, signing) misses, saves and pushes; host B (read, an
empty root, trusting A's key) hits from ``remote`` with outputs
bit-identical to A's; a third host that trusts no key misses
``untrusted_remote`` and builds (README, "Remote tier").
"""

from __future__ import annotations

import pytest
from remote_tier_hosts import on_host, pipeline_host

from adstore.store.remote import write_keypair

MODEL = {"arch": "llama", "layers": 1, "hidden": 64}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from adstore.integration.reference.checkpoint import write_random_checkpoint
    from adstore.integration.reference.models import ModelFactory

    return str(write_random_checkpoint(ModelFactory.from_config(MODEL).build(), tmp_path_factory.mktemp("ckpt"),
                                       seed=1))


def cache_events(result):
    return [e for e in result["events"] if e["kind"] in ("hit", "miss", "save", "bypass")]


@pytest.mark.parametrize("backend", ["s3", "http"])
def test_host_b_hits_from_the_remote_with_bit_identical_outputs(backend, request, checkpoint, tmp_path):
    url = request.getfixturevalue(f"{backend}_url")
    private, public = write_keypair(tmp_path / "keys")
    other_private, other_public = write_keypair(tmp_path / "other")
    a = on_host(pipeline_host, str(tmp_path / "a"), checkpoint,
                {"ADSTORE_REMOTE": url, "ADSTORE_REMOTE_MODE": "read-write", "ADSTORE_SIGNING_KEY": str(private)},
                MODEL)
    ea = cache_events(a)
    assert [e["kind"] for e in ea] == ["miss", "save"], ea
    assert ea[0]["reason"] == "absent"
    assert a["counters"]["remote.records_up"] == 1 and a["counters"]["remote.bytes_up"] > 0
    b = on_host(pipeline_host, str(tmp_path / "b"), checkpoint,
                {"ADSTORE_REMOTE": url, "ADSTORE_TRUSTED_KEYS": str(public)}, MODEL)
    eb = cache_events(b)
    assert [e["kind"] for e in eb] == ["hit"], eb
    assert eb[0]["source"] == "remote" and eb[0]["transferred"] > 0
    assert b["output"] == a["output"]
    assert b["counters"]["remote.hits"] == 1 and "remote.bytes_up" not in b["counters"]
    c = on_host(pipeline_host, str(tmp_path / "c"), checkpoint,
                {"ADSTORE_REMOTE": url, "ADSTORE_TRUSTED_KEYS": str(other_public)}, MODEL)
    ec = cache_events(c)
    assert [e["kind"] for e in ec] == ["miss", "save"], ec
    assert c["output"] == a["output"] and c["counters"]["remote.misses.untrusted_remote"] == 1
