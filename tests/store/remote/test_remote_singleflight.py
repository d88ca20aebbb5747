"""Single-flight builds: one leader per cold key, bounded waits, fail open.

The protocol runs on the memory backend with a fake clock; the race runs 8
spawned processes against the real S3 and WebDAV servers.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from remote_workers import check_one_build, run_race

from adstore.store.remote import (
    Kind,
    MemoryBackend,
    NotSupported,
    Remote,
    RemoteUnavailable,
    SingleFlight,
    lease_address,
)
from adstore.store.remote.singleflight import Holder, Lease


class FakeTime:
    """A clock that only moves when the code under test sleeps; hooks run at each sleep."""

    def __init__(self) -> None:
        self.now = 10_000.0
        self.sleeps: list[float] = []
        self.hooks: list = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        for hook in self.hooks:
            hook()


@pytest.fixture
def ft():
    return FakeTime()


def flights(backend, ft, *, mode="read-write", settle=0.0, **kw):
    return SingleFlight(Remote(backend, mode=mode), clock=ft.clock, sleep=ft.sleep, settle=settle, **kw)


def put_lease(backend, key, *, holder=None, expires=None, now=10_000.0):
    holder = holder or Holder("elsewhere", 1, 1.0, "n")
    backend.put(Kind.AC, lease_address(key), Lease(key, holder, now, expires or now + 60).encode())


def test_first_leads_the_rest_follow_and_the_leader_releases(memory, ft):
    a, b = flights(memory, ft), flights(memory, ft)
    lead = a.acquire("k", ttl=60)
    follow = b.acquire("k", ttl=60)
    assert (lead.role, follow.role) == ("leader", "follower")
    assert follow.lease.holder.nonce == lead.lease.holder.nonce
    assert a.release(lead) and memory.head(Kind.AC, lease_address("k")) is None
    assert b.acquire("k").role == "leader"


def test_a_follower_restores_once_the_record_appears(memory, ft):
    a, b = flights(memory, ft), flights(memory, ft)
    lead = a.acquire("k")
    follow = b.acquire("k")
    published = []
    ft.hooks.append(lambda: len(ft.sleeps) == 4 and published.append(True))
    res = b.wait(follow, ready=lambda: bool(published), timeout=60)
    assert res.ready and res.reason is None and len(ft.sleeps) == 4
    assert ft.sleeps == [0.05, 0.1, 0.2, 0.4]  # backoff
    a.release(lead)


def test_the_wait_is_bounded(memory, ft):
    a, b = flights(memory, ft, poll_max=1.0), flights(memory, ft, poll_max=1.0)
    a.acquire("k", ttl=600)
    res = b.wait(b.acquire("k"), ready=lambda: False, timeout=5)
    assert not res.ready and res.reason == "single_flight_timeout"
    assert sum(ft.sleeps) == pytest.approx(5) and max(ft.sleeps) <= 1.0


def test_a_released_lease_without_a_record_sends_followers_to_build(memory, ft):
    a, b = flights(memory, ft), flights(memory, ft)
    lead = a.acquire("k")
    follow = b.acquire("k")
    a.release(lead)  # the build failed
    res = b.wait(follow, ready=lambda: False, timeout=60)
    assert (res.ready, res.reason) == (False, "builder_gone") and ft.sleeps == []


def test_expired_dead_and_undecodable_leases_are_taken_over(memory, ft):
    sf = flights(memory, ft, clock_skew=5)
    put_lease(memory, "expired", expires=ft.now - 6)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # a pid that no longer runs (or, if reused, with another start time)
    put_lease(memory, "dead", holder=Holder(Holder.me().host, proc.pid, 1.0, "n"))
    memory.put(Kind.AC, lease_address("garbage"), b"\x00not a lease")
    for key in ("expired", "dead", "garbage"):
        assert sf.acquire(key).role == "leader", key
    assert sf.remote.counters["flight.takeovers"] == 3
    put_lease(memory, "skewed", expires=ft.now - 4)  # within the clock skew: still live
    assert sf.acquire("skewed").role == "follower"


def test_a_follower_notices_its_leader_expire(memory, ft):
    a, b = flights(memory, ft), flights(memory, ft, clock_skew=0)
    lead = a.acquire("k", ttl=2)
    res = b.wait(b.acquire("k"), ready=lambda: False, timeout=60)
    assert res.reason == "builder_gone" and ft.now - 10_000.0 < 4
    assert lead.leader


def test_a_lease_lost_to_a_racing_writer_makes_a_follower(memory, ft):
    sf = flights(memory, ft, settle=0.1)
    ft.hooks.append(lambda: put_lease(memory, "k", holder=Holder("other", 2, 2.0, "theirs")))
    flight = sf.acquire("k")
    assert flight.role == "follower" and flight.reason == "lost_race" and flight.lease.holder.nonce == "theirs"


def test_without_put_if_absent_the_lease_is_best_effort(ft):
    class Plain(MemoryBackend):
        def put_if_absent(self, kind, digest, data):
            raise NotSupported("Plain", "put_if_absent")

    backend = Plain()
    a, b = flights(backend, ft), flights(backend, ft)
    assert a.acquire("k").role == "leader"
    assert b.acquire("k").role == "follower"


def test_a_down_remote_means_build_alone(memory, ft):
    memory.fail = RemoteUnavailable("refused")
    flight = flights(memory, ft).acquire("k")
    assert flight.role == "solo" and flight.reason == "remote_unavailable"


def test_read_only_clients_follow_but_never_lease(memory, ft):
    reader = flights(memory, ft, mode="read")
    assert reader.acquire("k").role == "solo"
    put_lease(memory, "k", now=ft.now)
    assert reader.acquire("k").role == "follower"
    assert memory.writes() == [("put", f"ac/{lease_address('k')}")]  # the test's own


def test_release_leaves_a_lease_taken_over_by_another(memory, ft):
    sf = flights(memory, ft)
    lead = sf.acquire("k")
    put_lease(memory, "k", holder=Holder("other", 2, 2.0, "theirs"))
    assert not sf.release(lead) and memory.head(Kind.AC, lease_address("k")) is not None


def test_heartbeat_renews_a_long_build(memory):
    sf = SingleFlight(Remote(memory, mode="read-write"), settle=0)
    lead = sf.acquire("k", ttl=60, heartbeat=0.05)
    first = lead.lease.expires
    deadline = time.monotonic() + 5
    while lead.lease.expires == first and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lead.lease.expires > first
    sf.release(lead)
    assert memory.head(Kind.AC, lease_address("k")) is None


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_eight_processes_racing_for_one_cold_key_build_once(kind, request, keypair):
    results = run_race(request.getfixturevalue(f"{kind}_url"), keypair.private_pem, keypair.public_pem, n=8)
    check_one_build(results)


def test_a_server_that_ignores_if_none_match_still_gets_one_leader(ft):
    """bazel-remote answers 200 to every PUT: acquirers look for a live lease first."""
    from adstore.store.remote import ConditionalWrites

    class Ignores(MemoryBackend):
        conditional_writes = ConditionalWrites.SERVER_DEPENDENT

        def put_if_absent(self, kind, digest, data):
            self.put(kind, digest, data)
            return True

    backend = Ignores()
    a, b = flights(backend, ft), flights(backend, ft)
    lead = a.acquire("k")
    assert lead.role == "leader" and b.acquire("k").role == "follower"
    assert backend.get(Kind.AC, lease_address("k")) == lead.lease.encode()


def test_one_waiter_takes_over_a_dead_builder_and_the_others_follow_it(memory, ft):
    a, b, c = (flights(memory, ft, clock_skew=0) for _ in range(3))
    a.acquire("k", ttl=2)  # the builder, then nothing: it died without releasing
    follow_b, follow_c = b.acquire("k"), c.acquire("k")
    took = b.wait(follow_b, ready=lambda: False, timeout=60, take_over=True, ttl=30)
    assert (took.ready, took.reason) == (False, "builder_gone") and took.flight is not None and took.flight.leader
    published = []
    ft.hooks.append(lambda: len(ft.sleeps) >= 6 and published.append(True))  # b publishes while c waits on it
    waited = c.wait(follow_c, ready=lambda: bool(published), timeout=60, take_over=True, ttl=30)
    assert waited.ready and waited.flight is None
    assert (b.remote.counters["flight.takeovers"], c.remote.counters.get("flight.takeovers")) == (1, None)
    assert b.remote.counters["flight.waited_ms"] >= 2000 and c.remote.counters["flight.ready"] == 1


def test_a_takeover_race_leaves_one_leader(memory, ft):
    a, b, c = (flights(memory, ft, clock_skew=0) for _ in range(3))
    a.acquire("k", ttl=2)
    ft.now += 3  # expired
    first = b.acquire("k", ttl=30)
    second = c.acquire("k", ttl=30)
    assert (first.role, second.role) == ("leader", "follower") and second.lease.holder == first.lease.holder
    assert b.remote.counters["flight.takeovers"] == 1 and "flight.takeovers" not in c.remote.counters


def test_a_takeover_is_counted_by_the_waiter_that_leads_even_when_another_removed_the_dead_lease(memory, ft):
    a, b = flights(memory, ft, clock_skew=0), flights(memory, ft, clock_skew=0)
    a.acquire("k", ttl=2)
    follow = b.acquire("k")
    ft.hooks.append(lambda: ft.now > 10_002 and memory.delete(Kind.AC, lease_address("k")))  # another waiter's delete
    took = b.wait(follow, ready=lambda: False, timeout=60, take_over=True, ttl=30)
    assert took.flight is not None and took.flight.leader and b.remote.counters["flight.takeovers"] == 1
