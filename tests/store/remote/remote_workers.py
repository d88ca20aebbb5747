"""Code the single-flight race runs in spawned processes (importable by name)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid

from adstore.store.remote import Signer, SingleFlight, TrustedKeys, open_remote


def race(url: str, key: str, barrier, out, build_seconds: float, private_pem: bytes, public_pem: bytes) -> None:
    """One host starting the cold ``key``: lead (build, publish, release) or follow (wait, restore)."""
    r = open_remote(
        url, mode="read-write", timeout=5, signer=Signer.from_pem(private_pem), trusted=TrustedKeys.from_pem(public_pem)
    )
    flight_ctl = SingleFlight(r, settle=0.5, poll_min=0.05, poll_max=0.2)  # settle: the test servers check-then-write
    barrier.wait(60)
    flight = flight_ctl.acquire(key, ttl=30)
    if flight.leader:
        time.sleep(build_seconds)  # the build
        published = r.push_record(key, 0, {"built_by": os.getpid()})
        flight_ctl.release(flight)
        out.put(("leader", os.getpid(), published.ok, None))
    elif flight.role == "follower":
        waited = flight_ctl.wait(flight, ready=lambda: r.fetch_record(key, 0).ok, timeout=30)
        record = r.fetch_record(key, 0)
        out.put(("follower", os.getpid(), waited.ready, record.value.payload["built_by"] if record.ok else None))
    else:
        out.put(("solo", os.getpid(), False, flight.reason))


def run_race(url: str, private_pem: bytes, public_pem: bytes, *, n: int = 8, build_seconds: float = 0.5) -> list:
    """Start ``n`` spawned processes on one cold key at once; their ``(role, pid, ok, detail)`` results."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    key = f"cold-{uuid.uuid4().hex[:8]}"
    procs = [
        ctx.Process(target=race, args=(url, key, barrier, out, build_seconds, private_pem, public_pem))
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=90) for _ in range(n)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def check_one_build(results: list) -> None:
    """Exactly one leader published; every other process waited for it and restored its record."""
    leaders = [r for r in results if r[0] == "leader"]
    followers = [r for r in results if r[0] == "follower"]
    assert len(leaders) == 1 and leaders[0][2], results
    assert len(followers) == len(results) - 1, results
    assert all(f[2] and f[3] == leaders[0][1] for f in followers), results
