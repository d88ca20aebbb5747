"""Units: sizes, percentages and durations, with one meaning everywhere.

The store (``Store.open(max_size=…)``, ``ADSTORE_MAX_SIZE``, ``plan_eviction``),
the daemon's configuration, the CLI flags and the demo all parse and print
through this module, so ``"10G"`` means the same thing wherever it is written
(docs/configuration.md, "Units"):

Sizes
    A plain number is bytes (``1048576``; ``"1.5G"`` allows fractions).
    ``K``, ``M``, ``G``, ``T``, ``P`` and ``KiB``, ``MiB``, ``GiB``, ``TiB``,
    ``PiB`` are powers of 2**10 (``"10G"`` = ``"10GiB"`` = 10 × 2**30);
    ``KB``, ``MB``, ``GB``, ``TB``, ``PB`` are powers of 10 (``"10GB"`` =
    10**10); ``B`` is bytes.  Letters are case-insensitive.
Percentages
    ``"10%"``, between 0% and 100%; a fraction of the filesystem for
    ``min_free``.  Watermarks are fractions: ``0.9`` or ``"90%"``.
Counts
    Whole numbers in ASCII digits (``"４"`` is not a count).
Durations
    A plain number is seconds; else one number and one unit: ``ms``, ``s``,
    ``m``, ``h``, ``d``, ``w`` (``"250ms"``, ``"90s"``, ``"2h"``, ``"7d"``).

:func:`human_size` prints sizes in binary units (``"1.5 KiB"``), like
``du -h`` and systemd; :func:`format_duration` prints a duration back in the
form :func:`parse_duration` reads.  No torch, no third-party imports.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import NamedTuple

from .errors import ConfigError

__all__ = [
    "SIZE_HELP",
    "parse_count",
    "DURATION_HELP",
    "MinFree",
    "parse_size",
    "parse_percent",
    "parse_fraction",
    "parse_min_free",
    "parse_duration",
    "format_duration",
    "human_size",
]

#: One line for ``--help`` texts and docs: what a size may be.
SIZE_HELP = "bytes, or K/M/G/T (= KiB/MiB/GiB/TiB, powers of 1024) or KB/MB/GB/TB (powers of 1000)"
#: One line for ``--help`` texts and docs: what a duration may be.
DURATION_HELP = "seconds, or a number with ms/s/m/h/d/w (e.g. 90s, 2h, 7d)"

# ASCII only, whole string (re.ASCII, fullmatch): "１０G" and "٣s" are not numbers here, whatever
# str.isdigit, \d and float() think (they take every Unicode decimal digit).
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([kmgtp])(i?)(b?)|(b?))\s*", re.IGNORECASE | re.ASCII)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_DURATION_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d|w)?\s*", re.IGNORECASE | re.ASCII)
_COUNT_RE = re.compile(r"\s*[+-]?[0-9]{1,64}\s*", re.ASCII)
#: A decimal number as Python prints a float (``90``, ``0.9``, ``1e-05``): what percentages and fractions take.
_DECIMAL_RE = re.compile(r"\s*(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*", re.ASCII)
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_MAX_DIGITS = 64


def _number(value: object, *, field: str, what: str, example: str) -> float | None:
    """A finite, non-negative number for int/float input; None for a string; else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(field, f"expected a {what} such as {example}, got {type(value).__name__} {value!r}")
    if isinstance(value, str):
        return None
    if not math.isfinite(value):
        raise ConfigError(field, f"{what} must be finite, got {value!r}")
    if value < 0:
        raise ConfigError(field, f"{what} must not be negative, got {value!r}")
    return float(value)


def parse_count(value: object, *, field: str = "count", minimum: int = 0) -> int:
    """A whole number, at least ``minimum``: an ``int`` (a whole float) or ASCII digits, never ``"１０"``."""
    if isinstance(value, bool):
        count = None
    elif isinstance(value, int):
        count = value
    elif isinstance(value, float) and value.is_integer():
        count = int(value)
    elif isinstance(value, str) and _COUNT_RE.fullmatch(value):
        count = int(value)
    else:
        count = None
    if count is None:
        raise ConfigError(field, f"expected a whole number, got {str(value)[:40]!r}")
    if count < minimum:
        raise ConfigError(field, f"must be at least {minimum}, got {count}")
    return count


def parse_size(value: object, *, field: str = "size") -> int:
    """Bytes from ``123``, ``"64K"``, ``"10G"``, ``"512MiB"`` (2**10 units) or ``"5GB"`` (10**3)."""
    number = _number(value, field=field, what="size", example="10G or 512MiB")
    if number is not None:
        return int(number)
    m = _SIZE_RE.fullmatch(str(value))
    if not m:
        raise ConfigError(field, f"cannot parse size {value!r} (examples: 1048576, 512M, 10GiB, 5GB)")
    if len(m.group(1)) > _MAX_DIGITS:  # int() refuses thousands of digits (ValueError), and no disk is that big
        raise ConfigError(field, f"size {str(value)[:24]}… has more than {_MAX_DIGITS} digits")
    # Fraction: exact, so "72057594037929KB" is not off by float rounding.
    count, letter, binary, byte = Fraction(m.group(1)), m.group(2), m.group(3), m.group(4)
    if letter is None:
        return int(count)
    base = 1000 if byte and not binary else 1024
    return int(count * base ** _POWERS[letter.lower()])


def parse_percent(value: object, *, field: str) -> float:
    """``"10%"`` → ``10.0``; refuses anything outside 0%..100%."""
    text = str(value).strip()
    if not text.endswith("%"):
        raise ConfigError(field, f'expected a percentage such as "10%", got {value!r}')
    if _DECIMAL_RE.fullmatch(text[:-1]) is None:
        raise ConfigError(field, f"cannot parse percentage {value!r}")
    pct = float(text[:-1])
    if not 0.0 <= pct <= 100.0:
        raise ConfigError(field, f"percentage must be within 0%..100%, got {value!r}")
    return pct


def parse_fraction(value: object, *, field: str) -> float:
    """A fraction in (0, 1] from ``0.9`` or ``"90%"``."""
    if isinstance(value, str) and value.strip().endswith("%"):
        frac = parse_percent(value, field=field) / 100.0
    else:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(field, f'expected a fraction such as 0.9 or "90%", got {value!r}')
        if isinstance(value, str) and _DECIMAL_RE.fullmatch(value) is None:
            raise ConfigError(field, f'expected a fraction such as 0.9 or "90%", got {value!r}')
        frac = float(value)
    if not 0.0 < frac <= 1.0:
        raise ConfigError(field, f"must be in (0, 1] (or (0%, 100%]), got {value!r}")
    return frac


class MinFree(NamedTuple):
    """A free-space floor: bytes, or a percentage of the filesystem (exactly one is set)."""

    bytes: int | None
    percent: float | None

    def of(self, fs_total: int) -> int:
        """The floor in bytes on a filesystem of ``fs_total`` bytes."""
        if self.percent is not None:
            return int(fs_total * self.percent / 100.0)
        return int(self.bytes or 0)


def parse_min_free(value: object, *, field: str = "min_free") -> MinFree:
    """``MinFree(bytes, None)`` for a size, ``MinFree(None, percent)`` for ``"10%"``."""
    if isinstance(value, str) and value.strip().endswith("%"):
        return MinFree(None, parse_percent(value, field=field))
    return MinFree(parse_size(value, field=field), None)


def parse_duration(value: object, *, field: str = "duration") -> float:
    """Seconds from ``30``, ``"250ms"``, ``"90s"``, ``"15m"``, ``"2h"``, ``"7d"``, ``"2w"``."""
    number = _number(value, field=field, what="duration", example="90s or 2h")
    if number is not None:
        return number
    m = _DURATION_RE.fullmatch(str(value))
    if not m:
        raise ConfigError(field, f"cannot parse duration {value!r} (examples: 30, 90s, 15m, 2h, 7d)")
    seconds = float(m.group(1)) * _SECONDS[(m.group(2) or "s").lower()]
    if not math.isfinite(seconds):  # "9999…9w" overflows to inf
        raise ConfigError(field, f"duration {str(value)[:24]}… is too long to be a duration")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest exact text :func:`parse_duration` reads back: ``3600`` → ``"1h"``, ``0.2`` → ``"200ms"``."""
    ms = round(float(seconds) * 1000)
    for unit in ("w", "d", "h", "m", "s", "ms"):
        step = round(_SECONDS[unit] * 1000)
        if ms % step == 0 and (ms or unit == "s"):
            return f"{ms // step}{unit}"
    raise AssertionError("unreachable: every whole number of ms is a multiple of 1ms")


def human_size(n: int | float | None) -> str:
    """``1536`` → ``"1.5 KiB"``: binary units, like ``du -h`` and systemd; ``None`` → ``"-"``."""
    if n is None:
        return "-"
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in _BINARY:
        if value < 1024 or unit == _BINARY[-1]:
            return f"{sign}{int(value)} B" if unit == "B" else f"{sign}{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
