"""The pipeline cache with a remote tier: two spawned "hosts" with separate roots share one remote.

Host A (read-write, signing) misses, saves and pushes; host B (read, an
empty root, trusting A's key) hits from ``remote`` with outputs
bit-identical to A's; a third host that trusts no key misses
``untrusted_remote`` and builds (docs/remote.md, "Trust and keys").
"""

from __future__ import annotations

import pytest
from remote_tier_hosts import cold_start_race, dist_hosts_race, dist_rank_host, on_host, pipeline_host

from adstore.store.remote import write_keypair

MODEL = {"arch": "llama", "layers": 1, "hidden": 64}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from adstore.integration.reference.checkpoint import write_random_checkpoint
    from adstore.integration.reference.models import ModelFactory

    return str(
        write_random_checkpoint(ModelFactory.from_config(MODEL).build(), tmp_path_factory.mktemp("ckpt"), seed=1)
    )


def cache_events(result):
    return [e for e in result["events"] if e["kind"] in ("hit", "miss", "save", "bypass")]


@pytest.mark.parametrize("backend", ["s3", "http"])
def test_host_b_hits_from_the_remote_with_bit_identical_outputs(backend, request, checkpoint, tmp_path):
    url = request.getfixturevalue(f"{backend}_url")
    private, public = write_keypair(tmp_path / "keys")
    other_private, other_public = write_keypair(tmp_path / "other")
    a = on_host(
        pipeline_host,
        str(tmp_path / "a"),
        checkpoint,
        {"ADSTORE_REMOTE": url, "ADSTORE_REMOTE_MODE": "read-write", "ADSTORE_SIGNING_KEY": str(private)},
        MODEL,
    )
    ea = cache_events(a)
    assert [e["kind"] for e in ea] == ["miss", "save"], ea
    assert ea[0]["reason"] == "absent"
    assert a["counters"]["remote.records_up"] == 1 and a["counters"]["remote.bytes_up"] > 0
    b = on_host(
        pipeline_host,
        str(tmp_path / "b"),
        checkpoint,
        {"ADSTORE_REMOTE": url, "ADSTORE_TRUSTED_KEYS": str(public)},
        MODEL,
    )
    eb = cache_events(b)
    assert [e["kind"] for e in eb] == ["hit"], eb
    assert eb[0]["source"] == "remote" and eb[0]["transferred"] > 0
    assert b["output"] == a["output"]
    assert b["counters"]["remote.hits"] == 1 and "remote.bytes_up" not in b["counters"]
    c = on_host(
        pipeline_host,
        str(tmp_path / "c"),
        checkpoint,
        {"ADSTORE_REMOTE": url, "ADSTORE_TRUSTED_KEYS": str(other_public)},
        MODEL,
    )
    ec = cache_events(c)
    assert [e["kind"] for e in ec] == ["miss", "save"], ec
    assert c["output"] == a["output"] and c["counters"]["remote.misses.untrusted_remote"] == 1


@pytest.mark.slow
def test_two_ranks_over_gloo_restore_their_own_records(http_url, checkpoint, tmp_path):
    """World size 2: each rank of host A pushes its record; each rank of host B restores its own, then they agree."""
    from adstore.integration.reference.demo import run_ranks

    private, public = write_keypair(tmp_path / "keys")
    model = MODEL

    def job(host: str, env: dict[str, str]) -> dict:
        return {
            "env": {"ADSTORE_REMOTE": http_url, **env},
            "checkpoint": checkpoint,
            "model": model,
            "roots": [str(tmp_path / f"{host}{r}") for r in range(2)],
        }

    a = sorted(
        run_ranks(
            job("a", {"ADSTORE_REMOTE_MODE": "read-write", "ADSTORE_SIGNING_KEY": str(private)}),
            2,
            target=dist_rank_host,
            timeout=600,
        ),
        key=lambda r: r["rank"],
    )
    assert all("error" not in r for r in a), a
    for r in a:
        assert [e["kind"] for e in cache_events(r)] == ["miss", "save"], r["events"]
        assert r["counters"]["remote.records_up"] == 1
    b = sorted(
        run_ranks(job("b", {"ADSTORE_TRUSTED_KEYS": str(public)}), 2, target=dist_rank_host, timeout=600),
        key=lambda r: r["rank"],
    )
    assert all("error" not in r for r in b), b
    for ra, rb in zip(a, b, strict=True):
        eb = cache_events(rb)
        assert [(e["kind"], e["source"]) for e in eb] == [("hit", "remote")], eb
        assert rb["output"] == ra["output"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["s3", "http"])
def test_eight_cold_starts_of_one_key_build_once(backend, request, checkpoint, tmp_path):
    """Single-flight: 8 hosts (own roots, read-write) start one cold key at once: 1 build, 7 remote hits."""
    url = request.getfixturevalue(f"{backend}_url")
    private, public = write_keypair(tmp_path / "keys")
    env = {
        "ADSTORE_REMOTE": url,
        "ADSTORE_REMOTE_MODE": "read-write",
        "ADSTORE_SIGNING_KEY": str(private),
        "ADSTORE_TRUSTED_KEYS": str(public),
        "ADSTORE_REMOTE_WAIT": "120s",
    }
    results = cold_start_race([str(tmp_path / f"h{i}") for i in range(8)], checkpoint, env, MODEL)
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    kinds = sorted(tuple(e["kind"] for e in cache_events(r)) for r in results)
    assert kinds.count(("miss", "save")) == 1 and kinds.count(("hit",)) == 7, kinds
    hits = [e for r in results for e in cache_events(r) if e["kind"] == "hit"]
    assert all(e["source"] == "remote" for e in hits)
    assert len({r["output"] for r in results}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["s3", "http"])
def test_two_hosts_of_two_gloo_ranks_race_on_one_key_one_builds(backend, request, checkpoint, tmp_path):
    """Single-flight at world size 2: rank 0 of each host leads or follows for its host (broadcast over gloo);
    one host builds on both ranks, the other waits and restores both ranks from the remote."""
    url = request.getfixturevalue(f"{backend}_url")
    private, public = write_keypair(tmp_path / "keys")
    env = {
        "ADSTORE_REMOTE": url,
        "ADSTORE_REMOTE_MODE": "read-write",
        "ADSTORE_SIGNING_KEY": str(private),
        "ADSTORE_TRUSTED_KEYS": str(public),
        "ADSTORE_REMOTE_WAIT": "300s",
    }
    jobs = [
        {"env": env, "checkpoint": checkpoint, "model": MODEL, "roots": [str(tmp_path / f"{h}{r}") for r in range(2)]}
        for h in ("x", "y")
    ]
    hosts = dist_hosts_race(jobs, 2)
    assert all("error" not in r for host in hosts for r in host), [r.get("error") for host in hosts for r in host]
    kinds = [[tuple(e["kind"] for e in cache_events(r)) for r in host] for host in hosts]
    builders = [h for h, k in enumerate(kinds) if k == [("miss", "save"), ("miss", "save")]]
    restorers = [h for h, k in enumerate(kinds) if k == [("hit",), ("hit",)]]
    assert len(builders) == 1 and len(restorers) == 1, kinds
    built, restored = hosts[builders[0]], hosts[restorers[0]]
    assert all(e["source"] == "remote" for r in restored for e in cache_events(r))
    assert [r["output"] for r in restored] == [r["output"] for r in built]
    assert built[0]["counters"].get("remote.flight.leader") == 1, built[0]["counters"]
    assert restored[0]["counters"].get("remote.flight.follower") == 1, restored[0]["counters"]
    assert "remote.flight.leader" not in built[1]["counters"]  # only rank 0 takes the lease


@pytest.mark.slow
def test_a_rank_whose_remote_cannot_open_makes_no_rank_hang(http_url, checkpoint, tmp_path):
    """Rank 1's key file is missing, so its remote is off: the ranks still make the same collectives,
    both build, and only rank 0 pushes (a remote is a miss at worst, never a hang or a crash)."""
    private, public = write_keypair(tmp_path / "keys")
    env = {
        "ADSTORE_REMOTE": http_url,
        "ADSTORE_REMOTE_MODE": "read-write",
        "ADSTORE_SIGNING_KEY": str(private),
        "ADSTORE_TRUSTED_KEYS": str(public),
    }
    job = {
        "env": env,
        "checkpoint": checkpoint,
        "model": MODEL,
        "roots": [str(tmp_path / f"r{r}") for r in range(2)],
        "rank_env": {1: {"ADSTORE_TRUSTED_KEYS": str(tmp_path / "missing.pub")}},
    }
    (ranks,) = dist_hosts_race([job], 2, timeout=600)
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    assert [[e["kind"] for e in cache_events(r)] for r in ranks] == [["miss", "save"], ["miss", "save"]]
    assert ranks[0]["counters"].get("remote.records_up") == 1 and "remote.records_up" not in ranks[1]["counters"]
