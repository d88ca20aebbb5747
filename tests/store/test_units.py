"""store.units: one meaning for sizes, percentages and durations; Hypothesis round trips."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adstore.store.errors import ConfigError
from adstore.store.units import (
    MinFree,
    format_duration,
    human_size,
    parse_duration,
    parse_fraction,
    parse_min_free,
    parse_percent,
    parse_size,
)

BINARY = {"K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


@pytest.mark.parametrize("letter, power", sorted(BINARY.items()))
def test_binary_and_decimal_units(letter: str, power: int) -> None:
    for text in (f"3{letter}", f"3{letter}iB", f"3{letter.lower()}", f"3 {letter}i", f"3{letter.lower()}ib"):
        assert parse_size(text) == 3 * 1024**power, text
    for text in (f"3{letter}B", f"3{letter.lower()}b", f"3 {letter.lower()}B"):
        assert parse_size(text) == 3 * 1000**power, text


def test_sizes_documented_examples() -> None:
    assert parse_size("10G") == parse_size("10GiB") == 10 * 2**30
    assert parse_size("10GB") == 10**10
    assert parse_size("1.5G") == int(1.5 * 2**30)
    assert parse_size("123") == parse_size("123B") == parse_size(123) == 123
    assert parse_size(12.9) == 12
    assert parse_size("512MiB") == 512 * 1024**2 and parse_size("50K") == 50 * 1024


@pytest.mark.parametrize(
    "bad", ["ten", "-1", "1X", "1 KiBB", "", "1iB", "G", True, None, [1], float("inf"), float("nan"), -5]
)
def test_bad_sizes_name_the_field(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(bad, field="max_size")
    assert info.value.field == "max_size"


@given(
    st.integers(min_value=0, max_value=2**50),
    st.sampled_from(["", "B", "K", "KiB", "KB", "M", "MiB", "MB", "G", "GiB", "GB", "T", "TiB", "TB"]),
)
def test_sizes_round_trip(n: int, unit: str) -> None:
    letter = unit[:1] if unit not in ("", "B") else ""
    factor = (
        1 if not letter else (1000 if unit.endswith("B") and "i" not in unit else 1024) ** ("KMGT".index(letter) + 1)
    )
    assert parse_size(f"{n}{unit}") == n * factor
    assert parse_size(n) == n
    assert parse_size(f" {n} {unit.lower()} ") == n * factor


@given(st.integers(min_value=0, max_value=2**60))
def test_human_size_parses_back_within_its_rounding(n: int) -> None:
    text = human_size(n)
    back = parse_size(text.replace(" ", ""))
    unit = 1024 ** ["B", "KiB", "MiB", "GiB", "TiB", "PiB"].index(text.split()[1])
    assert abs(back - n) <= 0.05 * unit + 1


def test_human_size() -> None:
    assert human_size(0) == "0 B" and human_size(1023) == "1023 B"
    assert human_size(1536) == "1.5 KiB" and human_size(10 * 1024**3) == "10.0 GiB"
    assert human_size(None) == "-" and human_size(-2048) == "-2.0 KiB"


@given(st.floats(min_value=0, max_value=100, allow_nan=False))
def test_percentages_round_trip(pct: float) -> None:
    assert parse_percent(f"{pct!r}%", field="x") == pct
    assert parse_min_free(f"{pct!r}%") == MinFree(None, pct)


def test_percentages_and_min_free() -> None:
    assert parse_min_free("10%").of(1000) == 100
    assert parse_min_free("2G") == (2 * 1024**3, None) and parse_min_free("2G").of(1) == 2 * 1024**3
    assert parse_min_free("0%").of(1000) == 0 and parse_min_free("100%").of(1000) == 1000
    for bad in ("101%", "abc%", "-1%", "nan%"):
        with pytest.raises(ConfigError):
            parse_min_free(bad)
    assert parse_fraction("90%", field="x") == pytest.approx(0.9)
    assert parse_fraction(1, field="x") == 1.0
    for bad in (0, "0%", 1.5, True, "x", None):
        with pytest.raises(ConfigError):
            parse_fraction(bad, field="x")


@given(st.integers(min_value=0, max_value=10**9), st.sampled_from(["", "ms", "s", "m", "h", "d", "w"]))
def test_durations_round_trip(n: int, unit: str) -> None:
    factor = {"": 1, "ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[unit]
    assert parse_duration(f"{n}{unit}") == pytest.approx(n * factor)
    assert parse_duration(f"{n} {unit.upper()}") == pytest.approx(n * factor)


@given(st.integers(min_value=0, max_value=10**12))
def test_format_duration_round_trips_exactly(ms: int) -> None:
    text = format_duration(ms / 1000)
    assert parse_duration(text) == pytest.approx(ms / 1000)
    assert text[0].isdigit() and not any(c.isspace() for c in text)


def test_format_duration_picks_the_largest_exact_unit() -> None:
    assert [format_duration(s) for s in (0, 0.2, 1, 90, 600, 3600, 5400, 86400, 1209600)] == [
        "0s",
        "200ms",
        "1s",
        "90s",
        "10m",
        "1h",
        "90m",
        "1d",
        "2w",
    ]


@pytest.mark.parametrize("bad", ["soon", "1y", "-3s", "", True, None, float("inf"), -1])
def test_bad_durations(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_duration(bad, field="grace_period")
    assert info.value.field == "grace_period"


def test_units_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, adstore.store.units; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize(
    "parse, text",
    [
        (parse_size, "１０G"),  # fullwidth digits: \d and int() take them
        (parse_size, "١٠٠M"),  # Arabic-Indic
        (parse_duration, "٣s"),
        (parse_duration, "１０"),
        (lambda v: parse_percent(v, field="x"), "１０%"),
        (lambda v: parse_percent(v, field="x"), "1_0%"),  # float() reads underscores
        (lambda v: parse_fraction(v, field="x"), "٠.٩"),
        (parse_min_free, "５%"),
    ],
)
def test_numbers_from_a_user_are_ascii_digits(parse, text) -> None:
    with pytest.raises(ConfigError):
        parse(text)
