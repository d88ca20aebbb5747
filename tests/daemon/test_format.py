"""Human formatting helpers of the CLI."""

from __future__ import annotations

import io

from adstore.daemon.format import ByteProgress, Progress, human_age, human_duration, human_size, kv_block, table


def test_human_size() -> None:
    assert human_size(0) == "0 B"
    assert human_size(1023) == "1023 B"
    assert human_size(1536) == "1.5 KiB"
    assert human_size(10 * 1024**3) == "10.0 GiB"
    assert human_size(None) == "-"
    assert human_size(-2048) == "-2.0 KiB"


def test_human_duration_and_age() -> None:
    assert human_duration(0.25) == "250ms"
    assert human_duration(5400) == "1h30m"
    assert human_duration(3 * 86400 + 7200 + 5) == "3d2h"
    assert human_age(100.0, now=160.0) == "1m ago"
    assert human_age(None) == "-"


def test_table_alignment() -> None:
    text = table([("a", 1), ("bbb", 100)], ("NAME", "N"), align="lr")
    lines = text.splitlines()
    assert lines[0] == "NAME    N"
    assert lines[2] == "a       1" and lines[3] == "bbb   100"


def test_kv_block() -> None:
    assert kv_block([("a", 1), ("long", 2)]) == "a     1\nlong  2"


def test_progress_draws_only_on_a_terminal_or_when_forced() -> None:
    quiet = io.StringIO()
    Progress("x", stream=quiet)(1, 2)
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    with Progress("verifying", stream=loud, force=True, min_interval=0) as p:
        p(1, 4)
        p(4, 4)
    out = loud.getvalue()
    assert "verifying" in out and "4/4" in out and "100.0%" in out and out.endswith("\n")


def test_byte_progress_draws_the_bytes_moved_on_a_terminal_only() -> None:
    """push/pull of one 149 MiB entry showed nothing for minutes: the line says what has moved, from a thread."""
    moved = [0]
    quiet = io.StringIO()
    with ByteProgress("pulling", lambda: moved[0], total=1, stream=quiet, interval=0.01) as p:
        moved[0] = 5 << 20
        p.step(1)
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    with ByteProgress("pulling", lambda: moved[0], total=3, stream=loud, force=True, interval=0.01) as p:
        p.step(2)
        assert p.line().startswith("pulling: 5.0 MiB (") and "2/3 done" in p.line()
    out = loud.getvalue()
    assert out.startswith("\rpulling: 5.0 MiB") and "2/3 done" in out and out.endswith("\n")
