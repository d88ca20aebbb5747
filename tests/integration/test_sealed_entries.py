"""Entries that become code are sealed to their key, and users who do not trust each other never overwrite each other.

Real users (uids 1001 and 1002 in one group, umask 002) share a store
through a setgid group directory, as docs/configuration.md sets one up.  The
group member ``bob`` can write the LMDB index: he points ``alice``'s key at
another blob she wrote, or rewrites the meta her reader acts on (a vLLM
tree's paths and modes, the compile stage's ISA answers), through the
store's own API or by rewriting the rows.  Each is a miss ``unsealed_entry``
for a reader that trusts alice only (docs/architecture.md, "Records").
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from uid_support import ALICE, BOB, as_uid, shared_root

from adstore.integration.engine.index import StageEntries
from adstore.integration.errors import EngineUnavailable
from adstore.integration.validity.keys import CacheKey
from adstore.integration.vllm import trees
from adstore.store import Store
from adstore.store.remote import Signer, TrustedKeys, generate_keypair, open_remote

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as other users")

A, B = b"A" * 100_000, b"B" * 100_000  # file blobs (above the inline threshold)
ONLY_ALICE = frozenset({ALICE})
TREE = {"kind": "aot", "vllm_hash": "cd" * 32, "rank": "rank_0_0"}


@pytest.fixture
def root():
    with shared_root() as r:
        yield r


def _save(root: str, key: str, data: bytes, meta: dict | None = None) -> dict:
    with Store.open(root) as store:
        m = store.save(key, {"x": store.put_bytes(data)}, namespace="code", meta=meta or {})
        return {"generation": m.generation}


def _get(root: str, key: str, trusted: frozenset[int] | None) -> dict:
    with Store.open(root) as store:
        res = store.lookup(key, trusted=trusted)
        got = store.read_artifact(res.manifest, "x")[:1].decode() if res.hit else None
        store.flush()
        return {"hit": res.hit, "reason": res.reason, "got": got, "counters": store.stats().counters}


def _repoint_through_the_api(root: str, victim: str, other: str) -> dict:
    """What any member can do: a normal save under the victim's key, of a blob the victim wrote."""
    with Store.open(root) as store:
        ref = store.lookup(other).manifest.artifacts["x"]
        store.save(victim, {"x": ref}, namespace="code")
        return {}


def _rewrite_rows(root: str, key: str, change: dict) -> dict:
    """The index rows rewritten in place: the victim's manifest (same generation), as raw LMDB writes."""
    with Store.open(root) as store:
        m = store.lookup(key).manifest
        if "artifacts_of" in change:
            change = {"artifacts": dict(store.lookup(change.pop("artifacts_of")).manifest.artifacts), **change}
        store._tables.write(lambda t: t.put_manifest(dataclasses.replace(m, **change)))
        return {}


def test_a_group_member_who_repoints_a_key_at_another_blob_of_the_victim_is_refused(root):
    as_uid(ALICE, _save, str(root), "graphA", A)
    as_uid(ALICE, _save, str(root), "graphB", B)
    as_uid(BOB, _repoint_through_the_api, str(root), "graphA", "graphB")
    assert as_uid(ALICE, _get, str(root), "graphA", None)["got"] == "B"  # the attack, as the index has it
    sealed = as_uid(ALICE, _get, str(root), "graphA", ONLY_ALICE)
    assert not sealed["hit"] and sealed["reason"] == "unsealed_entry", sealed
    assert sealed["counters"].get("misses.unsealed_entry") == 1 and sealed["counters"].get("unsealed_entry") == 1
    assert any("unsealed_entry" in w and f"uid {BOB}" in w for w in sealed["warnings"]), sealed["warnings"]


@pytest.mark.parametrize(
    "change",
    [{"artifacts_of": "graphB"}, {"meta": {"isa": {"avx512": True}}}, {"namespace": "other"}],
    ids=["artifacts", "meta", "namespace"],
)
def test_index_rows_rewritten_in_place_disagree_with_the_victims_record(root, change):
    as_uid(ALICE, _save, str(root), "graphA", A, {"isa": {"avx512": False}})
    as_uid(ALICE, _save, str(root), "graphB", B)
    assert as_uid(ALICE, _get, str(root), "graphA", ONLY_ALICE)["hit"]
    as_uid(BOB, _rewrite_rows, str(root), "graphA", change)
    sealed = as_uid(ALICE, _get, str(root), "graphA", ONLY_ALICE)
    assert not sealed["hit"] and sealed["reason"] == "unsealed_entry", sealed
    assert as_uid(ALICE, _get, str(root), "graphB", ONLY_ALICE)["hit"]  # untouched entries still hit


def test_the_lookup_memo_does_not_skip_the_seal(store):
    """A record replaced behind the index's back (rows unchanged, so the memo would serve the hit) is judged again."""
    store.save("k", {"x": store.put_bytes(A)}, namespace="code")
    me = frozenset({os.geteuid()})
    assert store.lookup("k", trusted=me).hit and store.lookup("k", trusted=me).hit  # the second from the memo
    record = next((store.root / "records").glob("*/k.0.*"))
    os.chown(record, 65534, 65534)  # as if another user had renamed their own file over it
    assert store.lookup("k").hit  # the rows are as they were
    assert store.lookup("k", trusted=me).reason == "unsealed_entry"
    assert store.lookup("k", trusted=me | {65534}).hit


def test_a_record_that_verify_fix_wrote_from_the_index_seals_nothing(store):
    """A member deletes the record (its shard directory is group-writable) and rewrites the rows; whoever
    runs ``verify --fix`` then writes a record from those rows, owned by them: it must not vouch for them."""
    store.save("k", {"x": store.put_bytes(A)}, namespace="code")
    me = frozenset({os.geteuid()})
    record = next((store.root / "records").glob("*/k.0.*"))
    record.unlink()
    assert store.lookup("k", trusted=me).reason == "unsealed_entry"  # no record, nothing vouches
    assert store.verify(fix=True).ok and record.exists()  # the rebuildable store is repaired ...
    assert store.lookup("k").hit
    assert store.lookup("k", trusted=me).reason == "unsealed_entry"  # ... and code still misses
    store.save("k", {"x": store.put_bytes(A)}, namespace="code")  # until it is saved again
    assert store.lookup("k", trusted=me).hit


# -- integrations ----------------------------------------------------------------


def _home(base: Path) -> Path:
    """A directory of alice's own, where her restores put trees."""
    home = base / "alice"
    home.mkdir(mode=0o755)
    os.chown(home, ALICE, -1)
    return home


def _make_tree(root: Path) -> Path:
    (root / "rank_0_0").mkdir(parents=True, mode=0o755)
    (root / "rank_0_0" / "model").write_bytes(b"\x80\x05model " + os.urandom(70_000))
    (root / "rank_0_0" / "k.so").write_bytes(os.urandom(90_000))
    os.chmod(root / "rank_0_0" / "k.so", 0o755)
    return root


def _capture(root: str, source: str) -> dict:
    with Store.open(root) as store:
        return {"captured": trees.capture(store, source=Path(source), anchors={}, **TREE).captured}


def _restore(root: str, target: str, trusted: frozenset[int] | None = None) -> dict:
    with Store.open(root) as store:
        out = trees.restore(store, target=Path(target), anchors={}, trusted=trusted, **TREE)
        return {"reason": out.reason, "files": sorted(str(p.relative_to(target)) for p in Path(target).rglob("*"))}


def _tamper_tree(root: str) -> dict:
    """Swap the tree's paths: the model's bytes land where the shared object was, and the other way round."""
    key, _ = trees.tree_key(**TREE)
    with Store.open(root) as store:
        m = store.lookup(key).manifest
        files = dict(m.meta["files"])
        files["rank_0_0/k.so"], files["rank_0_0/model"] = 0o755, 0o755
        arts = dict(m.artifacts)
        a, b = sorted(n for n in arts if n != "value")[:2]
        arts[a], arts[b] = arts[b], arts[a]
        store._tables.write(
            lambda t: t.put_manifest(dataclasses.replace(m, meta={**m.meta, "files": files}, artifacts=arts))
        )
        return {}


def test_a_vllm_tree_whose_paths_or_modes_were_rewritten_is_not_restored(root, tmp_path):
    trees.identity()  # torch's key, computed before the fork
    src = _make_tree(root.parent / "src")
    assert as_uid(ALICE, _capture, str(root), str(src))["captured"]
    home = _home(root.parent)
    assert as_uid(ALICE, _restore, str(root), f"{home}/before")["reason"] == "restored"  # as alice stored it
    target = f"{home}/out"
    as_uid(BOB, _tamper_tree, str(root))
    refused = as_uid(ALICE, _restore, str(root), target)
    assert refused["reason"] == "unsealed_entry", refused
    assert not os.path.exists(target)


def _save_stage(root: str, isa: bool) -> dict:
    with Store.open(root) as store:
        StageEntries(store, "inductor", "standalone.bin").save(_STAGE_KEY, b"artifact", {"isa_probes": {"avx512": isa}})
        return {}


def _stage_manifest(root: str) -> dict:
    with Store.open(root) as store:
        try:
            m = StageEntries(store, "inductor", "standalone.bin").manifest(_STAGE_KEY)
        except EngineUnavailable as exc:
            return {"refused": exc.store_reason}
        return {"isa": m.meta["isa_probes"]}


def _tamper_isa(root: str) -> dict:
    with Store.open(root) as store:
        m = store.lookup(_STAGE_KEY.key).manifest
        meta = {**m.meta, "isa_probes": {"avx512": True}}
        store._tables.write(lambda t: t.put_manifest(dataclasses.replace(m, meta=meta)))
        return {}


_STAGE_KEY = CacheKey("e" * 64, {"stage": "compile"})


def test_the_compile_stages_recorded_isa_answers_rewritten_are_refused(root):
    as_uid(ALICE, _save_stage, str(root), False)
    assert as_uid(ALICE, _stage_manifest, str(root))["isa"] == {"avx512": False}
    as_uid(BOB, _tamper_isa, str(root))
    assert as_uid(ALICE, _stage_manifest, str(root))["refused"] == "inductor entry: unsealed_entry"


def test_a_tree_pulled_from_a_signed_remote_passes_the_seal_of_the_user_who_pulled_it(tmp_path):
    """The record a pull writes is the puller's own: a host whose user trusts no one else still hits."""
    trees.identity()
    pair = generate_keypair()
    url = "memory://seal-pull"

    def remote():
        return open_remote(
            url,
            mode="read-write",
            signer=Signer.from_pem(pair.private_pem),
            trusted=TrustedKeys.from_pem(pair.public_pem),
        )

    with Store.open(tmp_path / "builder", remote=remote()) as builder:  # root builds and pushes
        assert trees.capture(builder, source=_make_tree(tmp_path / "src"), anchors={}, **TREE).captured
    with shared_root() as mine:

        def pull() -> dict:
            with Store.open(mine, remote=remote()) as store:
                out = trees.restore(store, target=home / "out", anchors={}, trusted=ONLY_ALICE, **TREE)
                return {"reason": out.reason, "detail": out.detail}

        home = _home(mine.parent)
        got = as_uid(ALICE, pull)
        assert got["reason"] == "restored", got


# -- users who do not trust each other --------------------------------------------------


def _save_code(root: str, key: str, data: bytes) -> dict:
    """A save of an entry that becomes code (the compile stage's, through its one save path)."""
    with Store.open(root) as store:
        StageEntries(store, "inductor", "standalone.bin").save(
            CacheKey(key, {}), b"x", {}, files={"k.so": store.put_bytes(data)}
        )
        store.flush()
        mine = store.lookup(key, trusted=frozenset({os.geteuid()}))
        return {"hit": mine.hit, "reason": mine.reason, "counters": store.stats().counters}


def _writer(root: str, key: str) -> dict:
    with Store.open(root) as store:
        return {"generation": store.lookup(key).generation}


def test_users_who_do_not_trust_each_other_never_overwrite_each_other(root):
    a = as_uid(ALICE, _save_code, str(root), "e" * 64, A)
    assert a["hit"], a
    before = as_uid(ALICE, _writer, str(root), "e" * 64)["generation"]
    b = as_uid(BOB, _save_code, str(root), "e" * 64, A)  # the same kernel: deduplicated onto alice's file
    assert b["counters"].get("untrusted_dedup") == 1, b
    assert any("ADSTORE_TRUSTED_UIDS" in w and "untrusted_dedup" in w for w in b["warnings"]), b["warnings"]
    assert as_uid(ALICE, _writer, str(root), "e" * 64)["generation"] == before  # alice's entry stands
    again = as_uid(ALICE, _save_code, str(root), "f" * 64, A)  # and alice, saving again, still hits her own
    assert again["hit"], again
    # Bob trusting alice (ADSTORE_TRUSTED_UIDS) publishes and reads as before.
    trusting = as_uid(BOB, _save_code, str(root), "d" * 64, A, env={"ADSTORE_TRUSTED_UIDS": str(ALICE)})
    assert trusting["hit"] and trusting["counters"].get("untrusted_dedup") == 1, trusting  # bob's first, no other
