"""EntryFlights: the one lease helper Inductor's, aot_compile's and vLLM's entries take after a miss.

Stores of one process stand for hosts on one in-memory remote; time is
injected (a fake clock that moves when the code under test sleeps).
"""

from __future__ import annotations

import logging

import pytest

from adstore.integration.coordination.flights import MIN_WAIT, EntryFlights
from adstore.store import Store
from adstore.store.remote import (
    ConditionalWrites,
    Kind,
    MemoryBackend,
    Remote,
    RemoteUnavailable,
    lease_address,
    record_address,
)
from adstore.store.remote.singleflight import Lease

KEY = "ab" * 32


class FakeTime:
    def __init__(self) -> None:
        self.now = 50_000.0
        self.hooks: list = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for hook in list(self.hooks):
            hook()


@pytest.fixture
def ft():
    return FakeTime()


def host(tmp_path, name, backend, ft, mode="read-write"):
    store = Store.open(tmp_path / name, remote=Remote(backend, mode=mode))
    return EntryFlights(store, clock=ft.clock, wall=ft.clock, sleep=ft.sleep, settle=0.0)


def test_the_first_miss_leads_the_next_waits_then_hits(tmp_path, ft):
    backend = MemoryBackend()
    a, b = host(tmp_path, "a", backend, ft), host(tmp_path, "b", backend, ft)
    assert a.after_miss(KEY, "inductor_fx_graph") is False  # lead: compile
    assert backend.head(Kind.AC, lease_address(KEY)) is not None

    def publish() -> None:  # a's save reaches the remote (its record), then a releases
        if ft.now > 50_003 and not ft.hooks[1:]:
            backend.put(Kind.AC, record_address(KEY, 0), b"record")
            a.built(KEY, "inductor_fx_graph")
            ft.hooks.append(None)

    ft.hooks.append(publish)
    assert b.after_miss(KEY, "inductor_fx_graph") is True  # look again: a hit
    assert backend.head(Kind.AC, lease_address(KEY)) is None
    counters = b.store.tier.remote.counters
    assert counters["flight.follower"] == 1 and counters["flight.ready"] == 1 and counters["flight.waited_ms"] >= 3000
    a.store.flush()
    got = a.store.stats().counters
    assert got["remote.flight.compiles.inductor_fx_graph"] == 1 and got["remote.flight.compile_ms.inductor_fx_graph"]


def test_a_dead_builder_is_taken_over_after_its_lease_expires(tmp_path, ft, monkeypatch):
    monkeypatch.setenv("ADSTORE_FLIGHT_TTL", "2s")
    backend = MemoryBackend()
    dead = Lease(KEY, _holder(), ft.now, ft.now + 2)
    backend.put(Kind.AC, lease_address(KEY), dead.encode())
    b = host(tmp_path, "b", backend, ft)
    assert b.after_miss(KEY, "inductor_fx_graph") is False  # took it over: compile here
    assert ft.now - 50_000 >= 2  # not before the lease expired
    lease = Lease.decode(backend.get(Kind.AC, lease_address(KEY)))
    assert lease is not None and lease.holder.nonce != "dead"
    assert b.store.tier.remote.counters["flight.takeovers"] == 1
    b.built(KEY, "inductor_fx_graph")
    assert backend.head(Kind.AC, lease_address(KEY)) is None


def _holder():
    from adstore.store.remote.singleflight import Holder

    return Holder("another-host", 1, 1.0, "dead")


def test_the_wait_is_bounded_by_the_recorded_compile_time(tmp_path, ft, monkeypatch):
    monkeypatch.setenv("ADSTORE_FLIGHT_WAIT", "10m")
    backend = MemoryBackend()
    b = host(tmp_path, "b", backend, ft)
    assert b.wait_for("inductor_fx_graph") == 600  # nothing recorded: the cap
    b.store.count({"remote.flight.compile_ms.inductor_fx_graph": 40_000, "remote.flight.compiles.inductor_fx_graph": 2})
    b.store.flush()
    assert b.wait_for("inductor_fx_graph") == 80.0  # 4x the mean
    assert b.wait_for("vllm_tree") == 600
    b.store.count({"remote.flight.compile_ms.aot": 10, "remote.flight.compiles.aot": 1})
    b.store.flush()
    assert b.wait_for("aot") == MIN_WAIT
    backend.put(Kind.AC, lease_address(KEY), Lease(KEY, _holder(), ft.now, ft.now + 10_000).encode())  # a live lease
    start = ft.now
    assert b.after_miss(KEY, "inductor_fx_graph") is False  # the wait ran out: compile here, without the lease
    assert ft.now - start == pytest.approx(80.0, abs=1.0)
    assert b.store.tier.remote.counters["flight.single_flight_timeout"] == 1


@pytest.mark.parametrize("why", ["read", "no_conditional_create", "down"])
def test_no_lease_where_the_remote_cannot_hold_one_said_once(tmp_path, ft, why, caplog):
    from adstore.integration.coordination import flights

    flights._said.clear()

    class Plain(MemoryBackend):
        conditional_writes = ConditionalWrites.NONE

    backend = Plain() if why == "no_conditional_create" else MemoryBackend()
    h = host(tmp_path, "h", backend, ft, mode="read" if why == "read" else "read-write")
    if why == "down":
        backend.fail = RemoteUnavailable("refused")
    with caplog.at_level(logging.INFO, logger="adstore.integration.coordination.flights"):
        assert h.after_miss(KEY, "inductor_fx_graph") is False
        assert h.after_miss("cd" * 32, "inductor_fx_graph") is False
    assert len(backend.writes()) == (why == "down") and ft.now == 50_000.0  # down: the one try that found it down
    assert len([r for r in caplog.records if "no single-flight lease" in r.getMessage()]) == 1
