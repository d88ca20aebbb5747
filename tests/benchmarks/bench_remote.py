"""Remote-tier benchmark: adstore's remote against plain clients of the same server, in one run.

    python tests/benchmarks/bench_remote.py [--quick] [--mib 64] [--repeat 3] [--timeout 1.0]
                                            [--layers 24] [--hidden 128] [--hosts 8] [--skip pipeline,race]

Starts moto's S3 server and a WebDAV server on 127.0.0.1 (the test suite's
fixtures, from the ``test`` extra), prints a table and writes
bench-results/remote.json.  Every figure has a baseline measured in the same
run against the same server:

* blob download: ``Remote.fetch_blob`` (streamed to a file, SHA-256
  verified) vs ``boto3`` ``get_object(...)["Body"].read()`` of the same
  bytes (target ≥ 0.8×); the same against WebDAV vs a plain ``http.client``
  GET;
* blob upload: ``Remote.push_blob`` of a new blob (HEAD, then PUT from the
  file) vs ``put_object`` of the same bytes (target ≥ 0.8×); WebDAV vs a
  plain PUT;
* re-pushing an entry the remote holds: blob bytes sent (target 0);
* added latency when the remote is down: a stopped server (SIGSTOP) and a
  refused port; the first call within the timeout, later calls under 1 ms
  (circuit open).

* a remote hit into an empty local store vs the cold pipeline it replaces
  (the reference Llama, 24 layers, hidden 128; target ≥ 10×), each run a
  whole fresh process timed from its start to its first output, as
  ``bench_restart.py`` times restarts (its ``--child pipeline`` is what
  runs); also the cold run that pushes, the local warm hit that follows, and
  ``python -c 'import torch'`` as the floor no restart can beat;
* ``--hosts`` (8) fresh processes, each with its own empty root, starting the
  same cold key against one remote at once: builds and remote hits
  (target 1 build, 7 remote hits), and the wall time until the last output.

``--quick`` keeps every row but shrinks it (16 MiB blobs, a 2-layer model,
4 hosts, one repeat): minutes, indicative figures only.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_restart import timed as timed_process
from bench_results import write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "store" / "remote"))
from remote_servers import BUCKET, S3_ENV, free_port, start_moto, start_webdav  # noqa: E402

from adstore.store.remote import DEFAULT_DEADLINE, Kind, open_remote  # noqa: E402


def mib_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / (1 << 20)


def throughput(remote, work: Path, data: bytes, repeat: int, *, plain_put, plain_get, baseline: str) -> dict:
    """Best of ``repeat``: push_blob of a new blob vs ``plain_put``, fetch_blob vs ``plain_get``."""
    size, digest = len(data), hashlib.sha256(data).hexdigest()
    src = work / f"src-{digest[:8]}"
    src.write_bytes(data)
    up_a, up_b, down_a, down_b = [], [], [], []
    for i in range(repeat):
        assert remote.delete(Kind.CAS, digest).ok  # a new blob for push_blob (it skips one the remote has)
        up_a.append(timed(lambda: _ok(remote.push_blob(digest, size, src), size)))
        up_b.append(timed(lambda: plain_put(digest, data)))
        dest = work / f"down-{i}"
        down_a.append(timed(lambda dest=dest: _ok(remote.fetch_blob(digest, size, dest=dest), size)))
        dest.unlink()
        down_b.append(timed(lambda: _check_len(plain_get(digest), size)))
    rates = {}
    for way, ours, base in (("download", down_a, down_b), ("upload", up_a, up_b)):
        d = {"adstore_mib_s": mib_s(size, min(ours)), "baseline_mib_s": mib_s(size, min(base))}
        d["ratio_vs_baseline"] = d["adstore_mib_s"] / d["baseline_mib_s"]
        d["meets_0_8x"] = d["ratio_vs_baseline"] >= 0.8
        rates[way] = d
    return {"size_mib": size / (1 << 20), "baseline": baseline, **rates}


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _ok(out, size: int) -> None:
    assert out.ok and out.nbytes == size, out


def _check_len(body: bytes, size: int) -> None:
    assert len(body) == size


def s3_throughput(endpoint: str, work: Path, size: int, repeat: int) -> dict:
    import boto3

    client = boto3.session.Session().client("s3", endpoint_url=endpoint)
    remote = open_remote(f"s3://{BUCKET}/bench", endpoint_url=endpoint, mode="read-write", timeout=60)
    return throughput(
        remote,
        work,
        os.urandom(size),
        repeat,
        baseline="boto3",
        plain_put=lambda d, data: client.put_object(Bucket=BUCKET, Key=f"bench/cas/{d}", Body=data),
        plain_get=lambda d: client.get_object(Bucket=BUCKET, Key=f"bench/cas/{d}")["Body"].read(),
    )


def http_throughput(port: int, work: Path, size: int, repeat: int) -> dict:
    remote = open_remote(f"http://127.0.0.1:{port}/bench", mode="read-write", timeout=60)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, blocksize=1 << 20)

    def plain(method: str, digest: str, body: bytes | None = None) -> bytes:
        conn.request(method, f"/bench/cas/{digest}", body=body)
        return conn.getresponse().read()

    return throughput(
        remote,
        work,
        os.urandom(size),
        repeat,
        baseline="http.client",
        plain_put=lambda d, data: plain("PUT", d, data),
        plain_get=lambda d: plain("GET", d),
    )


def repush(endpoint: str, work: Path) -> dict:
    """Publish an entry (blobs + record), then publish it again: the second sends no blob bytes."""
    from adstore.store import Store
    from adstore.store.remote import Signer, generate_keypair

    signer = Signer.from_pem(generate_keypair().private_pem)
    remote = open_remote(
        f"s3://{BUCKET}/repush-{os.getpid()}", endpoint_url=endpoint, mode="read-write", timeout=60, signer=signer
    )
    with Store.open(work / "store", grace_period=0.0) as store:
        refs = [store.put_bytes(os.urandom(n)) for n in (1 << 20, 4 << 20, 300, 70_000)]
        pairs = [(r.digest, r.size) for r in refs]
        t = time.perf_counter()
        first = remote.publish("k", 0, {"blobs": pairs}, pairs, source=store)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        second = remote.publish("k", 0, {"blobs": pairs}, pairs, source=store)
        t2 = time.perf_counter() - t
    assert first.ok and second.ok
    return {
        "first_push_blob_bytes": first.value,
        "repush_blob_bytes": second.value,
        "first_push_s": t1,
        "repush_s": t2,
        "meets_zero_bytes": second.value == 0,
    }


def down_latency(kind: str, endpoint: str, timeout: float, calls: int) -> dict:
    """First call and later calls against a remote that does not answer."""
    if kind == "s3":
        remote = open_remote(f"s3://{BUCKET}/down", endpoint_url=endpoint, timeout=timeout, connect_timeout=timeout)
    else:
        remote = open_remote(f"{endpoint}/down", timeout=timeout, connect_timeout=timeout)
    digest = hashlib.sha256(b"down").hexdigest()
    t = time.perf_counter()
    if kind == "s3":  # boto3's import and client, made once per process on the first request: measured apart
        remote.backend._client  # noqa: B018
    setup_s = time.perf_counter() - t
    t = time.perf_counter()
    first = remote.fetch_record("k", 0)
    first_s = time.perf_counter() - t
    later = []
    for _ in range(calls):
        t = time.perf_counter()
        out = remote.head(Kind.CAS, digest)
        later.append(time.perf_counter() - t)
        assert not out.ok
    p50 = statistics.median(later)
    return {
        "timeout_s": timeout,
        "reason": first.reason,
        "first_call_s": first_s,
        "client_setup_s": setup_s,
        "later_p50_us": p50 * 1e6,
        "later_max_us": max(later) * 1e6,
        "meets_first_within_timeout": first_s <= timeout + 0.2,
        "meets_later_under_1ms": p50 < 1e-3,
    }


def _entry_on_remote(url: str, work: Path, data: bytes, key: str, **kw) -> tuple[object, object]:
    """Commit ``data`` as ``key`` in a writer's store and push it; (signer's trusted keys, the blob ref)."""
    from adstore.store import Store
    from adstore.store.remote import Signer, TrustedKeys, generate_keypair
    from adstore.store.tiered import remote_save

    pair = generate_keypair()
    with Store.open(work / f"writer-{key}") as store:
        ref = store.put_bytes(data)
        gen = store.new_generation()
        store.publish(key, generation=gen, artifacts={"blob": ref})
        store.commit(key, generation=gen)
        out = remote_save(
            store, open_remote(url, mode="read-write", signer=Signer.from_pem(pair.private_pem), timeout=60, **kw), key
        )
        assert out.ok, out
    return TrustedKeys.from_pem(pair.public_pem), ref


def restore_throughput(name: str, url: str, work: Path, size: int, repeat: int, **kw) -> dict:
    """``remote_restore`` of a one-blob entry into an empty store vs ``fetch_blob`` of the same bytes.

    The restore downloads, verifies, fsyncs, renames, registers and commits;
    the raw baseline only downloads and verifies into a file.  The durable
    baseline (``fetch_blob(fsync=True)``) is shown too.
    """
    from adstore.store import Store
    from adstore.store.tiered import remote_restore

    key = f"restore-{name}"
    trusted, ref = _entry_on_remote(url, work, os.urandom(size), key, **kw)
    remote = open_remote(url, trusted=trusted, timeout=60, **kw)
    ours, raw, durable = [], [], []
    for i in range(repeat):
        with Store.open(work / f"restore-{name}-{i}") as store:
            t = time.perf_counter()
            out = remote_restore(store, remote, key, 0, 1)
            ours.append(time.perf_counter() - t)
            assert out.ok, out
        for runs, fsync in ((raw, False), (durable, True)):
            dest = work / f"fetch-{name}-{i}-{fsync}"
            runs.append(
                timed(
                    lambda dest=dest, fsync=fsync: _ok(
                        remote.fetch_blob(ref.digest, size, dest=dest, fsync=fsync), size
                    )
                )
            )
            dest.unlink()
    d = {
        "size_mib": size / (1 << 20),
        "restore_mib_s": mib_s(size, min(ours)),
        "fetch_blob_mib_s": mib_s(size, min(raw)),
        "fetch_blob_fsync_mib_s": mib_s(size, min(durable)),
    }
    d["ratio_vs_fetch_blob"] = d["restore_mib_s"] / d["fetch_blob_mib_s"]
    d["ratio_vs_fetch_blob_fsync"] = d["restore_mib_s"] / d["fetch_blob_fsync_mib_s"]
    d["meets_0_8x"] = d["ratio_vs_fetch_blob"] >= 0.8
    return d


def circuit_open_lookups(work: Path, calls: int) -> dict:
    """Lookups of absent keys with the remote's circuit open vs a store without a remote (local miss)."""
    from adstore.store import Store

    port = free_port()  # nothing listens: the first call is refused and opens the circuit
    with (
        Store.open(work / "open-circuit", remote=f"http://127.0.0.1:{port}/x") as tiered,
        Store.open(work / "local-only") as local,
    ):
        assert tiered.lookup("warm-up").reason == "remote_unavailable"
        times = {}
        for label, store in (("circuit_open", tiered), ("local", local)):
            runs = []
            for i in range(calls):
                key = f"absent-{i}"
                t = time.perf_counter()
                res = store.lookup(key)
                runs.append(time.perf_counter() - t)
                assert not res.hit
            times[label] = runs
    p50, base = statistics.median(times["circuit_open"]), statistics.median(times["local"])
    return {
        "calls": calls,
        "p50_us": p50 * 1e6,
        "p99_us": sorted(times["circuit_open"])[calls * 99 // 100] * 1e6,
        "local_miss_p50_us": base * 1e6,
        "ratio_vs_local_miss": p50 / base,
        "meets_20us": p50 <= 20e-6,
    }


def drip_deadline(work: Path, deadline: float) -> dict:
    """A server sending a genuine record at 1 byte/s: the lookup is a miss within the deadline."""
    from remote_faultserver import FaultServer

    from adstore.store import Store
    from adstore.store.remote import record_address

    server = FaultServer()
    try:
        trusted, _ref = _entry_on_remote(server.url, work, b"x" * 1000, "drip")
        record = server.objects[f"ac/{record_address('drip', 0)}"]
        server.fault(f"ac/{record_address('drip', 0)}", "drip", interval=1.0)
        remote = open_remote(server.url, trusted=trusted, deadline=deadline)
        with Store.open(work / "drip", remote=remote) as store:
            t = time.perf_counter()
            res = store.lookup("drip")
            took = time.perf_counter() - t
    finally:
        server.close()
    return {
        "record_bytes": len(record),
        "unbounded_s": float(len(record)),
        "deadline_s": deadline,
        "lookup_s": took,
        "reason": str(res.reason),
        "meets_deadline": not res.hit and took <= deadline + 1.0,
    }


RESTART = Path(__file__).resolve().parent / "bench_restart.py"


def _store_counters(root: Path) -> dict:
    from adstore.store import Store

    with Store.open(root, create=False) as store:
        st = store.stats()
        out = {k: v for k, v in st.counters.items() if k.startswith("remote.") or k.startswith("hit")}
        out["logical_bytes"] = st.logical_bytes
        return out


def pipeline_rows(endpoint: str, work: Path, layers: int, hidden: int, repeat: int) -> dict:
    """Fresh processes on the reference pipeline: cold (no remote), cold + push, remote hit into an empty root."""
    from adstore.integration.reference.checkpoint import write_random_checkpoint
    from adstore.integration.reference.models import ModelFactory
    from adstore.store.remote import write_keypair

    factory = ModelFactory.from_config({"arch": "llama", "layers": layers, "hidden": hidden})
    ckpt = write_random_checkpoint(factory.build(), work / "ckpt", seed=0)
    private, public = write_keypair(work / "keys")
    url = f"s3://{BUCKET}/pipeline-{os.getpid()}"
    child = [
        sys.executable,
        str(RESTART),
        "--child",
        "pipeline",
        "--checkpoint",
        str(ckpt),
        "--layers",
        str(layers),
        "--hidden",
        str(hidden),
    ]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ADSTORE_")}
    writer = {
        **clean,
        "AWS_ENDPOINT_URL": endpoint,
        "ADSTORE_REMOTE": url,
        "ADSTORE_REMOTE_MODE": "read-write",
        "ADSTORE_SIGNING_KEY": str(private),
    }
    reader = {**clean, "AWS_ENDPOINT_URL": endpoint, "ADSTORE_REMOTE": url, "ADSTORE_TRUSTED_KEYS": str(public)}

    def run(env: dict, root: Path) -> tuple[float, dict]:
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:
            return timed_process([*child, "--root", str(root)])
        finally:
            os.environ.clear()
            os.environ.update(saved)

    floor = statistics.median(
        timed_process([sys.executable, "-c", "import torch; print('FIRST {}', flush=True)"])[0] for _ in range(repeat)
    )
    colds = [run(clean, work / f"cold-{i}") for i in range(repeat)]
    push_s, pushed = run(writer, work / "writer")
    hits, sums = [], {c["sum"] for _, c in colds} | {pushed["sum"]}
    for i in range(repeat):
        root = work / f"reader-{i}"
        s, first = run(reader, root)
        counters = _store_counters(root)
        assert first["event"] == "hit" and counters.get("remote.hits") == 1, (first, counters)
        hits.append(s)
        sums.add(first["sum"])
    moved, logical = counters.get("remote.bytes_down", 0), counters["logical_bytes"]
    warm_s, warm = run(reader, work / "reader-0")  # the same root again: an ordinary local hit
    sums.add(warm["sum"])
    cold, hit = statistics.median(s for s, _ in colds), statistics.median(hits)
    return {
        "layers": layers,
        "hidden": hidden,
        "floor_s": floor,
        "cold_s": cold,
        "cold_runs": [s for s, _ in colds],
        "cold_push_s": push_s,
        "push_overhead_s": push_s - cold,
        "remote_hit_s": hit,
        "remote_hit_runs": hits,
        "local_hit_s": warm_s,
        "events": [pushed["event"], warm["event"]],
        "outputs_equal": len(sums) == 1,
        "speedup": cold / hit,
        "above_floor_ratio": (cold - floor) / (hit - floor) if hit > floor else None,
        "meets_10x": cold / hit >= 10,
        "bytes_down": moved,
        "entry_logical_bytes": logical,
        "transfer_ratio": logical / moved if moved else None,
        "meets_5x_fewer_bytes": moved * 5 <= logical,
    }


def race_rows(endpoint: str, work: Path, hosts: int, layers: int, hidden: int) -> dict:
    """``hosts`` fresh processes start one cold key against one remote at once: builds and remote hits."""
    from remote_tier_hosts import cold_start_race

    from adstore.integration.reference.checkpoint import write_random_checkpoint
    from adstore.integration.reference.models import ModelFactory
    from adstore.store.remote import write_keypair

    model = {"arch": "llama", "layers": layers, "hidden": hidden}
    ckpt = write_random_checkpoint(ModelFactory.from_config(model).build(), work / "race-ckpt", seed=1)
    private, public = write_keypair(work / "race-keys")
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "ADSTORE_REMOTE": f"s3://{BUCKET}/race-{os.getpid()}",
        "ADSTORE_REMOTE_MODE": "read-write",
        "ADSTORE_SIGNING_KEY": str(private),
        "ADSTORE_TRUSTED_KEYS": str(public),
        "ADSTORE_REMOTE_WAIT": "600s",
    }
    t = time.perf_counter()
    results = cold_start_race([str(work / f"race-{i}") for i in range(hosts)], str(ckpt), env, model)
    wall = time.perf_counter() - t
    errors = [r["error"][-500:] for r in results if "error" in r]
    kinds = [
        tuple(e["kind"] for e in r.get("events", []) if e["kind"] in ("hit", "miss", "save", "bypass")) for r in results
    ]
    builds = sum(1 for k in kinds if k == ("miss", "save"))
    remote_hits = sum(
        1 for r in results for e in r.get("events", []) if e["kind"] == "hit" and e.get("source") == "remote"
    )
    return {
        "hosts": hosts,
        "layers": layers,
        "hidden": hidden,
        "wall_s": wall,
        "builds": builds,
        "remote_hits": remote_hits,
        "other": [list(k) for k in kinds if k not in (("miss", "save"), ("hit",))],
        "errors": errors,
        "outputs_equal": len({r.get("output") for r in results}) == 1,
        "meets_one_build": builds == 1 and remote_hits == hosts - 1,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 MiB blob, 2 repeats")
    ap.add_argument("--mib", type=int, default=64, help="blob size for the throughput rows")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1.0, help="read/connect timeout of the down-remote rows")
    ap.add_argument("--layers", type=int, default=24, help="layers of the pipeline rows' model")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size of the pipeline rows' model")
    ap.add_argument("--hosts", type=int, default=8, help="simultaneous cold starts of the race row")
    ap.add_argument("--skip", default="", help="comma-separated rows to leave out: throughput, pipeline, race")
    args = ap.parse_args(argv)
    size = (16 if args.quick else args.mib) << 20
    repeat = 2 if args.quick else args.repeat
    layers, hidden = (2, 64) if args.quick else (args.layers, args.hidden)
    hosts = min(args.hosts, 4) if args.quick else args.hosts
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    os.environ.update(S3_ENV)
    # The servers run on this machine: a busy machine moves the throughput ratios, so the load is kept.
    res: dict = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "loadavg_before": os.getloadavg()[0]},
        "settings": {
            "blob_mib": size >> 20,
            "repeat": repeat,
            "timeout_s": args.timeout,
            "layers": layers,
            "hidden": hidden,
            "hosts": hosts,
            "quick": args.quick,
        },
    }
    with tempfile.TemporaryDirectory(dir=os.environ.get("ADSTORE_BENCH_DIR")) as tmp:
        work = Path(tmp)
        moto = start_moto(work)
        dav = start_webdav(work)
        try:
            import boto3

            boto3.session.Session().client("s3", endpoint_url=moto.endpoint).create_bucket(Bucket=BUCKET)
            if "throughput" not in skip:
                res["s3"] = s3_throughput(moto.endpoint, work, size, repeat)
                res["http"] = http_throughput(dav.port, work, size, repeat)
            if "throughput" not in skip:
                res["restore"] = {
                    "s3": restore_throughput(
                        "s3", f"s3://{BUCKET}/restore", work, size, repeat, endpoint_url=moto.endpoint
                    ),
                    "http": restore_throughput("http", f"{dav.endpoint}/restore", work, size, repeat),
                }
            res["circuit_open"] = circuit_open_lookups(work, 2000 if args.quick else 20000)
            res["drip"] = drip_deadline(work, 5.0 if args.quick else DEFAULT_DEADLINE)
            res["repush"] = repush(moto.endpoint, work)
            if "pipeline" not in skip:
                res["pipeline"] = pipeline_rows(moto.endpoint, work, layers, hidden, 1 if args.quick else repeat)
            if "race" not in skip:
                res["race"] = race_rows(moto.endpoint, work, hosts, layers, hidden)
            res["down"] = {"refused": down_latency("http", f"http://127.0.0.1:{free_port()}", args.timeout, 1000)}
            for name, server in (("s3", moto), ("http", dav)):
                os.kill(server.proc.pid, signal.SIGSTOP)
                try:
                    res["down"][f"stopped_{name}"] = down_latency(name, server.endpoint, args.timeout, 1000)
                finally:
                    os.kill(server.proc.pid, signal.SIGCONT)
        finally:
            moto.stop()
            dav.stop()
    res["machine"]["loadavg_after"] = os.getloadavg()[0]
    rows = []
    for name in ("s3", "http") if "s3" in res else ():
        t = res[name]
        for way in ("download", "upload"):
            d = t[way]
            rows.append(
                (
                    f"{name} {way} {t['size_mib']:.0f} MiB",
                    f"{d['adstore_mib_s']:.0f} MiB/s",
                    f"{d['baseline_mib_s']:.0f} MiB/s ({t['baseline']})",
                    f"{d['ratio_vs_baseline']:.2f}x (target ≥ 0.8x)",
                )
            )
    for name, d in res.get("restore", {}).items():
        rows.append(
            (
                f"{name} remote restore {d['size_mib']:.0f} MiB",
                f"{d['restore_mib_s']:.0f} MiB/s",
                f"{d['fetch_blob_mib_s']:.0f} MiB/s (fetch_blob)",
                f"{d['ratio_vs_fetch_blob']:.2f}x (target ≥ 0.8x)",
            )
        )
        rows.append(
            (
                "  vs a durable fetch_blob (fsync)",
                f"{d['restore_mib_s']:.0f} MiB/s",
                f"{d['fetch_blob_fsync_mib_s']:.0f} MiB/s",
                f"{d['ratio_vs_fetch_blob_fsync']:.2f}x",
            )
        )
    c = res["circuit_open"]
    rows.append(
        (
            "lookup, circuit open",
            f"p50 {c['p50_us']:.1f} µs",
            f"local miss p50 {c['local_miss_p50_us']:.1f} µs",
            f"{c['ratio_vs_local_miss']:.2f}x (target ≤ 20 µs)",
        )
    )
    d = res["drip"]
    rows.append(
        (
            "lookup against a 1 byte/s server",
            f"{d['lookup_s']:.1f} s ({d['reason']})",
            f"deadline {d['deadline_s']:.0f} s; unbounded {d['unbounded_s']:.0f} s",
            "target ≤ deadline",
        )
    )
    r = res["repush"]
    rows.append(
        (
            "re-push an entry (blob bytes)",
            str(r["repush_blob_bytes"]),
            f"{r['first_push_blob_bytes']} (first push)",
            "target 0",
        )
    )
    for name, d in res["down"].items():
        rows.append(
            (
                f"remote down ({name}): first call"
                + (
                    f" (+{d['client_setup_s'] * 1e3:.0f} ms client set-up)"
                    if d.get("client_setup_s", 0) >= 0.001
                    else ""
                ),
                f"{d['first_call_s'] * 1e3:.0f} ms ({d['reason']})",
                f"timeout {d['timeout_s'] * 1e3:.0f} ms",
                "target ≤ timeout",
            )
        )
        rows.append(
            (
                f"remote down ({name}): later calls",
                f"p50 {d['later_p50_us']:.1f} µs",
                f"max {d['later_max_us']:.1f} µs",
                "target < 1 ms",
            )
        )
    if "pipeline" in res:
        p = res["pipeline"]
        rows.append(
            (
                f"remote hit, empty store ({p['layers']}x{p['hidden']})",
                f"{p['remote_hit_s']:.2f} s",
                f"cold pipeline {p['cold_s']:.2f} s",
                f"{p['speedup']:.1f}x (target ≥ 10x)",
            )
        )
        rows.append(
            (
                "  cold run that pushes",
                f"{p['cold_push_s']:.2f} s",
                f"cold {p['cold_s']:.2f} s",
                f"+{p['push_overhead_s']:.2f} s",
            )
        )
        rows.append(
            (
                "  local hit afterwards",
                f"{p['local_hit_s']:.2f} s",
                f"floor {p['floor_s']:.2f} s",
                f"outputs equal: {p['outputs_equal']}",
            )
        )
        rows.append(
            (
                "  bytes moved by the remote hit (S3)",
                f"{p['bytes_down']:,} B",
                f"{p['entry_logical_bytes']:,} B in the entry",
                f"{p['transfer_ratio'] or 0:.1f}x fewer (target ≥ 5x)",
            )
        )
    if "race" in res:
        r = res["race"]
        rows.append(
            (
                f"{r['hosts']} cold starts of one key",
                f"{r['builds']} build(s), {r['remote_hits']} remote hits",
                f"wall {r['wall_s']:.1f} s",
                f"target 1 build, {r['hosts'] - 1} remote hits",
            )
        )
    print(f"{'benchmark':40} {'adstore':24} {'baseline':30} ratio")
    for row in rows:
        print(f"{row[0]:40} {row[1]:24} {row[2]:30} {row[3]}")
    write_results("remote.json", res, partial=bool(skip))
    return 0


if __name__ == "__main__":
    sys.exit(main())
