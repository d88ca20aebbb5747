"""Helpers shared by the store tests, also by those that run in spawned processes (importable by path)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from adstore.store import Store
from adstore.store.fsutil import atomic_write


def report_figures(name: str, data: dict, file: str = "faults.json") -> None:
    """Keep a suite's figures for docs/reliability.md (``bench-results/``, or ``$ADSTORE_BENCH_RESULTS``)."""
    out = Path(os.environ.get("ADSTORE_BENCH_RESULTS") or Path(__file__).resolve().parents[2] / "bench-results")
    out.mkdir(parents=True, exist_ok=True)
    path = out / file
    try:
        all_ = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        all_ = {}
    all_[name] = data
    atomic_write(path, json.dumps(all_, indent=2, default=str).encode())


def payload(key: str, generation: int, rank: int, name: str, size: int) -> bytes:
    """Self-describing content: a reader can tell which save a blob belongs to.

    The rest is pseudo-random (seeded by the head), so the store keeps it raw:
    these tests count file bytes as content bytes (compressed blobs have tests of their own).
    """
    head = f"{key}|{generation}|{rank}|{name}|".encode()
    body = random.Random(head).randbytes(max(0, size - len(head)))
    return head + body


def parse_payload(data: bytes) -> tuple[str, int, int, str]:
    key, gen, rank, name, _ = data.split(b"|", 4)
    return key.decode(), int(gen), int(rank), name.decode()


def save(store: Store, key: str, *, world_size: int = 1, sizes=(100, 70_000), shared: bytes | None = None) -> int:
    gen = store.new_generation()
    for rank in range(world_size):
        artifacts = {f"a{i}": store.put_bytes(payload(key, gen, rank, f"a{i}", size)) for i, size in enumerate(sizes)}
        if shared is not None:
            artifacts["shared"] = store.put_bytes(shared)
        store.publish(
            key, rank=rank, world_size=world_size, generation=gen, artifacts=artifacts, components={"key": key}
        )
    for rank in range(world_size):
        store.commit(key, rank=rank, generation=gen)
    return gen


def check_hit(store: Store, key: str) -> bool:
    """Lookup; on a hit, every artifact must belong to the same save. Returns hit."""
    res = store.lookup(key)
    if not res.hit:
        return False
    gens = set()
    for rank, m in res.manifests.items():
        for name, ref in m.artifacts.items():
            if name == "shared":
                continue
            k, gen, r, n = parse_payload(store.get_bytes(ref))
            assert (k, r, n) == (key, rank, name), (k, r, n, key, rank, name)
            assert gen == m.generation
            gens.add(gen)
    assert len(gens) <= 1, f"mixed generations served for {key}: {gens}"
    return True


def served_digests(store: Store, key: str) -> dict[int, dict[str, str]]:
    """The SHA-256 of every artifact ``key`` serves, by rank: what a rebuilt index must serve again."""
    res = store.lookup(key, count=False)
    assert res.hit, (key, res.reason)
    return {
        rank: {n: hashlib.sha256(store.read_artifact(m, n)).hexdigest() for n in m.artifacts}
        for rank, m in res.manifests.items()
    }


def run_cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    """``adstore --root ROOT ARGS`` in a real CLI process (what an operator runs), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "adstore.daemon", "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def worker_mixed(root: str, worker: int, seconds: float, keys: int, result_q) -> None:
    """Publish and read a mix of shared and private keys for a bounded time."""
    store = Store.open(root, grace_period=0.0)
    rng = random.Random(worker)
    ops = errors = 0
    deadline = time.monotonic() + seconds
    shared = b"S" * 100_000
    try:
        while time.monotonic() < deadline:
            key = f"shared-{rng.randrange(keys)}" if rng.random() < 0.5 else f"w{worker}-{rng.randrange(keys)}"
            if rng.random() < 0.4:
                save(store, key, world_size=rng.choice((1, 2)), shared=shared)
            else:
                check_hit(store, key)
            ops += 1
    except Exception as exc:  # reported to the parent, which fails the test
        errors += 1
        result_q.put(("error", worker, repr(exc)))
    store.close()
    result_q.put(("done", worker, ops, errors))


def writer_forever(root: str, seed: int) -> None:
    """Save entries until killed (SIGKILL from the parent)."""
    store = Store.open(root, grace_period=0.0)
    rng = random.Random(seed)
    i = 0
    while True:
        key = f"k{rng.randrange(6)}"
        save(store, key, world_size=rng.choice((1, 2)), sizes=(rng.randrange(10, 5000), rng.randrange(65_536, 400_000)))
        i += 1
        if os.environ.get("ADSTORE_TEST_EVICT") and i % 3 == 0:
            store.plan_eviction(max_size=500_000).execute()


def publish_and_exit(root: str, key: str, data: bytes, generation: int) -> None:
    """A writer that publishes ``key`` (uncommitted) and exits before its commit: what a killed save leaves."""
    with Store.open(root, grace_period=0.0) as store:
        store.publish(key, generation=generation, artifacts={"u": store.put_bytes(data)})


def gc_pass(root: str, what: str) -> None:
    """Another process's sweep or eviction of all it may take, grace period 0, a minute later by its clock."""
    with Store.open(root, grace_period=0.0, clock=lambda: time.time() + 60) as store:
        if what == "sweep":
            store.plan_sweep().execute()
        else:
            store.plan_eviction(max_size=0).execute()


def damage_inline_and_read(root: str, digest: str) -> str:
    """In another process: flip a byte of an inline blob in the index, then read it.

    The read fails verification and quarantines the blob; returns the error's class name.
    """
    store = Store.open(root, grace_period=0.0)
    key = bytes.fromhex(digest)
    with store.index.env.begin(write=True) as txn:
        db = store.index.db["blobdata"]
        data = bytearray(txn.get(key, db=db))
        data[-1] ^= 1  # in the content, after the checksum head
        txn.put(key, bytes(data), db=db)
    try:
        store.get_bytes(digest)
    except Exception as exc:
        return type(exc).__name__
    finally:
        store.close()
    return "no error"
