"""How the CLI fails: one line, one exit code from the table, one JSON object with ``--json``.

Hostile arguments (bytes that are not UTF-8, empty strings, 10k-character
keys, ``..`` and ``/`` in keys, negative, NaN and huge sizes) run through the
real ``adstore`` executable: none may exit 70 (a bug) or die of a signal.
Read-only commands on a path without a store say so and create nothing; ``gc``
that cannot meet its limit exits 8 and names what kept the bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from daemon_support import populate, write_config

from adstore.daemon.cli import main
from adstore.daemon.commands import _flatten, entry_dict
from adstore.store import Entry, InvalidKey, KeyNotFound, Store
from adstore.store.index.rows import MAX_JSON_DEPTH

KIB = 1024
READ_ONLY = (["stats"], ["ls"], ["inspect", "abc"], ["explain", "abc"], ["verify"], ["stats", "--prometheus"])


def _exe() -> list[str]:
    exe = shutil.which("adstore")
    return [exe] if exe else [sys.executable, "-m", "adstore.daemon"]


def _run(argv: list[str | bytes], cwd: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*_exe(), *argv], capture_output=True, timeout=120, cwd=cwd)


def _nest(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.fixture
def populated(tmp_path: Path) -> tuple[Path, list[str]]:
    root = tmp_path / "populated"
    return root, populate(root, count=3, size=70 * KIB, prefix="p")


# ---------------------------------------------------------------- --json errors
@pytest.mark.parametrize(
    "argv, code, reason",
    [
        (["inspect", "nope"], 3, "unknown_key"),
        (["gc", "--max-size", "banana"], 2, "usage"),
        (["ls", "--no-such-flag"], 2, "usage"),
        (["daemon", "--once", "--high-watermark", "2"], 2, "config"),
        (["stats", "--config", "/dev/null"], 2, "config"),
        (["inspect", os.fsdecode(b"ab\xff")], 3, "bad_key"),
    ],
)
def test_json_errors_are_one_object_on_stdout(capsys, populated, argv, code, reason):
    root, _ = populated
    assert main(["--json", "--root", str(root), *argv]) == code
    out, err = capsys.readouterr()
    error = json.loads(out)["error"]
    assert error == {"reason": reason, "message": error["message"], "exit_code": code}
    assert err.count("\n") == 1 and error["message"] in err


# ---------------------------------------------------------------- no store
@pytest.mark.parametrize("argv", READ_ONLY + (["rm", "abc"], ["pin", "abc"]))
@pytest.mark.parametrize("where", ["absent", "empty directory"])
def test_read_only_commands_on_no_store_say_so_and_create_nothing(capsys, tmp_path, argv, where):
    root = tmp_path / "nothing"
    if where == "empty directory":
        root.mkdir()
    assert main(["--json", "--root", str(root), *argv]) == 13
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["reason"] == "no_store" and str(root) in error["message"]
    assert (not root.exists()) if where == "absent" else not any(root.iterdir())


def test_verify_fix_still_creates_a_missing_store(capsys, tmp_path):
    assert main(["--root", str(tmp_path / "new"), "verify", "--fix"]) == 0
    assert (tmp_path / "new" / "index").is_dir()


# ---------------------------------------------------------------- gc that cannot meet the limit
def test_gc_blocked_by_a_lease_a_pin_and_the_grace_period_exits_8_naming_them(capsys, populated):
    root, keys = populated
    with Store.open(root) as store, store.lease(keys[1]):
        store.pin(keys[0])
        assert main(["--json", "--root", str(root), "gc", "--max-size", "1", "--grace-period", "0"]) == 8
        error = json.loads(capsys.readouterr().out)["error"]
        assert error["reason"] == "over_budget" and error["exit_code"] == 8
        details = error["details"]
        assert details["blocked"] == {"pinned": [keys[0]], "leased": [keys[1]]}
        assert details["over_bytes"] == 2 * 70 * KIB - 1 and details["eviction"]["victims"] == [keys[2]]
        # Without --json: the plan, then one line naming what blocked it and the bytes still over.
        assert main(["--root", str(root), "gc", "--max-size", "1", "--grace-period", "1h"]) == 8
        out, err = capsys.readouterr()
        assert "skipped 2 entries" in out
        assert err.startswith("adstore gc: error: still 140.0 KiB (143359 bytes) over max_size 1 B: kept by ")
        assert "1 entry pinned" in err and "1 entry leased" in err
    # Young entries: the grace period keeps them.
    assert main(["--json", "--root", str(root), "gc", "--max-size", "1", "--grace-period", "1h"]) == 8
    details = json.loads(capsys.readouterr().out)["error"]["details"]
    assert details["blocked"] == {"pinned": [keys[0]], "grace_period": [keys[1]]}
    # A dry run that could meet the limit exits 0; one that could not exits 8 as well.
    assert main(["--root", str(root), "gc", "--dry-run", "--max-size", "1G"]) == 0
    assert main(["--root", str(root), "gc", "--dry-run", "--max-size", "1", "--grace-period", "0"]) == 8


# ---------------------------------------------------------------- deep and strange keys
def test_deep_metadata_and_components_are_clear_errors_at_publish(tmp_path):
    with Store.open(tmp_path / "s") as store:
        ref = store.put_bytes(b"x")
        for field in ("meta", "components"):
            with pytest.raises(InvalidKey, match="nested more than"):
                store.publish("k", generation=1, artifacts={"a": ref}, **{field: {"x": _nest(5000)}})
        with pytest.raises(InvalidKey, match="not JSON data"):
            store.publish("k", generation=1, artifacts={"a": ref}, meta={"x": {1, 2}})
        with pytest.raises(KeyNotFound):
            store.resolve_key("")
        with pytest.raises(InvalidKey, match="1-200 characters"):
            store.resolve_key(os.fsdecode(b"\xff"))
        with pytest.raises(InvalidKey, match=r"\(10002 characters\)"):
            store.resolve_key("a" * 10_000)


def test_deepest_allowed_components_show_in_inspect_and_explain(capsys, tmp_path):
    root = tmp_path / "s"
    with Store.open(root) as store:
        gen = store.new_generation()
        store.publish(
            "deep",
            generation=gen,
            artifacts={"a": store.put_bytes(b"x")},
            components={"model": _nest(MAX_JSON_DEPTH - 1)},
        )
        store.commit("deep", generation=gen)
    for argv in (["inspect", "deep"], ["explain", "deep"], ["explain", "deep", "deep"]):
        for fmt in ([], ["--json"]):
            assert main(["--root", str(root), *fmt, *argv]) == 0, argv
            capsys.readouterr()


def test_rendering_never_recurses():
    """Components read from an index written before the depth limit are still shown."""
    deep = _nest(20_000)
    assert _flatten({"m": deep}) == {"m" + ".a" * 19_999: {}}
    entry = Entry(key="k", namespace="n", world_size=1, components=deep, created=0.0, last_access=0.0)
    assert entry_dict(entry)["components"] is deep


# ---------------------------------------------------------------- hostile arguments, real executable
KEYS: tuple[str | bytes, ...] = (
    b"\xff\xfe",
    "",
    "a" * 10_000,
    "..",
    "../../etc/passwd",
    "/",
    "a/b",
    "-",
    " ",
    "\n",
    "é",
    "%s%n",
    "*",
    "--",
)
NUMBERS: tuple[str | bytes, ...] = (
    "-1",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "1e400",
    "9" * 5000,
    "9" * 400 + "w",
    "0",
    "-0",
    "0x10",
    "１２",
    "1_000",
    "",
    " ",
    "10%",
    "101%",
    "-5%",
    "1e-300",
    b"\xff",
    "18446744073709551617",
)


def _hostile_cases(root: Path, fifo: Path, *, full: bool) -> list[list[str | bytes]]:
    """Every hostile value with every command that takes it (``full``), or with two of them in turn."""
    r = ["--root", str(root)]
    key_cmds: list[list[str | bytes]] = [
        [*r, "inspect"],
        [*r, "explain"],
        [*r, "rm", "--dry-run"],
        [*r, "rm"],
        [*r, "pin"],
        [*r, "unpin"],
        [*r, "ls", "--match"],
        [*r, "ls", "--namespace"],
        [*r, "ls", "--sort"],
        [*r, "--json", "inspect"],
        [*r, "daemon", "--once", "--max-size", "1G", "--log-level"],
        [*r, "stats", "--config"],
        [*r, "gc", "--dry-run", "--config"],
    ]
    number_cmds: list[list[str | bytes]] = [
        [*r, "ls", "--limit"],
        [*r, "ls", "--unused-for"],
        [*r, "ls", "--min-size"],
        [*r, "gc", "--dry-run", "--max-size"],
        [*r, "gc", "--dry-run", "--min-free"],
        [*r, "gc", "--dry-run", "--older-than"],
        [*r, "gc", "--dry-run", "--batch-size"],
        [*r, "gc", "--dry-run", "--max-size", "1G", "--grace-period"],
        [*r, "daemon", "--once", "--max-size"],
        [*r, "daemon", "--once", "--high-watermark"],
        [*r, "daemon", "--once", "--max-size", "1G", "--debounce"],
        [*r, "daemon", "--once", "--max-size", "1G", "--batch-size"],
    ]
    root_cmds: list[list[str | bytes]] = [["stats"], ["ls"], ["verify"], ["inspect", "k"]]

    def pick(cmds: list[list[str | bytes]], i: int) -> list[list[str | bytes]]:
        return cmds if full else [cmds[(2 * i) % len(cmds)], cmds[(2 * i + 1) % len(cmds)]]

    cases: list[list[str | bytes]] = []
    for i, key in enumerate(k for k in KEYS if k != "--"):
        cases += [[*cmd, key] for cmd in pick(key_cmds, i)] + [[*r, "explain", key, key]]
    for i, value in enumerate(NUMBERS):
        cases += [[*cmd, value] for cmd in pick(number_cmds, i)]
    for i, root_arg in enumerate((b"\xff", "", "a" * 10_000, "/dev/null", "/etc/passwd/x", str(fifo))):
        cases += [["--root", root_arg, *cmd] for cmd in pick(root_cmds, i)]
    return cases


@pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_hostile_arguments_never_exit_70_or_die_of_a_signal(populated, tmp_path, full):
    root, _ = populated
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    work = tmp_path / "cwd"  # anything written relative to the working directory lands here
    work.mkdir()
    cases = _hostile_cases(root, fifo, full=full)
    assert len(cases) > (400 if full else 90)
    with ThreadPoolExecutor(max_workers=max(8, 2 * (os.cpu_count() or 4))) as pool:
        results = list(pool.map(lambda argv: (argv, _run(argv, work)), cases))
    bad = [
        (argv if len(repr(argv)) < 300 else repr(argv)[:300], p.returncode, p.stderr[-300:])
        for argv, p in results
        if p.returncode < 0 or p.returncode == 70 or b"Traceback" in p.stderr
    ]
    assert not bad, bad
    codes = {p.returncode for _, p in results}
    assert codes <= {0, 1, 2, 3, 5, 7, 8, 11, 12, 13}, codes
    # 5 (a daemon already runs) is the right answer only to a daemon started while another runs:
    # the cases run concurrently, so two ``daemon --once`` on the same root may meet.
    assert all("daemon" in argv and b"already" in p.stderr for argv, p in results if p.returncode == 5), [
        (argv, p.stderr[-200:]) for argv, p in results if p.returncode == 5
    ]
    with Store.open(root) as store:  # nothing hostile touched the store
        assert len(list(store.entries())) == 3 and store.verify().ok


def test_a_config_value_is_checked_even_when_a_flag_overrides_it(capsys, tmp_path):
    config = write_config(tmp_path / "a.toml", max_size="lots", root=str(tmp_path / "s"))
    assert main(["daemon", "--once", "--config", str(config), "--max-size", "1G"]) == 2
    assert "'max_size'" in capsys.readouterr().err
    # gc --config takes the config's root
    good = write_config(tmp_path / "b.toml", max_size="1G", root=str(tmp_path / "s"))
    assert main(["--json", "gc", "--config", str(good)]) == 0
    assert (tmp_path / "s" / "index").is_dir()
