"""The background uploader: behind the pipeline, bounded, flushed, never raising."""

from __future__ import annotations

import os
import threading
import time

from adstore.store import Store
from adstore.store.remote import (
    BackgroundUploader,
    Kind,
    MemoryBackend,
    Outcome,
    Remote,
    RemoteUnavailable,
    record_address,
)


def test_publishes_in_the_background_and_flushes(tmp_path, signer, trusted):
    memory = MemoryBackend()
    remote = Remote(memory, mode="read-write", signer=signer)
    up = BackgroundUploader(remote, exit_flush=None)
    with Store.open(tmp_path / "s", grace_period=0.0) as store:
        for i in range(5):
            refs = [store.put_bytes(os.urandom(70_000)), store.put_bytes(b"small %d" % i)]
            pairs = [(r.digest, r.size) for r in refs]
            assert up.publish(f"key{i}", 0, {"blobs": pairs}, pairs, source=store)
        assert up.flush(30) and up.pending == 0
    reader = Remote(memory, trusted=trusted)
    assert all(reader.fetch_record(f"key{i}", 0).ok for i in range(5))
    assert remote.counters["uploads.done"] == 5 and remote.counters["blobs_up"] == 10
    assert up.close(5)
    assert not up.submit(lambda: Outcome()) and remote.counters["uploads.dropped"] == 1


def test_failures_are_counted_never_raised(signer):
    memory = MemoryBackend()
    memory.fail = RemoteUnavailable("refused")
    remote = Remote(memory, mode="read-write", signer=signer)
    up = BackgroundUploader(remote, exit_flush=None)

    def boom() -> Outcome:
        raise RuntimeError("a bug in a job")

    assert up.submit(lambda: remote.push_record("k", 0, {}))
    assert up.submit(boom)
    assert up.flush(10)
    assert remote.counters["uploads.failed"] == 2
    memory.fail = None
    remote.breaker.success()
    assert up.submit(lambda: remote.push_record("k", 0, {})) and up.flush(10)
    assert remote.counters["uploads.done"] == 1 and memory.head(Kind.AC, record_address("k", 0))
    up.close(5)


def test_a_full_queue_drops_instead_of_blocking():
    remote = Remote(MemoryBackend(), mode="read-write")
    up = BackgroundUploader(remote, max_queue=2, exit_flush=None)
    gate = threading.Event()
    assert up.submit(lambda: (gate.wait(10), Outcome())[1])  # the worker is busy with this one
    deadline = time.monotonic() + 10
    while up._queue.qsize() and time.monotonic() < deadline:  # until the worker has taken it
        time.sleep(0.001)
    assert up.submit(lambda: Outcome()) and up.submit(lambda: Outcome())
    assert not up.submit(lambda: Outcome())
    assert remote.counters["uploads.dropped"] == 1
    assert not up.flush(0.05)  # still blocked: flush is bounded
    gate.set()
    assert up.flush(10) and remote.counters["uploads.done"] == 3
    up.close(5)


def test_exit_flush_waits_for_pending_uploads(tmp_path):
    """A process that queues uploads and exits still delivers them (atexit flush)."""
    import subprocess
    import sys

    code = f"""
import time
from adstore.store.remote import BackgroundUploader, Outcome, open_remote
r = open_remote("memory://exit", mode="read-write")
up = BackgroundUploader(r, exit_flush=10)
def job():
    time.sleep(0.3)
    open({str(tmp_path / "done")!r}, "w").write("ok")
    return Outcome()
up.submit(job)
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert (tmp_path / "done").read_text() == "ok"
