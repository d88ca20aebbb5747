"""What a compressed file with a lying seek table costs a reader before it is refused.

    python tests/benchmarks/bench_lying_tables.py

Each hostile file is read in a child process of its own (``decode_file``,
as a get, a copy and ``verify`` do, with the recorded size, and without
one, as a rebuild does): the time to the refusal, the peak of traced
Python allocations (``tracemalloc``) and the growth of the child's peak
resident set (``getrusage``) are printed as JSON, one line per case.
Cases: a 1 MiB blob whose table claims one frame per content byte; 2 Mi
entries of one byte; a real frame followed by 1 MiB of junk inside its
entry; a real frame followed by 16 bytes of junk.
"""

from __future__ import annotations

import json
import os
import random
import resource
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc

_SKIPPABLE = 0x184D2A5E
_SEEKABLE = 0x8F92EAB1


def _table(entries: list[tuple[int, int]] | bytes, n: int) -> bytes:
    body = entries if isinstance(entries, bytes) else b"".join(struct.pack("<II", *e) for e in entries)
    return struct.pack("<II", _SKIPPABLE, len(body) + 9) + body + struct.pack("<IBI", n, 0, _SEEKABLE)


def per_byte(n: int) -> tuple[bytes, int]:
    """``n`` bytes of frames region and a table of ``n`` entries of one stored byte holding one content byte."""
    return random.Random(n).randbytes(n) + _table(struct.pack("<II", 1, 1) * n, n), n


def junk_after_frame(junk: int) -> tuple[bytes, int]:
    import zstandard

    content = b"node_1(" * ((128 << 10) // 7 + 1)
    content = content[: 128 << 10]
    frame = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True).compress(content)
    region = frame + random.Random(junk).randbytes(junk)
    return region + _table([(len(region), len(content))], 1), len(content)


CASES = {
    "1 MiB, one frame per content byte": lambda: per_byte(1 << 20),
    "2 Mi entries of one byte": lambda: per_byte(2 << 20),
    "a frame + 1 MiB of junk": lambda: junk_after_frame(1 << 20),
    "a frame + 16 bytes of junk": lambda: junk_after_frame(16),
}


def child(path: str, size: int | None, trace: bool) -> dict[str, object]:
    """Time and peak RSS growth to the refusal; with ``trace``, the traced peak instead (tracing slows it)."""
    from adstore.store.codec import decode_file

    fd = os.open(path, os.O_RDONLY)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if trace:
        tracemalloc.start()
    t0 = time.perf_counter()
    try:
        for _ in decode_file(fd, size):
            pass
        outcome = "accepted"
    except Exception as exc:  # the refusal is what is measured
        outcome = f"{type(exc).__name__}: {str(exc)[:90]}"
    seconds = time.perf_counter() - t0
    if trace:
        _, peak = tracemalloc.get_traced_memory()
        return {"traced_peak_mb": round(peak / 1e6, 3)}
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    return {"ms": round(seconds * 1e3, 3), "rss_growth_mb": round(grown / 1e3, 1), "outcome": outcome}


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        size = None if sys.argv[3] == "none" else int(sys.argv[3])
        print(json.dumps(child(sys.argv[2], size, sys.argv[4] == "trace")))
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in CASES.items():
            blob, size = make()
            path = os.path.join(tmp, "blob")
            with open(path, "wb") as f:
                f.write(blob)
            for given in (str(size), "none"):
                row = {}
                for how in ("time", "trace"):
                    res = subprocess.run(
                        [sys.executable, __file__, "--child", path, given, how],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    row.update(json.loads(res.stdout))
                print(json.dumps({"case": name, "file_bytes": len(blob), "size": given, **row}), flush=True)


if __name__ == "__main__":
    main()
