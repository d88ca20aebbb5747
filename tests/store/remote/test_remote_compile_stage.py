"""The aoti compile stage with a remote tier: a new host restores the whole start, and a fleet compiles once.

Host A (read-write, signing) compiles and pushes the prefix, the engine and
its index entry; host B (an empty root, trusting A's key) restores all three
from the remote and runs bit-identical without exporting or compiling; host
C, trusting another key, never loads A's engine and compiles its own.  Four
hosts starting one cold key at once compile it once: the cache point's
build lease covers the compile stage (docs/engine-cache.md, "One compile per fleet").
"""

from __future__ import annotations

import pytest
from remote_tier_hosts import cold_start_race, on_host, pipeline_host

from adstore.store.remote import write_keypair

pytestmark = pytest.mark.slow

MODEL = {"arch": "llama", "layers": 1, "hidden": 64}
AOTI = {"backend": "aoti"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from adstore.integration.reference.checkpoint import write_random_checkpoint
    from adstore.integration.reference.models import ModelFactory

    return str(
        write_random_checkpoint(ModelFactory.from_config(MODEL).build(), tmp_path_factory.mktemp("ckpt"), seed=1)
    )


def kinds(result):
    return [(e["kind"], e["reason"], e["source"]) for e in result["events"]]


def test_a_new_host_restores_prefix_and_engine_over_http_and_an_untrusted_key_compiles(http_url, checkpoint, tmp_path):
    private, public = write_keypair(tmp_path / "keys")
    _, other_public = write_keypair(tmp_path / "other")
    a = on_host(
        pipeline_host,
        str(tmp_path / "a"),
        checkpoint,
        {"ADSTORE_REMOTE": http_url, "ADSTORE_REMOTE_MODE": "read-write", "ADSTORE_SIGNING_KEY": str(private)},
        MODEL,
        AOTI,
    )
    assert kinds(a) == [
        ("miss", "absent", "none"),
        ("save", None, "none"),
        ("miss", "absent", "none"),
        ("save", None, "compiled"),
    ], kinds(a)
    assert a["counters"]["remote.records_up"] == 3  # the prefix, the engine, its index entry
    b = on_host(
        pipeline_host,
        str(tmp_path / "b"),
        checkpoint,
        {"ADSTORE_REMOTE": http_url, "ADSTORE_TRUSTED_KEYS": str(public)},
        MODEL,
        AOTI,
    )
    assert kinds(b) == [("hit", None, "remote"), ("hit", None, "remote")], kinds(b)
    assert b["events"][1]["transferred"] > 0 and b["output"] == a["output"]
    assert "remote.bytes_up" not in b["counters"]
    c = on_host(
        pipeline_host,
        str(tmp_path / "c"),
        checkpoint,
        {"ADSTORE_REMOTE": http_url, "ADSTORE_TRUSTED_KEYS": str(other_public)},
        MODEL,
        AOTI,
    )
    assert [e["kind"] for e in c["events"][:2]] == ["miss", "save"]  # the prefix: built (its own test's business)
    assert kinds(c)[2:] == [("miss", "untrusted_remote", "none"), ("save", None, "compiled")], kinds(c)
    assert c["counters"]["remote.misses.untrusted_remote"] >= 2  # the index entry and the engine: never loaded
    assert c["output"] == a["output"]


@pytest.mark.parametrize("backend", ["s3", "http"])
def test_four_cold_starts_of_one_key_compile_once(backend, request, checkpoint, tmp_path):
    url = request.getfixturevalue(f"{backend}_url")
    private, public = write_keypair(tmp_path / "keys")
    env = {
        "ADSTORE_REMOTE": url,
        "ADSTORE_REMOTE_MODE": "read-write",
        "ADSTORE_SIGNING_KEY": str(private),
        "ADSTORE_TRUSTED_KEYS": str(public),
        "ADSTORE_REMOTE_WAIT": "300s",
    }
    results = cold_start_race([str(tmp_path / f"h{i}") for i in range(4)], checkpoint, env, MODEL, AOTI)
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    compiled = [r for r in results if r["events"][-1]["source"] == "compiled"]
    restored = [r for r in results if [e["kind"] for e in r["events"]] == ["hit", "hit"]]
    assert len(compiled) == 1 and len(restored) == 3, [kinds(r) for r in results]
    assert kinds(compiled[0])[-2:] == [("miss", "absent", "none"), ("save", None, "compiled")]
    assert all(r["events"][1]["source"] == "remote" for r in restored)
    assert len({r["output"] for r in results}) == 1
