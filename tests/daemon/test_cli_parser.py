"""The ``adstore`` argument parser: help on everything, --version, usage errors exit 2."""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Iterator

import pytest

from adstore.daemon.cli import build_parser, main
from adstore.daemon.config import SETTINGS


def _parsers(parser: argparse.ArgumentParser, path: str = "adstore") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def test_every_flag_and_argument_has_help() -> None:
    missing = []
    seen = 0
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            seen += 1
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
            if isinstance(action, argparse._SubParsersAction):
                missing.extend(f"{path} {c.dest}" for c in action._choices_actions if not c.help)
        parser.format_help()  # every help text formats (a stray % would raise here)
    assert seen > 60 and not missing, missing


def test_daemon_flags_come_from_the_settings_table() -> None:
    daemon = dict(_parsers(build_parser()))["adstore daemon"]
    flags = {opt: a for a in daemon._actions for opt in a.option_strings}
    for row in SETTINGS:
        if row.name == "root":  # the common --root of every command
            continue
        action = flags[row.flag]
        assert action.dest == row.name and action.metavar == row.kind.metavar
        assert row.help.replace("%", "%%") in action.help and row.default_text() in action.help


def test_help_documents_the_units(capsys) -> None:
    for argv in (["--help"], ["gc", "--help"], ["daemon", "--help"]):
        assert main(argv) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "KiB/MiB/GiB/TiB, powers of 1024" in out and "KB/MB/GB/TB (powers of 1000)" in out, argv


def test_version(capsys) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == f"adstore {importlib.metadata.version('adstore')}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "a", "b", "c"], "at most 2"),
        (["gc", "--min-free", "120%"], "0%..100%"),
        (["gc", "--older-than", "soon"], "cannot parse duration"),
        (["ls", "--limit", "0"], "at least 1"),
        (["demo", "--layers", "x"], "whole number"),
    ],
)
def test_usage_errors_exit_2_in_one_line(capsys, tmp_path, argv: list[str], message: str) -> None:
    assert main([*argv, "--root", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_gc_min_free_flag_keeps_a_percentage_and_reads_sizes() -> None:
    parser = build_parser()
    assert parser.parse_args(["gc", "--min-free", " 10% "]).min_free == "10%"
    assert parser.parse_args(["gc", "--min-free", "1GB"]).min_free == 10**9
