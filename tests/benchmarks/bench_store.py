"""Store benchmark: adstore vs diskcache and the physical floor, in one run.

    python tests/benchmarks/bench_store.py [--quick] [--big-mib 256]

Prints a table with ratios and writes bench-results/store.json.  Every
figure is compared against a baseline measured in the same run:

* small-blob put/get latency (4 KiB) vs diskcache.Cache set/get;
* key -> manifest lookup latency vs a diskcache get of the same manifest
  (steady state: both after one warm-up pass over the keys);
* 1 MiB and big-blob put/get throughput vs a plain file copy (the floor of a
  put: read + write + fsync) and a plain read + SHA-256 (the floor of a
  verified get);
* re-putting a stored blob vs hashing it alone;
* lookups from 8 concurrent reader processes vs diskcache under the same load.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import diskcache
from bench_results import results_dir

from adstore.store import Store


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def timed(fn, n: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t)
    return out


def us(x: float) -> str:
    return f"{x * 1e6:.1f} µs"


def small_blobs(store: Store, dc: diskcache.Cache, n: int) -> dict:
    datas = [os.urandom(4096) for _ in range(n)]
    put_a = timed(lambda i: store.put_bytes(datas[i]), n)
    refs = [store.put_bytes(d) for d in datas]
    put_d = timed(lambda i: dc.set(f"b{i}", datas[i]), n)
    get_a = timed(lambda i: store.get_bytes(refs[i]), n)
    get_d = timed(lambda i: dc.get(f"b{i}"), n)
    return {
        "put_p50_us": pct(put_a, 0.5) * 1e6,
        "put_p99_us": pct(put_a, 0.99) * 1e6,
        "dc_put_p50_us": pct(put_d, 0.5) * 1e6,
        "dc_put_p99_us": pct(put_d, 0.99) * 1e6,
        "get_p50_us": pct(get_a, 0.5) * 1e6,
        "get_p99_us": pct(get_a, 0.99) * 1e6,
        "dc_get_p50_us": pct(get_d, 0.5) * 1e6,
        "dc_get_p99_us": pct(get_d, 0.99) * 1e6,
        "get_speedup_vs_diskcache": pct(get_d, 0.5) / pct(get_a, 0.5),
    }


def populate(store: Store, dc: diskcache.Cache, n: int) -> list[str]:
    keys = []
    for i in range(n):
        key = hashlib.sha256(f"entry{i}".encode()).hexdigest()
        gen = store.new_generation()
        arts = {"module.pt": store.put_bytes(os.urandom(1000)), "hooks.json": store.put_bytes(b"[]")}
        store.publish(key, generation=gen, artifacts=arts, namespace="pipeline", components={"i": i})
        store.commit(key, generation=gen)
        dc.set(key, {n: (r.digest, r.size) for n, r in arts.items()} | {"generation": gen, "committed": True})
        keys.append(key)
    return keys


def saves(store: Store, n: int) -> dict:
    """The cost of one save, one rank: put two small blobs, publish, commit (each step timed).

    What a cache point pays after its snapshot is serialised; ``commit`` is
    the step the one-fsync-per-commit budget is about (docs/operations.md, "Damage and repair").
    """
    put_t, pub_t, com_t, total_t = [], [], [], []
    for i in range(n):
        key = hashlib.sha256(f"save{i}".encode()).hexdigest()
        gen = store.new_generation()
        t0 = time.perf_counter()
        arts = {"module.pt": store.put_bytes(os.urandom(1000)), "hooks.json": store.put_bytes(b"[]")}
        t1 = time.perf_counter()
        store.publish(key, generation=gen, artifacts=arts, namespace="pipeline", components={"i": i})
        t2 = time.perf_counter()
        store.commit(key, generation=gen)
        t3 = time.perf_counter()
        put_t.append(t1 - t0)
        pub_t.append(t2 - t1)
        com_t.append(t3 - t2)
        total_t.append(t3 - t0)
    return {
        "save_p50_us": pct(total_t, 0.5) * 1e6,
        "save_p99_us": pct(total_t, 0.99) * 1e6,
        "put_p50_us": pct(put_t, 0.5) * 1e6,
        "publish_p50_us": pct(pub_t, 0.5) * 1e6,
        "commit_p50_us": pct(com_t, 0.5) * 1e6,
        "commit_p99_us": pct(com_t, 0.99) * 1e6,
    }


def lookups(store: Store, dc: diskcache.Cache, keys: list[str], n: int) -> dict:
    """Steady state: one untimed pass over every key warms both (page cache, decoders).

    Also without the lookup memo (every lookup re-checks its blob rows), the
    measurement behind keeping it.
    """
    bare = Store.open(store.root, memoize_lookups=False)
    for key in keys:
        store.lookup(key)
        bare.lookup(key)
        dc.get(key)
    la = timed(lambda i: store.lookup(keys[i % len(keys)]), n)
    lb = timed(lambda i: bare.lookup(keys[i % len(keys)]), n)
    ld = timed(lambda i: dc.get(keys[i % len(keys)]), n)
    bare.close()
    return {
        "lookup_p50_us": pct(la, 0.5) * 1e6,
        "lookup_p99_us": pct(la, 0.99) * 1e6,
        "lookup_no_memo_p50_us": pct(lb, 0.5) * 1e6,
        "lookup_no_memo_p99_us": pct(lb, 0.99) * 1e6,
        "dc_lookup_p50_us": pct(ld, 0.5) * 1e6,
        "dc_lookup_p99_us": pct(ld, 0.99) * 1e6,
    }


def floor_copy(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def floor_read_hash(path: Path) -> str:
    with open(path, "rb", buffering=0) as f:
        return hashlib.sha256(f.read()).hexdigest()


def throughput(store: Store, work: Path, size: int, reps: int) -> dict:
    mib = size / (1 << 20)
    put_a, put_f, get_a, get_f, reput, hash_only = [], [], [], [], [], []
    for r in range(reps):
        src = work / f"src{r}"
        src.write_bytes(os.urandom(size))
        t = time.perf_counter()
        floor_copy(src, work / f"copy{r}")
        put_f.append(time.perf_counter() - t)
        t = time.perf_counter()
        ref = store.put_file(src)
        put_a.append(time.perf_counter() - t)
        t = time.perf_counter()
        floor_read_hash(work / f"copy{r}")
        get_f.append(time.perf_counter() - t)
        t = time.perf_counter()
        store.get_bytes(ref)
        get_a.append(time.perf_counter() - t)
        t = time.perf_counter()
        hashlib.sha256(src.read_bytes()).hexdigest()
        hash_only.append(time.perf_counter() - t)
        t = time.perf_counter()
        store.put_file(src)
        reput.append(time.perf_counter() - t)
        for p in (src, work / f"copy{r}"):
            p.unlink()
    m = statistics.median
    return {
        "size_mib": mib,
        "put_mib_s": mib / m(put_a),
        "floor_copy_mib_s": mib / m(put_f),
        "put_vs_floor": m(put_a) / m(put_f),
        "get_verified_mib_s": mib / m(get_a),
        "floor_read_hash_mib_s": mib / m(get_f),
        "get_vs_floor": m(get_a) / m(get_f),
        "reput_s": m(reput),
        "hash_only_s": m(hash_only),
        "reput_vs_hash": m(reput) / m(hash_only),
    }


def _reader(kind: str, root: str, keys: list[str], seconds: float, q) -> None:
    if kind == "adstore":
        store = Store.open(root)
        fn = store.lookup
    else:
        dc = diskcache.Cache(root)
        fn = dc.get
    lat = []
    deadline = time.perf_counter() + seconds
    i = 0
    while (t := time.perf_counter()) < deadline:
        fn(keys[i % len(keys)])
        lat.append(time.perf_counter() - t)
        i += 1
    q.put((len(lat), pct(lat, 0.5), pct(lat, 0.99)))


def concurrent(root: str, dc_root: str, keys: list[str], procs: int, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    out = {}
    for kind, r in (("adstore", root), ("diskcache", dc_root)):
        q = ctx.Queue()
        ps = [ctx.Process(target=_reader, args=(kind, r, keys, seconds, q)) for _ in range(procs)]
        for p in ps:
            p.start()
        res = [q.get() for _ in ps]
        for p in ps:
            p.join()
        out[kind] = {
            "ops_per_s": sum(n for n, _, _ in res) / seconds,
            "p50_us": statistics.median(p50 for _, p50, _ in res) * 1e6,
            "p99_us": max(p99 for _, _, p99 in res) * 1e6,
        }
    out["throughput_ratio"] = out["adstore"]["ops_per_s"] / out["diskcache"]["ops_per_s"]
    return out


def _print_saves(sv: dict) -> None:
    print(
        f"save (1 rank, 2 small blobs) p50 {us(sv['save_p50_us'] / 1e6)} p99 {us(sv['save_p99_us'] / 1e6)}: "
        f"puts {us(sv['put_p50_us'] / 1e6)}, publish {us(sv['publish_p50_us'] / 1e6)}, "
        f"commit {us(sv['commit_p50_us'] / 1e6)} (p99 {us(sv['commit_p99_us'] / 1e6)})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples, 64 MiB big blob")
    ap.add_argument("--big-mib", type=int, default=256)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--saves-only", action="store_true", help="only the save rows (put + publish + commit)")
    args = ap.parse_args(argv)
    n = 500 if args.quick else 3000
    big = 64 if args.quick else args.big_mib
    with tempfile.TemporaryDirectory(dir=os.environ.get("ADSTORE_BENCH_DIR")) as tmp:
        work = Path(tmp)
        store = Store.open(work / "adstore")
        dc = diskcache.Cache(str(work / "diskcache"))
        res: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
        res["save"] = saves(store, 200 if args.quick else 1000)
        if args.saves_only:
            store.close()
            dc.close()
            _print_saves(res["save"])
            (results_dir() / "store_saves.json").write_text(json.dumps(res, indent=2))
            return 0
        res["small"] = small_blobs(store, dc, n)
        keys = populate(store, dc, 1000 if args.quick else 5000)
        store.flush()
        res["lookup"] = lookups(store, dc, keys, n * 4)
        res["1mib"] = throughput(store, work, 1 << 20, 5 if args.quick else 20)
        res["big"] = throughput(store, work, big << 20, 2 if args.quick else 3)
        store.flush()
        res["concurrent"] = concurrent(
            str(work / "adstore"), str(work / "diskcache"), keys, args.procs, 2.0 if args.quick else 5.0
        )
        store.close()
        dc.close()
    s, lk, c = res["small"], res["lookup"], res["concurrent"]
    _print_saves(res["save"])
    rows = [
        (
            "small put p50 (4 KiB)",
            us(s["put_p50_us"] / 1e6),
            us(s["dc_put_p50_us"] / 1e6),
            f"{s['dc_put_p50_us'] / s['put_p50_us']:.2f}x faster",
        ),
        (
            "small get p50 (4 KiB)",
            us(s["get_p50_us"] / 1e6),
            us(s["dc_get_p50_us"] / 1e6),
            f"{s['get_speedup_vs_diskcache']:.2f}x faster (target ≥ 3x)",
        ),
        ("small get p99", us(s["get_p99_us"] / 1e6), us(s["dc_get_p99_us"] / 1e6), ""),
        ("lookup p50", us(lk["lookup_p50_us"] / 1e6), us(lk["dc_lookup_p50_us"] / 1e6), "target < 20 µs"),
        ("lookup p99", us(lk["lookup_p99_us"] / 1e6), us(lk["dc_lookup_p99_us"] / 1e6), ""),
        (
            "lookup p50 without the memo",
            us(lk["lookup_no_memo_p50_us"] / 1e6),
            us(lk["lookup_p50_us"] / 1e6) + " (with)",
            f"{lk['lookup_no_memo_p50_us'] / lk['lookup_p50_us']:.2f}x the memo's time",
        ),
    ]
    for name in ("1mib", "big"):
        t = res[name]
        label = f"{t['size_mib']:.0f} MiB"
        rows += [
            (
                f"put {label}",
                f"{t['put_mib_s']:.0f} MiB/s",
                f"{t['floor_copy_mib_s']:.0f} MiB/s (file copy)",
                f"{t['put_vs_floor']:.2f}x floor time",
            ),
            (
                f"verified get {label}",
                f"{t['get_verified_mib_s']:.0f} MiB/s",
                f"{t['floor_read_hash_mib_s']:.0f} MiB/s (read+sha256)",
                f"{t['get_vs_floor']:.2f}x (target ≤ 1.5x)",
            ),
            (
                f"re-put {label}",
                f"{t['reput_s'] * 1e3:.1f} ms",
                f"{t['hash_only_s'] * 1e3:.1f} ms (hash only)",
                f"{t['reput_vs_hash']:.2f}x (target ≤ 1.2x)",
            ),
        ]
    rows.append(
        (
            f"lookups, {args.procs} reader processes",
            f"{c['adstore']['ops_per_s']:.0f}/s, p99 " + us(c["adstore"]["p99_us"] / 1e6),
            f"{c['diskcache']['ops_per_s']:.0f}/s, p99 " + us(c["diskcache"]["p99_us"] / 1e6),
            f"{c['throughput_ratio']:.2f}x throughput",
        )
    )
    print(f"{'benchmark':38} {'adstore':28} {'baseline':34} ratio")
    for r in rows:
        print(f"{r[0]:38} {r[1]:28} {r[2]:34} {r[3]}")
    (results_dir() / "store.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
