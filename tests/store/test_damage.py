"""The damage suite: a damaged index or hostile paths never kill, never crash, never lie.

Each case copies one small store, damages it, and runs ``damage_child.py``
in a child process (so a SIGBUS/SIGSEGV is observed, not suffered): lookups
and reads like a pipeline, then ``adstore stats``, ``verify``, ``verify
--fix`` and lookups again.  Every case must show no signal death, no exit 70
(internal error), no raw ``lmdb`` exception, no wrong bytes; ``verify --fix``
must repair (exit 0), and afterwards the store opens and every entry is a hit
with the saved bytes again: the index is rebuilt from the blob files and the
on-disk records (invariant 9), so damage to the index alone loses no entry.  Damage: ``data.mdb`` truncated at
page boundaries and odd sizes, random bytes over index pages (many seeds),
whole pages overwritten, LMDB's free-page list naming pages in use or past
the end, keys spelled otherwise (out of order), a file that is not LMDB,
symlinked directories and blob files.  The tallies go to ``bench-results/faults.json`` (``damage`` and
``damage_slow``) for docs/reliability.md, "Figures".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from store_helpers import report_figures, run_cli, save
from test_diskfull import small_fs  # noqa: F401  (the 8 MiB tmpfs fixture; root only)

from adstore.store import Store
from adstore.store.index.file import read_meta

CHILD = Path(__file__).with_name("damage_child.py")
PAGE = 4096
KEYS = 12

Damage = Callable[[Path], None]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, dict[str, dict[str, str]]]:
    """A store of 12 entries (an inline and a file blob each) and the digests each key must serve."""
    root = tmp_path_factory.mktemp("damage") / "base"
    expected: dict[str, dict[str, str]] = {}
    with Store.open(root, grace_period=0.0) as store:
        for i in range(KEYS):
            save(store, f"key{i}", sizes=(100, 70_000))
        for i in range(KEYS):
            res = store.lookup(f"key{i}", count=False)
            expected[f"key{i}"] = {
                n: hashlib.sha256(store.read_artifact(res.manifest, n)).hexdigest() for n in res.manifest.artifacts
            }
    return root, expected


def _data(root: Path) -> Path:
    return root / "index" / "data.mdb"


def truncate(size: int) -> Damage:
    def damage(root: Path) -> None:
        os.truncate(_data(root), size)

    return damage


def scribble(seed: int, *, whole_page: bool = False) -> Damage:
    """Random bytes at random places of pages 2.. (the B-tree; 1 in 8 also hits a meta page)."""

    def damage(root: Path) -> None:
        rng = random.Random(seed)
        with open(_data(root), "r+b") as f:
            pages = f.seek(0, 2) // PAGE
            for _ in range(rng.randint(1, 4)):
                page = rng.randrange(0, 2) if rng.random() < 0.125 else rng.randrange(2, pages)
                if whole_page:
                    f.seek(page * PAGE)
                    f.write(rng.randbytes(PAGE))
                else:
                    f.seek(page * PAGE + rng.randrange(0, PAGE - 64))
                    f.write(rng.randbytes(rng.randint(1, 64)))

    return damage


def node_claims_more(extra: int = 128) -> Damage:
    """A blob row's node claims ``extra`` bytes more than it holds, still inside its page: it overlaps its
    neighbour.  Every read passes over it (the value just runs into the next node), but a repair's write
    moves nodes by the claimed size, past the page, and near the end of the map that is a SIGBUS (what
    made scribble-186 kill ``verify --fix`` now and then)."""

    def damage(root: Path) -> None:
        data = bytearray(_data(root).read_bytes())
        for at in range(2 * PAGE, len(data), PAGE):
            flags, lower, _upper = struct.unpack_from("<HHH", data, at + 10)
            if flags != 0x02:  # a leaf page
                continue
            for i in range((lower - 16) // 2):
                node = at + struct.unpack_from("<H", data, at + 16 + 2 * i)[0]
                size, hi, nflags, ksize = struct.unpack_from("<HHHH", data, node)
                if (ksize, hi, nflags) == (32, 0, 0) and node + 8 + ksize + size + extra <= at + PAGE:
                    struct.pack_into("<H", data, node, size + extra)
                    _data(root).write_bytes(data)
                    return
        raise AssertionError("the base store has no blob row to damage")

    return damage


def free_list(how: str, nth: int = 0) -> Damage:
    """Damage LMDB's free-page list, which no read looks at but every write allocates from.

    ``one_in_use``: the first listed page becomes the ``nth`` page of the tables (a write
    overwrites it: an in-place repair left the index inconsistent, or aborted the process);
    ``in_use``: every listed page does (the first write of any process aborts); ``past_end``:
    a page past the last one; ``count``: a record longer than its data; ``not_a_page``: the
    tree's root page loses its leaf flag.
    """

    def damage(root: Path) -> None:
        meta = read_meta(_data(root))
        assert meta is not None and meta.roots[0] != (1 << 64) - 1, "the base store has no free pages"
        with open(_data(root), "r+b") as f:
            at = meta.roots[0] * PAGE
            f.seek(at)
            page = bytearray(f.read(PAGE))
            flags = struct.unpack_from("<H", page, 10)[0]
            assert flags & 0x02, "the free-page tree of the base store is one leaf"
            records = [
                _free_record(page, struct.unpack_from("<H", page, 16 + 2 * i)[0])
                for i in range((struct.unpack_from("<H", page, 12)[0] - 16) // 2)
            ]
            free = {p for start, n in records for p in struct.unpack_from(f"<{n}Q", page, start + 8)}
            used = sorted(set(range(2, meta.last_page + 1)) - free - {meta.roots[0]})
            ids, count = records[0]
            if how == "in_use":
                for start, n in records:
                    struct.pack_into(f"<{n}Q", page, start + 8, *(used[i % len(used)] for i in range(n)))
            elif how == "one_in_use":
                struct.pack_into("<Q", page, ids + 8, used[nth % len(used)])
            elif how == "past_end":
                struct.pack_into("<Q", page, ids + 8, meta.last_page + 7)
            elif how == "count":
                struct.pack_into("<Q", page, ids, count + 500)
            else:
                struct.pack_into("<H", page, 10, flags & ~0x02)
            f.seek(at)
            f.write(page)

    return damage


def _free_record(page: bytes, node: int) -> tuple[int, int]:
    """Where a free-page record's page list starts in its leaf, and how many pages it lists."""
    nflags, ksize = struct.unpack_from("<HH", page, node + 4)
    assert not nflags & 0x01, "the free-page records of the base store are inline"
    return node + 8 + ksize, struct.unpack_from("<Q", page, node + 8 + ksize)[0]


def renamed_key(new: bytes, nth: int | None = None) -> Damage:
    """``key5`` spelled ``new`` where the index holds it (every place, or the ``nth`` only): rows out of
    key order, or found by no search (an in-place repair left the index inconsistent)."""

    def damage(root: Path) -> None:
        data = _data(root).read_bytes()
        if nth is None:
            data = data.replace(b"key5", new)
        else:
            at = [m.start() for m in re.finditer(b"key5", data)][nth]
            data = data[:at] + new + data[at + len(new) :]
        _data(root).write_bytes(data)

    return damage


def replace_data(content: bytes) -> Damage:
    def damage(root: Path) -> None:
        _data(root).unlink()
        _data(root).write_bytes(content)

    return damage


def run_case(base: tuple[Path, dict], work: Path, name: str, damage: Damage, *, copy: bool = True) -> dict:
    """Copy the base store, damage it, run the child; returns its steps and how it ended."""
    src, expected = base
    root = work / name
    if copy:
        shutil.copytree(src, root, symlinks=True)
    damage(root)
    try:
        proc = subprocess.run(
            [sys.executable, str(CHILD), str(root), json.dumps(expected)],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
        code, out = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        code, out = "timeout", (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
    steps = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    done = {s["step"]: s for s in steps if s["phase"] == "done"}
    started = [s["step"] for s in steps if s["phase"] == "start"]
    shutil.rmtree(root, ignore_errors=True)
    return {"name": name, "code": code, "done": done, "died_in": started[-1] if code != 0 and started else None}


def _raw_lmdb(case: dict) -> int:
    text = json.dumps(case["done"])
    return text.count("raw_lmdb:")


def _exit70(case: dict) -> int:
    return sum(1 for s in case["done"].values() if s.get("exit") == 70 or "internal:" in json.dumps(s))


def check_repaired(case: dict, *, hits: int = KEYS) -> list[str]:
    """What is wrong with one index-damage case (empty: it passed); ``hits``: entries intact after the fix."""
    name, done = case["name"], case["done"]
    if case["code"] != 0:
        return [f"{name}: child ended with {case['code']} in step {case['died_in']}"]
    bad = []
    for step in ("read", "after"):
        s = done.get(step, {})
        if s.get("lookup_raised") or s.get("wrong_bytes") or "escaped" in s:
            bad.append(f"{name} {step}: {s}")
    if done["after"].get("open_error") or done["after"].get("read_errors"):
        bad.append(f"{name}: after verify --fix: {done['after']}")
    if done["fix"]["exit"] != 0 or done["verify_after"]["exit"] != 0:
        bad.append(f"{name}: verify --fix {done['fix']} then verify {done['verify_after']}")
    if done["after"].get("hits") != hits:
        bad.append(
            f"{name}: {done['after'].get('hits')} of {hits} intact entries hit after verify --fix: {done['after']}"
        )
    if _raw_lmdb(case) or _exit70(case):
        bad.append(f"{name}: raw lmdb or internal error: {done}")
    return bad


def run_suite(base, work: Path, cases: dict[str, Damage], check: Callable[[dict], list[str]]) -> tuple[list, list]:
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = list(pool.map(lambda item: run_case(base, work, *item), cases.items()))
    failures = [f for case in results for f in check(case)]
    return results, failures


def tally(results: list[dict]) -> dict:
    exits: Counter[str] = Counter()
    for case in results:
        for step in ("stats", "verify", "fix"):
            if step in case["done"]:
                exits[f"{step}:{case['done'][step]['exit']}"] += 1
    return {
        "cases": len(results),
        "signal_deaths": sum(1 for c in results if isinstance(c["code"], int) and c["code"] < 0),
        "exit_70": sum(_exit70(c) for c in results),
        "raw_lmdb_errors": sum(_raw_lmdb(c) for c in results),
        "wrong_bytes": sum(s.get("wrong_bytes", 0) for c in results for s in c["done"].values()),
        "hits_after_fix": sum(c["done"].get("after", {}).get("hits", 0) for c in results),
        "exit_codes": dict(sorted(exits.items())),
    }


def index_cases(base_root: Path, *, slow: bool) -> dict[str, Damage]:
    size = _data(base_root).stat().st_size
    pages = size // PAGE
    if slow:
        sizes = [k * PAGE for k in range(1, pages)] + [k * PAGE + off for k in range(0, pages, 3) for off in (1, 2049)]
        seeds = range(100, 260)
        pages_seeds = range(100, 120)
        junk = [os.urandom(n) for n in (1, 64, 4095, 4096, 12_288, 65_537)] + [b"\0" * 65_536, b"LMDB" * 2048]
    else:
        sizes = [1, 100, PAGE, PAGE + 1, 2 * PAGE, (pages // 2) * PAGE, size - PAGE, size - 1]
        seeds = [*range(24), 186]  # 186: a page only verify --fix's writes meet (the probe reads it as sound)
        pages_seeds = range(3)
        junk = [os.urandom(5000), b"not an index\n" * 400, b"\0" * 8192, random.Random(0).randbytes(PAGE)]
    cases: dict[str, Damage] = {f"truncate-{n}": truncate(n) for n in sizes}
    cases |= {f"scribble-{s}": scribble(s) for s in seeds}
    cases |= {f"page-{s}": scribble(s, whole_page=True) for s in pages_seeds}
    cases |= {f"not-lmdb-{i}-{len(b)}": replace_data(b) for i, b in enumerate(junk)}
    cases |= {f"free-list-{how}": free_list(how) for how in ("past_end", "count", "not_a_page")}
    cases["node-claims-more"] = node_claims_more()
    cases |= {f"free-list-names-used-page-{n}": free_list("one_in_use", n) for n in range(0, 12, 1 if slow else 3)}
    cases |= {f"renamed-key-{new.decode()}": renamed_key(new) for new in (b"kez5", b"key0", b"kay5")}
    if slow:
        places = _data(base_root).read_bytes().count(b"key5")
        cases |= {f"renamed-key-at-{n}": renamed_key(b"kez5", n) for n in range(places)}
    return cases


def _symlinked(sub: str) -> Damage:
    def damage(root: Path) -> None:
        outside = root.parent / f"{root.name}-outside-{sub}"
        shutil.move(root / sub, outside)
        os.symlink(outside, root / sub)

    return damage


def _symlinked_blob(root: Path) -> None:
    """A file blob replaced by a symlink to an outside file holding the right bytes."""
    blob = next(p for p in sorted((root / "blobs").glob("*/*")))
    outside = root.parent / f"{root.name}-outside-blob"
    shutil.copyfile(blob, outside)
    blob.unlink()
    os.symlink(outside, blob)


def check_unsafe(case: dict) -> list[str]:
    name, done = case["name"], case["done"]
    if case["code"] != 0:
        return [f"{name}: child ended with {case['code']} in step {case['died_in']}"]
    bad = []
    if done["read"].get("open_error") != "store:unsafe_root":
        bad.append(f"{name}: open gave {done['read']}")
    for step in ("stats", "verify", "fix"):
        if done[step]["exit"] != 7 or "is a symlink" not in done[step]["stderr"]:
            bad.append(f"{name}: {step} {done[step]}")
    return bad


def check_blob_symlink(case: dict) -> list[str]:
    bad = check_repaired(case, hits=KEYS - 1)  # the entry of the symlinked blob has no intact file
    read = case["done"].get("read", {})
    if read.get("hits", 0) >= KEYS:
        bad.append(f"{case['name']}: the symlinked blob was served: {read}")
    if case["done"].get("verify", {}).get("exit") != 1:
        bad.append(f"{case['name']}: verify did not report the symlinked blob: {case['done'].get('verify')}")
    return bad


def _record(name: str, results: list[dict], failures: list[str]) -> dict:
    figures = tally(results)
    figures["failures"] = len(failures)
    figures["command"] = "python -m pytest tests/store/test_damage.py" + (" -m slow" if name.endswith("slow") else "")
    report_figures(name, figures)
    print(f"\n{name}: {json.dumps(figures)}")
    return figures


def _suite(base, work: Path, *, slow: bool) -> tuple[list, list]:
    results, failures = run_suite(base, work, index_cases(base[0], slow=slow), check_repaired)
    hostile = {f"symlinked-{d}": _symlinked(d) for d in ("blobs", "index", "records", "tmp", "quarantine")}
    more, more_failures = run_suite(base, work, hostile, check_unsafe)
    blob, blob_failures = run_suite(base, work, {"symlinked-blob-file": _symlinked_blob}, check_blob_symlink)
    return results + more + blob, failures + more_failures + blob_failures


def _run_and_check(base, work: Path, *, slow: bool, min_cases: int) -> None:
    results, failures = _suite(base, work, slow=slow)
    figures = _record("damage_slow" if slow else "damage", results, failures)
    assert not failures, "\n".join(failures[:20])
    assert figures["signal_deaths"] == figures["exit_70"] == figures["raw_lmdb_errors"] == 0
    assert figures["cases"] >= min_cases


def _fill_to_zero(mnt: Path) -> None:
    """Take every free byte of the tmpfs (unbuffered, down to single bytes)."""
    with open(mnt / "filler", "wb", buffering=0) as f:
        for chunk in (bytes(1 << 16), b"\0"):
            with contextlib.suppress(OSError):
                while f.write(chunk):
                    pass
    assert shutil.disk_usage(mnt).free == 0


@pytest.mark.parametrize(
    "how", ["ballast kept", "ballast already spent", "index truncated too", "index truncated, ballast kept"]
)
def test_a_store_at_0_bytes_free(small_fs, how):  # noqa: F811
    """Reads, verify, verify --fix and gc on a full tmpfs: no death, no exit 70; gc frees space with a ballast."""
    src = small_fs / "src"
    expected: dict[str, dict[str, str]] = {}
    with Store.open(src, grace_period=0.0) as store:
        for i in range(KEYS):
            save(store, f"key{i}", sizes=(100, 200_000))
            res = store.lookup(f"key{i}", count=False)
            expected[f"key{i}"] = {
                n: hashlib.sha256(store.read_artifact(res.manifest, n)).hexdigest() for n in res.manifest.artifacts
            }

    def damage(root: Path) -> None:
        if "ballast kept" not in how:
            (root / "ballast").unlink()
        if how.startswith("index truncated"):
            os.truncate(_data(root), 2 * PAGE)
        _fill_to_zero(small_fs)

    case = run_case((src, expected), small_fs, "src", damage, copy=False)
    results = [case]
    figures = _record("damage_full_disk_" + "_".join(how.replace(",", "").split()), results, [])
    assert case["code"] == 0 and figures["exit_70"] == figures["raw_lmdb_errors"] == figures["wrong_bytes"] == 0, case
    done = case["done"]
    if how == "ballast kept":
        assert done["read"]["hits"] == KEYS and done["verify"]["exit"] == 0, done
        assert done["gc"]["exit"] == 0, done["gc"]
        assert shutil.disk_usage(small_fs).free > 1 << 20
    elif how == "index truncated, ballast kept":  # the rebuild spends the ballast on the fresh index
        assert done["fix"]["exit"] == 0 and not done["after"].get("open_error"), done
        assert done["after"]["hits"] == KEYS, done  # every entry back from its records
    else:
        assert done["gc"]["exit"] in (0, 8, 9), done["gc"]  # a named error at worst, never stuck in a crash


def _found_by_verify_and_rebuilt(base, work: Path, damage: Damage, finding: str) -> None:
    """``verify`` reports ``damage`` without writing; ``verify --fix`` rebuilds: every entry hits again."""
    src, expected = base
    root = work / "store"
    shutil.copytree(src, root, symlinks=True)
    damage(root)
    verify = run_cli(root, "verify")
    assert verify.returncode == 1 and finding in verify.stdout, verify
    fix = run_cli(root, "verify", "--fix")
    assert fix.returncode == 0 and f"restored {KEYS} entr(ies)" in fix.stdout, fix
    assert run_cli(root, "verify").returncode == 0
    with Store.open(root, create=False) as store:
        for key, artifacts in expected.items():
            res = store.lookup(key, count=False)
            assert res.hit, (key, res.reason)
            assert {
                n: hashlib.sha256(store.read_artifact(res.manifest, n)).hexdigest() for n in res.manifest.artifacts
            } == artifacts


def test_a_free_page_list_of_pages_in_use_is_found_by_verify_and_rebuilt(base, tmp_path):
    """A process's first write aborts in LMDB on such an index (docs/operations.md, "Known limits")."""
    _found_by_verify_and_rebuilt(base, tmp_path, free_list("in_use"), "free-page list names page")


def test_a_node_that_claims_more_than_it_holds_is_found_before_a_repair_writes(base, tmp_path):
    """Reads pass over such a node, so only the page check (``index.pages``) finds it, and ``verify --fix``
    rebuilds instead of moving nodes by the false size in place."""
    _found_by_verify_and_rebuilt(base, tmp_path, node_claims_more(), "a node claims a size it does not have")


def test_damage_suite(base, tmp_path):
    _run_and_check(base, tmp_path, slow=False, min_cases=30)


@pytest.mark.slow
def test_damage_suite_slow(base, tmp_path):
    _run_and_check(base, tmp_path, slow=True, min_cases=200)
