"""Poisoned pipeline *entries* in a real store, read through the real cache paths.

``test_snapshot_safety.py`` proves the snapshot codec rejects hostile
payloads handed to ``load_module``.  Here the hostile bytes arrive the way an
attacker with write access to a shared store would deliver them: published
and committed under the exact key a victim's pipeline computes, or written
straight into LMDB rows.  The victim then runs the real
``InferenceOptimizer``.  For every poison:

* nothing it names runs — a sentinel file that each payload would create
  must not exist afterwards;
* the cache reports a miss with a reason (never a crash, never a hit);
* the pipeline's result is still correct (the full pipeline ran and its
  output matches eager), and its save replaces the poisoned entry.

Also: a commit that fails leaves no uncommitted manifest, and an eviction
between the lookup and the read does not break a restore.
"""

from __future__ import annotations

import io
import json
import pickle
import subprocess

import pytest
import torch
from poison_support import Reduce, publish, run_cli, sentinel_fixture  # noqa: F401  (the sentinel fixture)

from adstore.integration.pipeline.optimizer import InferenceOptimizer
from adstore.integration.reference.checkpoint import read_checkpoint, write_random_checkpoint
from adstore.integration.reference.models import ModelFactory
from adstore.integration.reference.pipeline import default_transforms
from adstore.integration.snapshot import FORMAT, VERSION
from adstore.store import Store
from adstore.store.index.rows import manifest_key

MODEL = {"arch": "llama", "layers": 1, "hidden": 32}
REJECT = {"untrusted_target", "corrupt_snapshot", "unsupported_hook"}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A store holding one good pipeline entry; returns what a victim needs to re-run it."""
    tmp = tmp_path_factory.mktemp("poison")
    factory = ModelFactory.from_config(MODEL)
    ckpt = write_random_checkpoint(factory.build(), tmp / "ckpt", seed=3)
    root = tmp / "store"
    transforms = default_transforms(pipeline_cache={"root": str(root)})
    opt = InferenceOptimizer(factory, ckpt, transforms)
    module = opt()
    assert [e.kind for e in opt.events] == ["miss", "save"]
    key = opt.events[-1].key
    with Store.open(root) as store:
        res = store.lookup(key, count=False)
        good = {name: store.read_artifact(res.manifest, name) for name in res.manifest.artifacts}
    with torch.no_grad():
        ref = factory.eager_model(read_checkpoint(ckpt))(*factory.example_inputs()).logits
        out = module(*factory.example_inputs())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    return {
        "factory": factory,
        "ckpt": ckpt,
        "root": root,
        "transforms": transforms,
        "key": key,
        "good": good,
        "ref": ref,
    }


def _victim_run(p):
    opt = InferenceOptimizer(p["factory"], p["ckpt"], p["transforms"])
    module = opt()
    with torch.no_grad():
        out = module(*p["factory"].example_inputs())
    torch.testing.assert_close(out, p["ref"], rtol=1e-5, atol=1e-5)
    return [(e.kind, e.reason) for e in opt.events], opt


def _module_pt_variants(good: bytes, sentinel) -> dict[str, bytes]:
    cmd = f"touch {sentinel}"
    raw_os_system = b"cos\nsystem\n(V" + cmd.encode() + b"\ntR."
    raw_exec = b"cbuiltins\nexec\n(Vopen(" + repr(str(sentinel)).encode() + b", 'w').close()\ntR."
    popen = pickle.dumps(Reduce(subprocess.Popen, (["touch", str(sentinel)],)), protocol=2)
    buf = io.BytesIO()
    torch.save(
        {
            "format": FORMAT,
            "version": VERSION,
            "structure": "{}",
            "tensors": [],
            "evil": Reduce(__import__("os").system, (cmd,)),
        },
        buf,
    )
    zipped_object = buf.getvalue()
    payload = torch.load(io.BytesIO(good), weights_only=True)
    structure = json.loads(payload["structure"])
    graph = _find_graph(structure)
    graph["targets"][0] = "os.system"
    graph["nodes"].insert(1, ["pwn", "call_function", 0, ["t", cmd], ["d"], None, {}])
    buf = io.BytesIO()
    torch.save({**payload, "structure": json.dumps(structure)}, buf)
    target_os_system = buf.getvalue()
    graph["targets"][0] = "torch.utils.collect_env.run"  # public torch, runs a shell command
    buf = io.BytesIO()
    torch.save({**payload, "structure": json.dumps(structure)}, buf)
    target_torch_shell = buf.getvalue()
    return {
        "graph_target_torch_shell": target_torch_shell,
        "raw_pickle_os_system": raw_os_system,
        "raw_pickle_builtins_exec": raw_exec,
        "pickle_subprocess_popen": popen,
        "torch_save_with_pickled_object": zipped_object,
        "graph_target_os_system": target_os_system,
        "empty": b"",
        "garbage": b"\x00" * 1000,
    }


def _find_graph(node):
    """The first encoded graph (a dict with a ``targets`` list and ``nodes``) in a snapshot structure."""
    if isinstance(node, dict):
        if isinstance(node.get("targets"), list) and isinstance(node.get("nodes"), list) and node["targets"]:
            return node
        for v in node.values():
            found = _find_graph(v)
            if found is not None:
                return found
    elif isinstance(node, list):
        for v in node:
            found = _find_graph(v)
            if found is not None:
                return found
    return None


MODULE_POISONS = [
    "raw_pickle_os_system",
    "raw_pickle_builtins_exec",
    "pickle_subprocess_popen",
    "torch_save_with_pickled_object",
    "graph_target_os_system",
    "graph_target_torch_shell",
    "empty",
    "garbage",
]


_DEFAULT_MODULE = {
    "raw_pickle_os_system",
    "torch_save_with_pickled_object",
    "graph_target_os_system",
    "graph_target_torch_shell",
}


@pytest.mark.parametrize(
    "poison", [p if p in _DEFAULT_MODULE else pytest.param(p, marks=pytest.mark.slow) for p in MODULE_POISONS]
)
def test_poisoned_snapshot_entry_is_a_miss_and_is_replaced(pipeline, sentinel, poison):
    evil = _module_pt_variants(pipeline["good"]["module.pt"], sentinel)[poison]
    publish(pipeline["root"], pipeline["key"], {**pipeline["good"], "module.pt": evil})
    events, _ = _victim_run(pipeline)
    assert events[0][0] == "miss" and events[0][1] in REJECT, events
    assert events[1] == ("save", None), events  # the victim's save replaced the poisoned entry
    assert not sentinel.exists()
    events, _ = _victim_run(pipeline)
    assert events == [("hit", None)]


HOOK_POISONS = {
    "function_os_system": {"kind": "function", "qualname": "os.system"},
    "partial_builtins_exec": {
        "kind": "partial",
        "target": {"kind": "function", "qualname": "builtins.exec"},
        "keywords": {},
    },
    "instance_subprocess_popen": {
        "kind": "instance",
        "owner_class": "subprocess.Popen",
        "owner_state": {"args": "touch x"},
    },
}


@pytest.mark.parametrize(
    "poison",
    [p if p == "function_os_system" else pytest.param(p, marks=pytest.mark.slow) for p in sorted(HOOK_POISONS)],
)
def test_poisoned_hook_specs_in_an_entry_are_a_miss(pipeline, sentinel, poison):
    params = json.loads(json.dumps(HOOK_POISONS[poison]).replace("touch x", f"touch {sentinel}"))
    hooks = json.dumps(
        [{"type": "importable", "scope": "", "phase": "pre", "with_module": False, "params": params}]
    ).encode()
    publish(pipeline["root"], pipeline["key"], {**pipeline["good"], "hooks.json": hooks})
    events, _ = _victim_run(pipeline)
    assert events[0][0] == "miss" and events[0][1] in REJECT, events
    assert _victim_run(pipeline)[0] == [("hit", None)]


@pytest.mark.slow
def test_entry_missing_an_artifact_or_with_extra_ones_is_a_miss(pipeline, sentinel):
    publish(pipeline["root"], pipeline["key"], {"hooks.json": pipeline["good"]["hooks.json"]})
    events, _ = _victim_run(pipeline)
    assert events[0][0] == "miss" and events[0][1] in REJECT, events
    assert _victim_run(pipeline)[0] == [("hit", None)]


def _rewrite_manifest(root, key: str, fn) -> None:
    """Edit the committed manifest row(s) of ``key`` in LMDB directly (no API checks)."""
    with Store.open(root) as store:
        res = store.lookup(key, count=False)
        assert res.hit
        env, db = store.index.env, store.index.db["manifests"]
        for rank, m in res.manifests.items():
            mk = manifest_key(key, rank, m.generation)
            with env.begin(write=True) as txn:
                obj = json.loads(bytes(txn.get(mk, db=db)))
                fn(obj)
                txn.put(mk, json.dumps(obj).encode(), db=db)


TRAVERSALS = ["../../../../../../etc/passwd", "/etc/shadow", "..", "A" * 64, "0" * 63 + "/", "00" * 32 + "/../x"]


@pytest.mark.parametrize(
    "digest", [d if i < 2 else pytest.param(d, marks=pytest.mark.slow) for i, d in enumerate(TRAVERSALS)]
)
def test_path_traversal_digests_in_lmdb_rows_are_misses(pipeline, sentinel, digest, tmp_path):
    # The artifact's digest in the manifest row is rewritten to a path.
    def poison(obj):
        obj["a"]["module.pt"][0] = digest

    _rewrite_manifest(pipeline["root"], pipeline["key"], poison)
    with Store.open(pipeline["root"]) as store:
        res = store.lookup(pipeline["key"], count=False)
        assert not res.hit and res.reason == "corrupt_index", res
    events, opt = _victim_run(pipeline)
    assert events[0] == ("miss", "corrupt_index"), events
    assert not sentinel.exists()
    # The run that missed saved over the damaged row; verify --fix recounts
    # the references the damaged row held, and the next run hits.
    assert events[-1] == ("save", None), events
    with Store.open(pipeline["root"], grace_period=0.0) as store:
        assert store.verify(fix=True).ok
        store.plan_sweep().execute()
        assert store.verify().ok
    assert _victim_run(pipeline)[0] == [("hit", None)]


def test_a_damaged_entry_is_replaced_by_the_next_save(pipeline, sentinel):
    def poison(obj):
        obj["a"]["module.pt"][0] = "../../../../etc/passwd"

    _rewrite_manifest(pipeline["root"], pipeline["key"], poison)
    events, opt = _victim_run(pipeline)
    try:
        assert events[0] == ("miss", "corrupt_index"), events
        assert events[1] == ("save", None), [(e.kind, e.reason, e.detail) for e in opt.events]
        assert _victim_run(pipeline)[0] == [("hit", None)]
    finally:  # leave a healthy store for the other tests of this module
        with Store.open(pipeline["root"], grace_period=0.0) as store:
            store.verify(fix=True)
            store.plan_sweep().execute()


def test_traversal_digest_in_a_blob_row_key_is_never_a_path(pipeline, tmp_path):
    """A ``blobs`` row whose key is not 32 bytes (the digest cannot be a path) — verify drops it."""
    with Store.open(pipeline["root"]) as store:
        env = store.index.env
        with env.begin(write=True) as txn:
            txn.put(b"../../../../etc/passwd", b"\0" * 29, db=store.index.db["blobs"])
        try:
            rep = store.verify()
            assert not rep.ok
            assert store.verify(fix=True).ok and store.verify().ok
        finally:
            with env.begin(write=True) as txn:
                txn.delete(b"../../../../etc/passwd", db=store.index.db["blobs"])


def test_a_failed_commit_leaves_no_uncommitted_manifest(pipeline, monkeypatch):
    """The disk fills between publish and commit (ENOSPC injected at the commit of the one publish path)."""
    from adstore.store import StoreFull
    from adstore.store.publishing import Publisher

    with Store.open(pipeline["root"]) as store:
        store.plan_remove([pipeline["key"]]).execute()

    def full(self, key, **kw):
        raise StoreFull(pipeline["root"], "injected: no space left at commit")

    monkeypatch.setattr(Publisher, "commit", full)
    events, _ = _victim_run(pipeline)
    monkeypatch.undo()
    assert events[-1] == ("bypass", "disk_full"), events
    with Store.open(pipeline["root"]) as store:
        left = store.manifests(pipeline["key"])
        store.plan_sweep()  # (gc would take it only after the grace period)
    try:
        assert left == [], [(m.rank, m.committed) for m in left]
    finally:
        events, _ = _victim_run(pipeline)  # heal: the next run saves for the other tests


# ----------------------------------------------------------------------------- restores under eviction


def test_an_eviction_between_lookup_and_read_does_not_break_a_restore(pipeline, monkeypatch):
    """The daemon (here `adstore rm`, another process) evicts the entry right after the pipeline's
    lookup said hit.  A restore that holds a lease is skipped by eviction; one that does not, loses."""
    from adstore.store.index.rows import BlobRow

    with Store.open(pipeline["root"]) as store:  # the entry was saved an hour ago (past any grace period)
        with store.index.env.begin(write=True) as txn:
            db = store.index.db["blobs"]
            for k, v in list(txn.cursor(db=db)):
                row = BlobRow.decode(bytes(v), bytes(k))
                row.touched -= 3600
                txn.put(bytes(k), row.encode(), db=db)
    real_lookup = Store.lookup
    fired = []

    def lookup_then_evict(self, key, **kw):
        res = real_lookup(self, key, **kw)
        if res.hit and not fired:
            fired.append(run_cli(pipeline["root"], "rm", key))
        return res

    monkeypatch.setattr(Store, "lookup", lookup_then_evict)
    events, _ = _victim_run(pipeline)
    monkeypatch.undo()
    assert fired, "the pipeline never looked the entry up"
    try:
        assert events == [("hit", None)], (events, fired[0].returncode, fired[0].stdout[-200:])
    finally:
        if events != [("hit", None)]:
            _victim_run(pipeline)  # the entry was evicted: save it again for the other tests
