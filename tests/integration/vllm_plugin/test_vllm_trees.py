"""Tree entries on real stores, without vLLM: round trips, refusals, atomic restores, anchors, the trust rule.

A tree is captured from a directory like the ones vLLM writes and restored
elsewhere; every refusal is checked to leave nothing behind (no target, no
temp directory beside it, nothing outside it).
"""

from __future__ import annotations

import multiprocessing
import os
import time
import uuid
from pathlib import Path

import pytest
from vllm_tree_workers import TREE, make_tree, restore_or_capture, snapshot

from adstore.integration.vllm import trees
from adstore.integration.vllm.treefiles import artifact_name
from adstore.store import Store
from adstore.store.remote import Signer, TrustedKeys, generate_keypair, open_remote

ME = frozenset({os.geteuid(), 0})


def _expected(source: Path) -> dict[str, tuple[int, bytes | None]]:
    """What a restore of ``source`` holds: the same paths and bytes, no group/other write, no setuid/setgid/sticky."""
    return {
        path: ((mode & 0o755) | (0o700 if data is None else 0), data) for path, (mode, data) in snapshot(source).items()
    }


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".adstore-" in p.name]


def test_a_tree_round_trips_with_its_files_directories_and_modes(store, tmp_path):
    source = make_tree(tmp_path / "src")
    os.chmod(source / "rank_0_0" / "model", 0o6775)  # setuid, setgid and group write are not restored
    os.chmod(source / "triton_cache", 0o1777)
    captured = trees.capture(store, source=source, anchors={}, **TREE)
    assert captured.captured and captured.reason == "captured" and captured.files == 4, captured
    target = tmp_path / "out"
    restored = trees.restore(store, target=target, anchors={}, trusted=ME, **TREE)
    assert restored.hit and restored.reason == "restored" and restored.files == 4, restored
    assert snapshot(target) == _expected(source)
    assert snapshot(target)["rank_0_0/model"][0] == 0o755 and snapshot(target)["triton_cache"][0] == 0o755
    assert (target.stat().st_mode & 0o777) == 0o755 and not _leftovers(tmp_path)
    again = trees.restore(store, target=target, anchors={}, **TREE)
    assert not again.hit and again.reason == "target_exists"  # vLLM's own now: never replaced


def test_an_empty_target_directory_is_replaced_and_a_full_one_left_alone(store, tmp_path):
    source = make_tree(tmp_path / "src")
    assert trees.capture(store, source=source, anchors={}, **TREE).captured
    empty = tmp_path / "empty"
    empty.mkdir()  # as vLLM makes inductor_cache before it looks
    assert trees.restore(store, target=empty, anchors={}, **TREE).reason == "restored"
    assert snapshot(empty) == _expected(source)
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine").write_text("vLLM's")
    assert trees.restore(store, target=full, anchors={}, **TREE).reason == "target_exists"
    assert [p.name for p in full.iterdir()] == ["mine"] and not _leftovers(tmp_path)


def test_a_second_store_restores_the_tree_the_first_captured(tmp_path):
    pair = generate_keypair()
    url = f"memory://vllm-{uuid.uuid4().hex[:8]}"

    def remote():
        signer, keys = Signer.from_pem(pair.private_pem), TrustedKeys.from_pem(pair.public_pem)
        return open_remote(url, mode="read-write", signer=signer, trusted=keys)

    source = make_tree(tmp_path / "src")
    with Store.open(tmp_path / "a", remote=remote()) as a:
        assert trees.capture(a, source=source, anchors={}, **TREE).captured
    with Store.open(tmp_path / "b", remote=remote()) as b:
        restored = trees.restore(b, target=tmp_path / "out", anchors={}, **TREE)
        assert restored.reason == "restored", restored
    assert snapshot(tmp_path / "out") == _expected(source)


def test_a_host_that_misses_while_another_compiles_the_tree_waits_and_restores_it(tmp_path):
    """Single-flight: A misses first and leads; B misses next, waits for A's capture, then restores it."""
    import threading

    pair = generate_keypair()
    url = f"memory://vllm-{uuid.uuid4().hex[:8]}"

    def remote():
        signer, keys = Signer.from_pem(pair.private_pem), TrustedKeys.from_pem(pair.public_pem)
        return open_remote(url, mode="read-write", signer=signer, trusted=keys)

    source = make_tree(tmp_path / "src")
    with Store.open(tmp_path / "a", remote=remote()) as a, Store.open(tmp_path / "b", remote=remote()) as b:
        assert trees.restore(a, target=tmp_path / "a-out", anchors={}, **TREE).reason == "absent"  # A leads
        got = []
        waiter = threading.Thread(
            target=lambda: got.append(trees.restore(b, target=tmp_path / "b-out", anchors={}, **TREE))
        )
        waiter.start()
        deadline = time.monotonic() + 60
        while not b.tier.remote.counters.get("flight.follower") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert trees.capture(a, source=source, anchors={}, **TREE).captured  # A compiled: saved, pushed, released
        waiter.join(120)
        assert got and got[0].reason == "restored", got
        assert b.tier.remote.counters["flight.ready"] == 1 and a.tier.remote.counters["flight.leader"] == 1
    assert snapshot(tmp_path / "b-out") == _expected(source)


@pytest.mark.parametrize("shape", ["symlink", "fifo", "symlinked_root", "odd_name"])
def test_capture_refuses_a_tree_it_could_not_restore_exactly(store, tmp_path, shape):
    source = make_tree(tmp_path / "src")
    if shape == "symlink":
        (source / "inductor_cache" / "link").symlink_to("/etc/passwd")
    elif shape == "fifo":
        os.mkfifo(source / "rank_0_0" / "pipe")
    elif shape == "odd_name":
        (source / "rank_0_0" / "new\nline").write_text("x")
    else:
        (tmp_path / "alias").symlink_to(source)
        source = tmp_path / "alias"
    captured = trees.capture(store, source=source, anchors={}, **TREE)
    assert not captured.captured and captured.reason in ("unsupported_file", "unsafe_path"), captured
    key, _ = trees.tree_key(**TREE)
    assert store.lookup(key).reason == "absent"


def _craft(store: Store, files: dict[str, int], *, dirs: dict[str, int] | None = None, names=None) -> None:
    """Save a tree entry whose meta names ``files`` (as a hostile writer could), each a real blob."""
    key, components = trees.tree_key(**TREE)
    ref = store.put_bytes(os.urandom(100_000))
    artifacts = {n: ref for n in (names if names is not None else [artifact_name(p) for p in files])}
    meta = {"tree": 1, "files": files, "dirs": dirs or {}, "anchors": {}, "root_mode": 0o755}
    store.save(key, artifacts, namespace=trees.NAMESPACE, components=components, meta=meta)


@pytest.mark.parametrize(
    "path", ["/tmp/evil", "../evil", "a/../../evil", "a/b\x00c", "./evil", "a//evil", "", "a/", "..", "a/\n"]
)
def test_restore_refuses_paths_that_could_lead_outside_the_tree(store, tmp_path, path):
    _craft(store, {"good/file": 0o644, path: 0o644})
    before = sorted(p.name for p in tmp_path.iterdir())
    outcome = trees.restore(store, target=tmp_path / "out", anchors={}, **TREE)
    assert not outcome.hit and outcome.reason == "unsafe_path", outcome
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no target, no temp directory
    assert not Path("/tmp/evil").exists() and not (tmp_path.parent / "evil").exists()


def test_restore_refuses_a_manifest_whose_names_or_shapes_do_not_match_its_paths(store, tmp_path):
    _craft(store, {"a/file": 0o644}, names=["p." + "0" * 40])
    assert trees.restore(store, target=tmp_path / "out", anchors={}, **TREE).reason == "corrupt_tree"
    _craft(store, {"a": 0o644, "a/b": 0o644})  # a file where a directory must be
    assert trees.restore(store, target=tmp_path / "out", anchors={}, **TREE).reason == "unsafe_path"
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_restore_refuses_a_target_reached_through_a_symlink(store, tmp_path):
    assert trees.capture(store, source=make_tree(tmp_path / "src"), anchors={}, **TREE).captured
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    outcome = trees.restore(store, target=tmp_path / "link" / "out", anchors={}, **TREE)
    assert not outcome.hit and outcome.reason == "unsafe_root", outcome
    assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.parametrize("damage", ["checksum", "missing"])
def test_a_restore_that_fails_midway_leaves_no_target_and_no_temp_directory(store, tmp_path, damage):
    source = make_tree(tmp_path / "src")
    assert trees.capture(store, source=source, anchors={}, **TREE).captured
    blob = store.blob_path(store.put_file(source / "rank_0_0" / "model"))  # the last file restored
    os.chmod(blob, 0o600)
    if damage == "checksum":
        blob.write_bytes(b"evil" + blob.read_bytes()[4:])  # same size, other bytes: found only when read
        os.chmod(blob, 0o444)
    else:
        blob.unlink()
    outcome = trees.restore(store, target=tmp_path / "out", anchors={}, **TREE)
    assert not outcome.hit and outcome.reason in ("checksum", "blob_missing"), outcome
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)
    if damage == "checksum":
        assert list((store.root / "quarantine").iterdir())  # the store's read path quarantined it


def test_an_untrusted_writers_blob_is_never_placed(store, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    source = make_tree(tmp_path / "src")
    assert trees.capture(store, source=source, anchors={}, **TREE).captured
    os.chown(store.blob_path(store.put_file(source / "inductor_cache" / "k.so")), 65534, 65534)
    outcome = trees.restore(store, target=tmp_path / "out", anchors={}, trusted=ME, **TREE)
    assert not outcome.hit and outcome.reason == "untrusted_engine" and "65534" in outcome.detail, outcome
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)
    trusting = trees.restore(store, target=tmp_path / "out", anchors={}, trusted=ME | {65534}, **TREE)
    assert trusting.reason == "restored"  # ADSTORE_TRUSTED_UIDS admits that writer


def test_an_anchor_path_that_differs_on_this_host_is_a_miss_that_names_it(store, tmp_path):
    here, there = str(tmp_path / "cache-a"), str(tmp_path / "cache-b")
    source = make_tree(tmp_path / "src", anchor=here)
    captured = trees.capture(store, source=source, anchors={"cache_root": here, "vllm": "/opt/none/vllm"}, **TREE)
    assert captured.captured
    key, _ = trees.tree_key(**TREE)
    assert store.lookup(key).manifest.meta["anchors"] == {"cache_root": here}  # only what the files embed
    outcome = trees.restore(store, target=tmp_path / "out", anchors={"cache_root": there}, **TREE)
    assert not outcome.hit and outcome.reason == "incompatible_env"
    assert f"absolute path {here} (cache_root) differs on this host" in outcome.detail
    assert "not known" in trees.restore(store, target=tmp_path / "out", anchors={}, **TREE).detail
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)
    assert trees.restore(store, target=tmp_path / "out", anchors={"cache_root": here}, **TREE).reason == "restored"


def test_concurrent_restores_and_captures_make_exactly_one_identical_tree(store_root, tmp_path):
    source = make_tree(tmp_path / "src")
    with Store.open(store_root) as store:
        assert trees.capture(store, source=source, anchors={}, **TREE).captured
    target = tmp_path / "out"
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 20  # after every worker has imported torch and opened the store
    with ctx.Pool(4) as pool:
        args = [(str(store_root), str(source), str(target), i, start_at) for i in range(4)]
        said = pool.starmap(restore_or_capture, args)
    reasons = [r for s in said for r in s.split(",")]
    assert reasons.count("restored") == 1, said
    assert set(reasons) <= {"restored", "hit_by_other", "target_exists", "captured"}, said
    assert snapshot(target) == _expected(source) and not _leftovers(tmp_path)
