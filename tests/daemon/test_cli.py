"""Every CLI command on an empty, a populated and a corrupted store.

Most run in-process through ``main([...])``; a few run the installed
``adstore`` console script to check the entry point and exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_support import populate, write_config

from adstore.daemon.cli import EXIT_CODES, exit_code_for, main
from adstore.daemon.errors import AlreadyRunning, AmbiguousKey, FeatureUnavailable, UnknownKey
from adstore.store import Store
from adstore.store.errors import (
    AdstoreError,
    BlobMissing,
    ChecksumMismatch,
    ConfigError,
    CorruptRow,
    OverBudget,
    StoreError,
)

KIB = 1024


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, object]:
    code, out, err = run(capsys, *argv, "--json")
    return code, json.loads(out)


def snapshot(root: Path) -> tuple:
    """Everything gc could change: entries, size, files on disk."""
    with Store.open(root) as store:
        entries = sorted((e.key, e.pinned) for e in store.entries())
        size = store.size()
    files = sorted(str(p.relative_to(root)) for p in (root / "blobs").rglob("*") if p.is_file())
    return entries, size, files


@pytest.fixture
def empty(tmp_path: Path) -> Path:
    root = tmp_path / "empty"
    Store.open(root).close()
    return root


@pytest.fixture
def populated(tmp_path: Path) -> tuple[Path, list[str]]:
    root = tmp_path / "populated"
    keys = populate(root, count=4, size=70 * KIB, prefix="p")  # file blobs
    keys += populate(root, count=2, size=1 * KIB, prefix="q", world_size=2)  # inline, two ranks
    return root, keys


@pytest.fixture
def corrupted(tmp_path: Path) -> tuple[Path, list[str]]:
    root = tmp_path / "corrupted"
    keys = populate(root, count=4, size=70 * KIB, prefix="c")
    with Store.open(root) as store:
        flipped = store.blob_path(store.manifests(keys[0])[0].artifacts["module.pt"])
        data = bytearray(flipped.read_bytes())
        data[100] ^= 0xFF
        os.chmod(flipped, 0o644)
        flipped.write_bytes(bytes(data))
        store.blob_path(store.manifests(keys[1])[0].artifacts["module.pt"]).unlink()
        gen = store.new_generation()  # a writer that died before commit
        store.publish(
            "d" * 64, rank=0, world_size=2, generation=gen, artifacts={"module.pt": store.put_bytes(b"partial")}
        )
        index = store.index  # an undecodable index record
        index.write(lambda txn: txn.put(b"e" * 64, b"\x00not json", db=index.db["entries"]))
    orphan = root / "blobs" / "ab" / ("ab" + "0" * 62)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"orphan")
    return root, keys


# ---------------------------------------------------------------- empty store
def test_every_command_on_an_empty_store(capsys, empty: Path) -> None:
    r = str(empty)
    code, data = run_json(capsys, "stats", "--root", r)
    assert code == 0 and data["entries"] == 0 and data["physical_bytes"] == 0
    code, out, _ = run(capsys, "--root", r, "stats")
    assert code == 0 and "Entries" in out and "not running" in out
    code, data = run_json(capsys, "ls", "--root", r)
    assert code == 0 and data == {"total": 0, "entries": []}
    code, out, _ = run(capsys, "ls", "--root", r)
    assert code == 0 and "no entries" in out
    for argv in (["inspect", "abc"], ["explain", "abc"], ["rm", "abc"], ["pin", "abc"], ["unpin", "abc"]):
        code, out, err = run(capsys, *argv, "--root", r)
        assert code == 3, argv
        assert err.count("\n") == 1 and "no entry matches key 'abc'" in err
    code, data = run_json(capsys, "verify", "--root", r)
    assert code == 0 and data["ok"] and data["blobs_checked"] == 0
    code, data = run_json(capsys, "gc", "--root", r, "--dry-run", "--max-size", "1M")
    assert code == 0 and data["bytes_to_free"] == 0 and data["eviction"]["victims"] == []
    code, out, _ = run(capsys, "gc", "--root", r)
    assert code == 0 and "freed 0 B" in out
    code, out, err = run(capsys, "daemon", "--root", r, "--once", "--max-size", "1M")
    assert code == 0


# ---------------------------------------------------------------- populated store
def test_stats_and_ls_on_a_populated_store(capsys, populated) -> None:
    root, keys = populated
    r = str(root)
    with Store.open(root) as store:
        store.lookup(keys[0])  # one hit
        store.lookup("f" * 64)  # one miss (absent)
    code, data = run_json(capsys, "stats", "--root", r)
    assert code == 0
    assert data["entries"] == 6 and data["counters"]["hits"] == 1 and data["counters"]["misses.absent"] == 1
    code, out, _ = run(capsys, "stats", "--root", r)
    assert "Hit rate       50.0%" in out and "absent" in out and "Physical size" in out
    cfg = write_config(root.parent / "a.toml", max_size="1G", min_free="5%")
    code, out, _ = run(capsys, "stats", "--root", r, "--config", str(cfg))
    assert "max 1.0 GiB" in out and "min free 5%" in out

    code, data = run_json(capsys, "ls", "--root", r)
    assert data["total"] == 6 and data["entries"][0]["key"] == keys[0]  # most recently used first
    code, data = run_json(capsys, "ls", "--root", r, "--sort", "size", "--limit", "2")
    assert [e["bytes"] for e in data["entries"]] == [70 * KIB, 70 * KIB] and data["total"] == 6
    code, data = run_json(capsys, "ls", "--root", r, "--sort", "size", "--reverse", "--limit", "1")
    assert data["entries"][0]["bytes"] == 2 * KIB  # the two-rank inline entry
    code, data = run_json(capsys, "ls", "--root", r, "--match", keys[4][:10])
    assert [e["key"] for e in data["entries"]] == [keys[4]]
    code, data = run_json(capsys, "ls", "--root", r, "--min-size", "50K")
    assert data["total"] == 4
    code, data = run_json(capsys, "ls", "--root", r, "--unused-for", "1h")
    assert data["total"] == 0
    code, out, _ = run(capsys, "ls", "--root", r, "--limit", "3")
    assert "3 of 6 entries" in out and "2/2" in out or "1/1" in out


def test_stats_adds_no_sum_over_an_integrations_unlike_counters(capsys, tmp_path) -> None:
    """Tried as a user: "Inductor 6" added files placed to hits, "Seed 8" a reason to its own total."""
    with Store.open(tmp_path) as store:
        store.count({"inductor.files_placed": 4, "inductor.hits.inductor_fx_graph": 1})
        store.count({"seed.misses": 4, "seed.misses.unsafe_root": 4})
        store.count({"misses.absent": 2})  # the store's outcome counters keep the sum of their reasons
    code, out, _ = run(capsys, "stats", "--root", str(tmp_path))
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.strip()}
    assert code == 0 and rows["Inductor"] == "Inductor" and rows["Seed"] == "Seed", out
    assert rows["files_placed"] == "4" and rows["hits.inductor_fx_graph"] == "1" and rows["misses.unsafe_root"] == "4"
    assert rows["Misses"] == "2" and rows["absent"] == "2"


def test_stats_counts_unreferenced_blobs_apart_from_the_content_entries_hold(capsys, tmp_path) -> None:
    """Blobs waiting for the sweep are neither content nor dedup: they get a line of their own, with their
    bytes and the command that reclaims them, and the dedup ratio never falls below one."""
    root = tmp_path / "s"
    keys = populate(root, count=3, size=70 * KIB, prefix="a")
    with Store.open(root) as store:  # an entry replaced or removed leaves its blobs to the sweep
        store.plan_remove(keys[:2]).execute()
    code, data = run_json(capsys, "stats", "--root", str(root))
    assert code == 0 and data["unreferenced_blobs"] == 2
    assert data["unreferenced_bytes"] == data["unreferenced_content_bytes"] == 2 * 70 * KIB  # random: stored raw
    assert data["logical_bytes"] == 70 * KIB and data["dedup_ratio"] == 1.0
    code, out, _ = run(capsys, "stats", "--root", str(root))
    assert "70.0 KiB referenced (dedup 1.00x)" in out
    assert "2 blob(s), 140.0 KiB on disk" in out and "adstore gc --grace-period 0" in out
    code, out, _ = run(capsys, "gc", "--root", str(root), "--grace-period", "0")
    code, data = run_json(capsys, "stats", "--root", str(root))
    assert data["unreferenced_blobs"] == 0 and data["entries"] == 1  # the sweep took the blobs, not the entry
    assert "Unreferenced   none" in run(capsys, "stats", "--root", str(root))[1]


def test_inspect_and_explain_on_a_populated_store(capsys, populated) -> None:
    root, keys = populated
    r = str(root)
    code, data = run_json(capsys, "inspect", keys[4][:8], "--root", r)  # unambiguous prefix
    assert code == 0
    assert data["entry"]["key"] == keys[4] and len(data["manifests"]) == 2
    assert {m["rank"] for m in data["manifests"]} == {0, 1}
    assert all(m["artifacts"]["module.pt"]["size"] == KIB for m in data["manifests"])
    # module.pt is not a real snapshot: the summary degrades to a note, never a failure.
    for summary in data["snapshots"].values():
        assert set(summary) & {"unavailable", "error"} or summary
    code, out, _ = run(capsys, "inspect", keys[0], "--root", r, "--no-summary")
    assert code == 0 and "rank 0/1" in out and "module.pt" in out and "committed" in out

    code, data = run_json(capsys, "explain", keys[0], "--root", r)
    assert data["components"] == {"model": {"prefix": "p", "i": 0}}
    code, data = run_json(capsys, "explain", keys[0], keys[4], "--root", r)
    assert code == 0 and data["differing"] == ["model"]
    paths = {d["path"] for d in data["components"]["model"]["differences"]}
    assert paths == {"model.prefix"}  # i is 0 in both
    code, out, _ = run(capsys, "explain", keys[1], keys[2], "--root", r)
    assert "model.i: A=1  B=2" in out and "DIFFERS" in out


def test_ambiguous_prefix_is_a_clear_error(capsys, tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = populate(root, count=40, size=10, prefix="amb")
    firsts = [k[0] for k in keys]
    char = max(set(firsts), key=firsts.count)  # 40 keys over 16 hex digits: some share a first digit
    code, out, err = run(capsys, "inspect", char, "--root", str(root))
    assert code == 4 and "ambiguous" in err and err.count("\n") == 1


def test_pin_unpin_rm_and_gc_on_a_populated_store(capsys, populated) -> None:
    root, keys = populated
    r = str(root)
    code, out, _ = run(capsys, "pin", keys[0][:12], "--root", r)
    assert code == 0 and f"pinned {keys[0]}" in out
    code, data = run_json(capsys, "ls", "--root", r, "--pinned")
    assert [e["key"] for e in data["entries"]] == [keys[0]]
    code, out, _ = run(capsys, "stats", "--root", r)
    assert "Pinned         70.0 KiB" in out

    before = snapshot(root)
    code, data = run_json(capsys, "gc", "--root", r, "--dry-run", "--max-size", "1", "--grace-period", "0")
    # The pinned entry keeps the store over 1 byte: the over-budget code, naming it; the plan in the details.
    assert code == 8 and data["error"]["reason"] == "over_budget"
    assert data["error"]["details"]["blocked"] == {"pinned": [keys[0]]}
    data = data["error"]["details"]
    assert data["dry_run"] and data["bytes_freed"] == 0
    assert len(data["eviction"]["victims"]) == 5 and keys[0] not in data["eviction"]["victims"]
    assert data["eviction"]["bytes_to_free"] > 0
    assert snapshot(root) == before, "gc --dry-run changed the store"
    code, out, _ = run(capsys, "gc", "--root", r, "--dry-run", "--older-than", "0s", "--grace-period", "0")
    assert "dry run: nothing removed" in out and "evict: 5 entries" in out
    assert snapshot(root) == before

    code, out, _ = run(capsys, "rm", keys[1], "--root", r, "--dry-run")
    assert code == 0 and "dry run" in out and snapshot(root) == before
    code, data = run_json(capsys, "rm", keys[1], keys[2][:10], "--root", r)
    assert code == 0 and sorted(data["plan"]["victims"]) == sorted([keys[1], keys[2]])
    with Store.open(root) as store:
        assert store.entry(keys[1]) is None and store.entry(keys[2]) is None

    code, data = run_json(capsys, "gc", "--root", r, "--max-size", "1", "--grace-period", "0")
    assert code == 8 and data["error"]["details"]["bytes_freed"] > 0
    assert data["error"]["details"]["over_bytes"] == 70 * KIB - 1  # the pinned entry, over a 1-byte limit
    with Store.open(root) as store:
        assert [e.key for e in store.entries()] == [keys[0]]  # only the pinned entry is left
        assert store.verify().ok
    code, out, _ = run(capsys, "unpin", keys[0], "--root", r)
    assert code == 0 and "unpinned" in out
    code, out, _ = run(capsys, "gc", "--root", r, "--max-size", "1", "--grace-period", "0")
    assert code == 0 and "freed 70.0 KiB" in out


def test_rm_refuses_a_leased_entry(capsys, populated) -> None:
    root, keys = populated
    with Store.open(root) as store, store.lease(keys[3]):
        code, data = run_json(capsys, "rm", keys[3], "--root", str(root))
        assert code == 1 and data["plan"]["victims"] == []
        assert store.entry(keys[3]) is not None


def test_daemon_once_enforces_budget(capsys, populated) -> None:
    root, keys = populated
    cfg = write_config(
        root.parent / "d.toml", max_size="150K", grace_period="0s", high_watermark=0.9, low_watermark=0.5
    )
    code, out, err = run(capsys, "daemon", "--config", str(cfg), "--root", str(root), "--once")
    assert code == 0
    with Store.open(root) as store:
        assert store.size() <= 75 * KIB
        assert store.entry(keys[0]) is not None or store.entry(keys[5]) is not None  # MRU survive
    code, data = run_json(capsys, "stats", "--root", str(root))
    assert data["daemon"]["last_pass"]["evicted_entries"] == 3  # 284K - 3 x 70K <= 75K
    assert data["daemon"]["running"] is False


def test_daemon_rejects_bad_config_with_the_field_name(capsys, empty: Path) -> None:
    code, out, err = run(capsys, "daemon", "--root", str(empty), "--max-size", "huge")
    assert code == 2 and "'max_size'" in err and err.count("\n") == 1
    bad = empty.parent / "bad.toml"
    bad.write_text("max_size = [1, 2\n")
    code, out, err = run(capsys, "daemon", "--root", str(empty), "--config", str(bad))
    assert code == 2 and "not valid TOML" in err
    code, out, err = run(capsys, "daemon", "--root", str(empty))
    assert code == 2 and "no budget" in err


@pytest.mark.slow
def test_demo_runs_through_the_cli(capsys, empty: Path) -> None:
    """The real torch-side demo (slow: two pipeline runs in fresh processes)."""
    code, data = run_json(capsys, "demo", "--root", str(empty), "--layers", "1", "--hidden", "32")
    assert code == 0 and isinstance(data, dict) and data
    code, out, err = run(capsys, "demo", "--root", str(empty), "--layers", "1", "--hidden", "32")
    assert code == 0 and "warm run" in out


def test_demo_without_the_integration_fails_in_one_line(empty: Path) -> None:
    """Where the torch side cannot be imported, `adstore demo` is one line and exit 6."""
    code = (
        "import sys; sys.modules['adstore.integration.reference.demo'] = None; "
        "from adstore.daemon.cli import main; "
        f"sys.exit(main(['demo', '--root', {str(empty)!r}]))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 6, p.stderr
    assert p.stderr.count("\n") == 1 and "demo" in p.stderr and "Traceback" not in p.stderr


# ---------------------------------------------------------------- corrupted store
def test_every_command_on_a_corrupted_store(capsys, corrupted) -> None:
    root, keys = corrupted
    r = str(root)
    code, data = run_json(capsys, "stats", "--root", r)
    assert code == 0 and data["entries"] >= 5
    code, data = run_json(capsys, "ls", "--root", r)
    assert code == 0 and keys[0] in {e["key"] for e in data["entries"]}
    code, data = run_json(capsys, "inspect", keys[1], "--root", r)  # its blob file is gone
    assert code == 0 and data["manifests"][0]["artifacts"]["module.pt"]["size"] == 70 * KIB
    for summary in data["snapshots"].values():  # unreadable snapshot: a note, not a failure
        assert "error" in summary or "unavailable" in summary
    code, out, _ = run(capsys, "inspect", "d" * 64, "--root", r, "--no-summary")
    assert code == 0 and "UNCOMMITTED" in out
    code, data = run_json(capsys, "explain", keys[0], keys[1], "--root", r)
    assert code == 0 and data["differing"] == ["model"]

    code, data = run_json(capsys, "verify", "--root", r)
    assert code == 1 and not data["ok"]
    text = "\n".join(data["problems"])
    assert "corrupt record" in text and "missing" in text and "hashes to" in text
    code, out, _ = run(capsys, "verify", "--root", r)
    assert code == 1 and "verify --fix" in out

    before = snapshot(root)
    code, data = run_json(capsys, "gc", "--root", r, "--dry-run", "--max-size", "1", "--grace-period", "0")
    assert code == 0 and snapshot(root) == before
    code, data = run_json(capsys, "verify", "--root", r, "--fix")
    assert code == 0 and data["fixed"]
    code, data = run_json(capsys, "verify", "--root", r)
    assert code == 0 and data["ok"]
    code, out, _ = run(capsys, "pin", keys[2], "--root", r)
    assert code == 0
    code, data = run_json(capsys, "gc", "--root", r, "--max-size", "1", "--grace-period", "0")
    assert code == 8 and data["error"]["details"]["blocked"] == {"pinned": [keys[2]]}
    code, data = run_json(capsys, "rm", keys[2], "--root", r)
    assert code == 0
    code, data = run_json(capsys, "verify", "--root", r)
    assert code == 0 and data["ok"]


# ---------------------------------------------------------------- error table
def test_error_table_maps_every_class_once_in_order() -> None:
    assert exit_code_for(ConfigError("x", "y")) == 2
    assert exit_code_for(UnknownKey("k")) == 3
    assert exit_code_for(AmbiguousKey("k", ["ka", "kb"])) == 4
    assert exit_code_for(AlreadyRunning("/x/daemon.lock", 1)) == 5
    assert exit_code_for(FeatureUnavailable("demo", "no torch")) == 6
    assert exit_code_for(OverBudget(1, 2, 3)) == 8
    assert exit_code_for(ChecksumMismatch("a" * 64, "b" * 64)) == 9
    assert exit_code_for(BlobMissing("a" * 64)) == 9
    assert exit_code_for(CorruptRow("entries", b"k", "bad")) == 9
    assert exit_code_for(StoreError("x")) == 10
    assert exit_code_for(AdstoreError("x")) == 10
    assert exit_code_for(PermissionError(13, "denied")) == 11
    assert exit_code_for(RuntimeError("bug")) == 70
    codes = [code for _, code in EXIT_CODES]
    assert 0 not in codes and 1 not in codes  # 0 = success, 1 = a check failed


def test_usage_errors_are_one_line_exit_2(capsys) -> None:
    code, out, err = run(capsys, "ls", "--sort", "nonsense")
    assert code == 2 and err.count("\n") == 1
    code, out, err = run(capsys, "gc", "--max-size", "ten")
    assert code == 2 and "cannot parse size" in err
    code, out, err = run(capsys)
    assert code == 2


def test_unwritable_root_is_one_line(capsys, tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("not a directory")
    code, out, err = run(capsys, "stats", "--root", str(target / "store"))
    assert code == 13 and err.count("\n") == 1  # read-only: no store there, and none is created
    code, out, err = run(capsys, "gc", "--root", str(target / "store"))  # a writer: the same line, not ENOTDIR
    assert code == 13 and err.count("\n") == 1 and f"{target} is a file, not a directory" in err


# ---------------------------------------------------------------- console script
def _console(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("adstore")
    cmd = [exe, *argv] if exe else [sys.executable, "-m", "adstore.daemon", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def test_console_script_exit_codes(populated, corrupted) -> None:
    root, keys = populated
    p = _console("--json", "ls", "--root", str(root))
    assert p.returncode == 0 and json.loads(p.stdout)["total"] == 6
    p = _console("inspect", "nope", env={"ADSTORE_ROOT": str(root)})
    assert p.returncode == 3 and p.stderr.strip() == "adstore inspect: error: no entry matches key 'nope'"
    croot, _ = corrupted
    p = _console("verify", "--root", str(croot))
    assert p.returncode == 1 and "Traceback" not in p.stderr and "problem:" in p.stdout
    p = _console("gc", "--root", str(croot), "--max-size", "banana")
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_python_dash_m_is_the_same_cli(empty: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "adstore.daemon", "stats", "--json", "--root", str(empty)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and json.loads(p.stdout)["entries"] == 0
    # The CLI never imports torch (the daemon must start fast and small).
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from adstore.daemon.cli import main; "
            f"main(['stats', '--root', {str(empty)!r}]); "
            "import adstore.daemon.daemon; print('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip().endswith("False"), probe.stdout + probe.stderr


def test_inspect_summarizes_a_real_snapshot(capsys, tmp_path: Path) -> None:
    """module.pt/hooks.json written by the integration codec: node counts, op histogram, hooks."""
    import torch

    from adstore.integration.snapshot import dump_module

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):  # noqa: ANN001
            return torch.relu(self.lin(x)) + 1

    with torch.device("meta"):
        gm = torch.fx.symbolic_trace(Tiny())
    artifacts = dump_module(gm)
    root = tmp_path / "snap"
    key = "5" * 64
    with Store.open(root) as store:
        gen = store.new_generation()
        store.publish(
            key,
            rank=0,
            world_size=1,
            generation=gen,
            namespace="pipeline",
            artifacts={n: store.put_bytes(b) for n, b in artifacts.items()},
        )
        store.commit(key, rank=0, generation=gen)
    code, data = run_json(capsys, "inspect", "555", "--root", str(root))
    assert code == 0
    summary = next(iter(data["snapshots"].values()))
    assert summary["nodes"] == 5 and summary["op_histogram"]["torch.relu"] == 1
    assert summary["hooks"]["total"] == 0
    code, out, _ = run(capsys, "inspect", "555", "--root", str(root))
    assert "op_histogram:" in out and "torch.relu" in out and "nodes: 5" in out
