"""A save in flight is never cut by gc: its commit finds the manifest it published.

A save publishes each rank's manifest uncommitted and commits it once every
rank saved.  gc took such a manifest once it was older than the grace
period, which, at a grace period of 0 (tests, ``adstore gc --grace-period
0``) or under load (a window longer than the grace), is any save in
flight: a sweep or an eviction in another process, or the writer's own
inline eviction while it stores the next rank's blobs, deleted it, and the
commit failed with ``StoreError: no manifest to commit for k0 rank 0``.  One
of two runs of the whole suite failed that way.

A manifest names its producer (host, pid, start time, like a lease): gc
never takes an uncommitted one whose producer still runs on this host, and
takes a killed writer's once it is past the grace period.  A commit that
finds its manifest gone anyway (another host's save past the grace period,
an abort) raises :class:`ManifestGone`, which callers handle by type.
"""

from __future__ import annotations

import os

import pytest
from store_helpers import check_hit, payload, run_cli, save

from adstore.store import ManifestGone, ManualClock, OverBudget, Reason, Store, StoreError


def _publish(store: Store, key: str, *, rank: int = 0, world_size: int = 1, generation: int) -> None:
    arts = {"a0": store.put_bytes(payload(key, generation, rank, "a0", 70_000))}
    store.publish(key, rank=rank, world_size=world_size, generation=generation, artifacts=arts)


def test_gc_in_another_process_between_publish_and_commit_leaves_the_save_whole(store_root):
    """``adstore gc`` (a sweep and an eviction of everything, grace period 0) runs to its end in another
    process while this one holds a published, uncommitted manifest; the commit then succeeds."""
    with Store.open(store_root, grace_period=0.0) as store:
        save(store, "k0", sizes=(100, 70_000))  # an older generation eviction takes
        save(store, "other", sizes=(100, 70_000))
        gen = store.new_generation()
        _publish(store, "k0", generation=gen)
        out = run_cli(store_root, "gc", "--max-size", "0", "--grace-period", "0")
        assert out.returncode == 8 and "saves in flight" in out.stderr, out.stderr  # all but the save's 70 kB
        assert store.lookup("other", count=False).reason == Reason.ABSENT  # gc did run: it evicted the rest
        store.commit("k0", generation=gen)
        assert check_hit(store, "k0") and store.lookup("k0", count=False).generation == gen
        assert store.verify().ok


def test_a_writer_over_its_hard_limit_never_evicts_its_own_save_in_flight(store_root):
    """Rank 0 published, rank 1's blob does not fit: the writer's inline eviction may take only what is
    not in flight (here: nothing, the rest is pinned), so the save is refused as over budget, not cut."""
    with Store.open(store_root, grace_period=0.0, max_size=420_000) as store:
        for key in ("a", "b"):
            save(store, key, sizes=(100, 150_000))
            store.pin(key)
        gen = store.new_generation()
        _publish(store, "k0", world_size=2, generation=gen)
        with pytest.raises(OverBudget):
            _publish(store, "k0", rank=1, world_size=2, generation=gen)
        assert store.manifests("k0")[0].generation == gen  # rank 0 is still there for its save to abort
        assert store.abort("k0", generation=gen)
        store.plan_remove(["a"]).execute()  # room again: the same save goes through whole
        save(store, "k0", world_size=2, sizes=(100, 50_000))
        assert check_hit(store, "k0") and store.verify().ok


def test_a_killed_writers_manifest_is_swept_and_a_commit_without_one_is_manifest_gone(store_root):
    with Store.open(store_root, grace_period=0.0) as store:
        gen = store.new_generation()
        pid = os.fork()
        if pid == 0:  # a writer that publishes and dies before its commit
            code = 0
            try:
                _publish(store, "k0", generation=gen)
            except BaseException:  # noqa: BLE001
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert store.lookup("k0", count=False).reason == Reason.UNCOMMITTED
        plan = store.plan_sweep()
        assert plan.to_dict()["stale_manifests"] == 1
        plan.execute()
        with pytest.raises(ManifestGone) as info:
            store.commit("k0", generation=gen)
        assert isinstance(info.value, StoreError) and info.value.reason == Reason.STALE_MANIFEST
        assert str(info.value) == f"no manifest to commit for k0 rank 0 generation {gen}"
        assert store.lookup("k0", count=False).reason == Reason.ABSENT and store.verify().ok


def _gc(store: Store, what: str) -> bool:
    """Whether ``what`` (a sweep, an eviction of everything, a verify) treats ``k0``'s save as abandoned."""
    if what == "verify":
        return any(f.kind == Reason.STALE_MANIFEST and f.subject == "k0" for f in store.verify().findings)
    plan = store.plan_sweep() if what == "sweep" else store.plan_eviction(max_size=0)
    plan.execute()
    return not store.manifests("k0")


@pytest.mark.parametrize("what", ["sweep", "eviction", "verify"])
def test_a_live_publishers_manifest_is_protected_only_until_its_publish_deadline(store_root, what):
    """A publisher that lives on without committing (a server stuck after a failed abort) kept its
    manifest, and its blobs, past the budget for as long as it ran: protection ends at its deadline."""
    clock = ManualClock()
    with Store.open(store_root, grace_period=60.0, publish_timeout=600.0, clock=clock) as store:
        gen = store.new_generation()
        _publish(store, "k0", generation=gen)
        clock.advance(300)  # past the grace period, before the deadline: a save in flight
        assert not _gc(store, what)
        clock.advance(301)  # past the deadline, and this process still runs
        assert _gc(store, what)
        if what != "verify":
            with pytest.raises(ManifestGone):
                store.commit("k0", generation=gen)
            assert store.verify().ok


def test_the_publish_deadline_is_never_shorter_than_the_grace_period(store_root):
    clock = ManualClock()
    with Store.open(store_root, grace_period=600.0, publish_timeout=60.0, clock=clock) as store:
        gen = store.new_generation()
        _publish(store, "k0", generation=gen)
        clock.advance(300)  # past the publish deadline, within the grace period
        assert not _gc(store, "sweep")
        clock.advance(301)
        assert _gc(store, "sweep")


def test_the_publish_timeout_comes_from_the_environment(store_root):
    with Store.from_env({"ADSTORE_ROOT": str(store_root), "ADSTORE_PUBLISH_TIMEOUT": "2h"}) as store:
        assert store.publish_timeout == 7200.0
    with Store.open(store_root) as store:
        assert store.publish_timeout == 3600.0
