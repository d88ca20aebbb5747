"""Human-readable output for the CLI: sizes, ages, tables, a progress bar.

Kept separate from the commands so that every command prints sizes and ages
the same way and the JSON output stays raw numbers.  The progress bar writes
to stderr only (stdout stays parseable) and only when stderr is a terminal,
unless forced.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TextIO

from adstore.store import human_size

__all__ = [
    "human_size",
    "human_duration",
    "human_age",
    "short_key",
    "table",
    "kv_block",
    "Progress",
    "ByteProgress",
    "remote_counters",
    "remote_stats_rows",
    "flight_stats_rows",
]


def human_duration(seconds: float | None) -> str:
    """``5400`` → ``"1h30m"``; two most significant units."""
    if seconds is None:
        return "-"
    s = max(0.0, float(seconds))
    if s < 1:
        return f"{s * 1000:.0f}ms"
    if s < 60:
        return f"{s:.0f}s" if s >= 10 else f"{s:.1f}s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if s >= size:
            count = int(s // size)
            parts.append(f"{count}{unit}")
            s -= count * size
        if len(parts) == 2:
            break
    return "".join(parts) or "0s"


def human_age(timestamp: float | None, *, now: float | None = None) -> str:
    """A wall-clock timestamp as ``"3m ago"``; ``"-"`` when unknown."""
    if not timestamp:
        return "-"
    delta = (time.time() if now is None else now) - float(timestamp)
    if delta < 0:
        return "in the future"
    return f"{human_duration(delta)} ago"


def short_key(key: str, width: int = 12) -> str:
    return key if len(key) <= width else key[:width]


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str], *, align: str | None = None) -> str:
    """A plain text table; ``align`` has one ``l``/``r`` per column (default: left)."""
    body = [[("" if cell is None else str(cell)) for cell in row] for row in rows]
    cols = len(headers)
    aligns = (align or "l" * cols).ljust(cols, "l")
    widths = [len(h) for h in headers]
    for row in body:
        for i, cell in enumerate(row[:cols]):
            widths[i] = max(widths[i], len(cell))

    def fmt(row: Sequence[str]) -> str:
        cells = []
        for i in range(cols):
            cell = row[i] if i < len(row) else ""
            cells.append(cell.rjust(widths[i]) if aligns[i] == "r" else cell.ljust(widths[i]))
        return "  ".join(cells).rstrip()

    lines = [fmt(list(headers)), fmt(["-" * w for w in widths])]
    lines.extend(fmt(row) for row in body)
    return "\n".join(lines)


def kv_block(pairs: Iterable[tuple[str, Any]] | Mapping[str, Any], *, indent: int = 0) -> str:
    """``ccache -s`` style aligned ``label   value`` lines."""
    items = list(pairs.items() if isinstance(pairs, Mapping) else pairs)
    if not items:
        return ""
    width = max(len(k) for k, _ in items)
    pad = " " * indent
    return "\n".join(f"{pad}{k.ljust(width)}  {v}".rstrip() for k, v in items)


class Progress:
    """A throttled one-line progress bar on stderr; use as ``callback(done, total)``.

    Silent unless stderr is a terminal (or ``force=True``), so logs and
    pipes never fill with carriage returns.
    """

    def __init__(
        self,
        label: str,
        *,
        stream: TextIO | None = None,
        force: bool = False,
        min_interval: float = 0.1,
        delay: float = 0.0,
    ) -> None:
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", lambda: False)
        self.enabled = force or bool(isatty())
        self.min_interval = min_interval
        self.delay = delay  # quick scans never draw a bar
        self._last = 0.0
        self._drawn = False
        self._start = time.monotonic()

    def __call__(self, done: int, total: int | None = None, *_: Any) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._start < self.delay:
            return
        if now - self._last < self.min_interval and not (total and done >= total):
            return
        self._last = now
        width = max(10, min(40, shutil.get_terminal_size((80, 20)).columns - 40))
        if total:
            frac = min(1.0, done / total)
            bar = "#" * int(frac * width)
            text = f"\r{self.label} [{bar.ljust(width)}] {done}/{total} {frac * 100:5.1f}%"
        else:
            text = f"\r{self.label} {done} ({human_duration(now - self._start)})"
        self.stream.write(text)
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ByteProgress:
    """``push``/``pull`` on a terminal: one line on stderr with the bytes moved so far, the rate and the entry.

    A transfer runs in the calling thread, a blob at a time (one may be
    150 MB), so a daemon thread redraws the line every ``interval`` seconds
    from ``moved()`` (the remote's byte counters, plus what is arriving);
    :meth:`step` names the entry being moved.  Silent unless stderr is a
    terminal (or ``force=True``).  The thread is joined on exit, within one
    interval.
    """

    def __init__(
        self,
        label: str,
        moved: Callable[[], int],
        *,
        total: int,
        stream: TextIO | None = None,
        force: bool = False,
        interval: float = 0.25,
    ) -> None:
        self.label = label
        self.moved = moved
        self.total = total  # entries (ranks) to move
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", lambda: False)
        self.enabled = force or bool(isatty())
        self.interval = interval
        self.done = 0
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drawn = False

    def step(self, done: int) -> None:
        """``done`` entries (ranks) are moved."""
        self.done = done

    def line(self) -> str:
        """The text of the line now."""
        moved = max(0, self.moved())
        seconds = max(time.monotonic() - self._start, 1e-9)
        return (
            f"{self.label}: {human_size(moved)} ({human_size(int(moved / seconds))}/s), "
            f"{self.done}/{self.total} done, {human_duration(seconds)}"
        )

    def _draw(self) -> None:
        text = self.line()
        self.stream.write(f"\r{text}\x1b[K")
        self.stream.flush()
        self._drawn = True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._draw()

    def __enter__(self) -> ByteProgress:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="adstore-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + 1.0)
            self._draw()  # the final figures
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()


def remote_counters(counters: dict[str, int]) -> dict[str, int]:
    """The ``remote.*`` counters of a store, without their prefix."""
    return {k[len("remote.") :]: v for k, v in counters.items() if k.startswith("remote.")}


def remote_stats_rows(counters: dict[str, int]) -> list[tuple[str, Any]]:
    """Rows for ``adstore stats``: remote hits, misses by reason, bytes down and up (empty without any)."""
    c = remote_counters(counters)
    if not c:
        return []
    rows: list[tuple[str, Any]] = [("Remote hits", c.get("hits", 0)), ("Remote misses", c.get("misses", 0))]
    misses = sorted(((k[len("misses.") :], v) for k, v in c.items() if k.startswith("misses.")), key=lambda kv: -kv[1])
    rows += [(f"  {reason}", n) for reason, n in misses]
    rows += [
        ("Remote downloaded", human_size(c.get("bytes_down", 0))),
        ("Remote uploaded", human_size(c.get("bytes_up", 0))),
    ]
    errors = sum(v for k, v in c.items() if k.startswith("errors."))
    if errors:
        rows.append(("Remote errors", errors))
    return rows + flight_stats_rows(c)


def flight_stats_rows(c: dict[str, int]) -> list[tuple[str, Any]]:
    """Single-flight rows: misses that waited for another host's build (and how long), takeovers, waits that ran out."""
    waits, leads = c.get("flight.waits", 0), c.get("flight.leader", 0)
    if not (waits or leads):
        return []
    return [
        ("Builds led", leads),
        ("Waited for another host", f"{waits} ({human_duration(c.get('flight.waited_ms', 0) / 1000.0)})"),
        ("  then hit", c.get("flight.ready", 0)),
        ("Leases taken over", c.get("flight.takeovers", 0)),
        ("Waits that ran out", c.get("flight.single_flight_timeout", 0)),
    ]
