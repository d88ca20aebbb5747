"""Helper processes for the daemon tests (run as scripts, never imported by pytest).

    python procs.py write ROOT --count N --size BYTES --prefix P [--world-size W] [--delay S]
    python procs.py lease ROOT KEY        # holds a lease until killed; prints "leased"
    python procs.py read ROOT [--seconds S]   # leased lookups + reads; prints counts as JSON

Each writer is a separate OS process using the public store API, like a real
pipeline rank would.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

from adstore.store import Store


def key_for(prefix: str, i: int) -> str:
    return hashlib.sha256(f"{prefix}-{i}".encode()).hexdigest()


def write(root: str, *, count: int, size: int, prefix: str, world_size: int, delay: float, grace_period: float) -> None:
    """Save ``count`` entries.  With a zero grace period a daemon may sweep a blob
    between its put and its publish (the grace period is what protects that
    window): such a save fails with ``BlobMissing``, is counted as lost, and the
    writer goes on, as a pipeline would.  With any other grace period it is an error."""
    from adstore.store import BlobMissing

    store = Store.open(root, grace_period=grace_period)
    lost = 0
    for i in range(count):
        key = key_for(prefix, i)
        gen = store.new_generation()
        try:
            for rank in range(world_size):
                ref = store.put_bytes(os.urandom(size))
                store.publish(
                    key,
                    rank=rank,
                    world_size=world_size,
                    generation=gen,
                    artifacts={"module.pt": ref},
                    namespace="pipeline",
                    components={"model": {"prefix": prefix, "i": i}, "dist": {"world": world_size}},
                )
            for rank in range(world_size):
                store.commit(key, rank=rank, generation=gen)
        except BlobMissing:
            if grace_period > 0:
                raise
            lost += 1
        if delay:
            time.sleep(delay)
    store.close()
    print(f"wrote {count - lost}, lost {lost} to a sweep inside the zero grace period", flush=True)


def lease(root: str, key: str) -> None:
    store = Store.open(root)
    with store.lease(key):
        print("leased", flush=True)
        while True:
            time.sleep(3600)


def read(root: str, seconds: float) -> None:
    """Lease, look up and read entries while the daemon evicts; report what happened as JSON.

    Under a lease a hit must stay readable: a missing or corrupt blob there is a failure.
    """
    import json

    from adstore.store.errors import AdstoreError

    store = Store.open(root)
    counts = {"hits": 0, "misses": 0, "read_errors": 0, "errors": []}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        keys = [e.key for e in store.entries()]
        for key in keys[-5:]:  # the newest: most likely to be hit while the oldest go
            with store.lease(key):
                res = store.lookup(key, count=False)
                if not res.hit:
                    counts["misses"] += 1
                    continue
                counts["hits"] += 1
                try:
                    store.read_artifact(res.manifest, "module.pt")
                except AdstoreError as exc:
                    counts["read_errors"] += 1
                    counts["errors"].append(str(exc))
        time.sleep(0.01)
    store.close()
    print(json.dumps(counts), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("root")
    w.add_argument("--count", type=int, required=True)
    w.add_argument("--size", type=int, required=True)
    w.add_argument("--prefix", required=True)
    w.add_argument("--world-size", type=int, default=1)
    w.add_argument("--delay", type=float, default=0.0)
    w.add_argument("--grace-period", type=float, default=3600.0)
    rd = sub.add_parser("read")
    rd.add_argument("root")
    rd.add_argument("--seconds", type=float, default=3.0)
    le = sub.add_parser("lease")
    le.add_argument("root")
    le.add_argument("key")
    a = p.parse_args()
    if a.cmd == "write":
        write(
            a.root,
            count=a.count,
            size=a.size,
            prefix=a.prefix,
            world_size=a.world_size,
            delay=a.delay,
            grace_period=a.grace_period,
        )
    elif a.cmd == "read":
        read(a.root, a.seconds)
    else:
        lease(a.root, a.key)


if __name__ == "__main__":
    sys.exit(main())
