"""``adstore.integration.inductor``: plain ``torch.compile`` with its caches and kernels in the store.

Host A compiles a small MLP once (module fixture) in a fresh process with
its own store, Inductor cache directory and ``TMPDIR``; every other test
starts another host, also a fresh process with empty Inductor directories,
on a copy of A's store that the test changed first (a damaged or foreign
blob, an evicted entry, no store at all), and counts what that host compiled
(every ``CppBuilder.build``: kernels, ISA probes, the precompiled header).
A's kernels are blob files here (a small inline threshold), so a test can
damage or chown one; the remote tests (tests/store/remote/test_remote_inductor.py)
cover the default, where they are inline.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from inductor_hosts import compile_host, host_env, on_host

from adstore.store import Store

pytest.importorskip("torch")

FX = "inductor_fx_graph"
INLINE = 1024


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    """Host A's result and its store (never changed: tests change copies)."""
    base = tmp_path_factory.mktemp("inductor")
    a = on_host(compile_host, host_env(base, "a"), True, INLINE)
    assert a["enabled"] and a["failopen"] == {}, a
    assert a["inductor"].get("fxgraph_cache_miss") == 1 and a["builds"], a
    return base, a


def copy_store(seed, name: str) -> tuple[dict[str, str], Path]:
    base, _ = seed
    root = base / name / "store"
    shutil.copytree(base / "a" / "store", root)
    return host_env(base, name, root), root


def kernel_blobs(root: Path) -> dict[str, object]:
    """The FX-graph entry's shared-object artifacts (name -> BlobRef)."""
    with Store.open(root) as store:
        (entry,) = store.entries(namespace=FX)
        (manifest,) = store.manifests(entry.key)
        return {n: r for n, r in manifest.artifacts.items() if n.startswith("cache.") and n.endswith(".so")}


def entry_is_whole(root: Path) -> bool:
    """The FX-graph entry hits and every blob it references reads back verified."""
    with Store.open(root) as store:
        (entry,) = store.entries(namespace=FX)
        res = store.lookup(entry.key, count=False)
        return res.hit and all(len(store.read_artifact(res.manifest, n)) >= 0 for n in res.manifest.artifacts)


def test_a_new_host_builds_no_kernel_and_gets_the_same_outputs(seed):
    env, root = copy_store(seed, "b")
    b = on_host(compile_host, env, True, INLINE)
    assert b["builds"] == [], b["builds"]
    assert b["probes"] == 0 and seed[1]["probes"] > 0, (b["probes"], seed[1]["probes"])  # answered from the store
    assert b["inductor"].get("fxgraph_cache_hit") == 1 and b["aot_autograd"].get("autograd_cache_hit") == 1, b
    assert b["output"] == seed[1]["output"] and b["failopen"] == {}
    assert b["store"]["inductor.files_placed"] > 0
    a_kernels = {name.split(".", 2)[2] for name in kernel_blobs(root)}  # the ISA probes' libraries are not needed
    assert a_kernels and a_kernels <= {p.name for p in Path(env["TORCHINDUCTOR_CACHE_DIR"]).rglob("*.so")}
    assert list(Path(env["TMPDIR"]).rglob("*.h.gch")), "the precompiled header was placed"


def test_a_damaged_kernel_blob_is_rebuilt_and_replaced(seed):
    env, root = copy_store(seed, "damaged")
    name, ref = next(iter(kernel_blobs(root).items()))
    with Store.open(root) as store:
        path = store.blob_path(ref)
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    b = on_host(compile_host, env, True, INLINE)
    assert b["failopen"].get("checksum") == 1, b["failopen"]
    assert any(p.endswith(name.split(".", 2)[2]) for p in b["builds"]), b["builds"]  # built here, not placed
    assert b["output"] == seed[1]["output"]
    assert entry_is_whole(root), "the compile's save replaced the damaged entry"


def test_a_kernel_another_user_wrote_is_never_loaded(seed):
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    env, root = copy_store(seed, "foreign")
    name, ref = next(iter(kernel_blobs(root).items()))
    with Store.open(root) as store:
        os.chown(store.blob_path(ref), 4242, 4242)
    b = on_host(compile_host, env, True, INLINE)
    assert b["failopen"].get("untrusted_engine", 0) >= 1, b["failopen"]  # AOTAutograd asks for the graph, then Inductor
    so = name.split(".", 2)[2]
    assert any(p.endswith(so) for p in b["builds"]), b["builds"]  # this host's own build, not the foreign file
    assert b["output"] == seed[1]["output"]


@pytest.mark.slow
def test_an_entry_evicted_under_the_budget_is_compiled_again_and_stored(seed):
    env, root = copy_store(seed, "evicted")
    with Store.open(root, grace_period=0.0) as store:
        plan = store.plan_eviction(max_size=0, namespace=FX)
        assert {v.key for v in plan.victims} == {e.key for e in store.entries(namespace=FX)}
        plan.execute()
        assert list(store.entries(namespace=FX)) == []
    b = on_host(compile_host, env, True, INLINE)
    assert b["inductor"].get("fxgraph_cache_miss", 0) >= 1 and b["builds"], b  # AOTAutograd's lookup, Inductor's
    assert b["output"] == seed[1]["output"] and b["failopen"] == {}
    assert entry_is_whole(root)


def test_without_a_store_torch_compile_works_and_says_why_once(seed):
    base, a = seed
    blocked = base / "blocked"
    blocked.write_text("a file where the store root should be")
    # Inductor's own directories are A's: its local caches keep working without adstore.
    env = {**host_env(base, "a"), "ADSTORE_ROOT": str(blocked)}
    b = on_host(compile_host, env)
    assert b["enabled"] is False and sum(b["failopen"].values()) == 1, b["failopen"]
    assert len(b["warnings"]) == 1 and "without adstore" in b["warnings"][0], b["warnings"]
    assert b["output"] == a["output"] and b["builds"] == [] and b["inductor"].get("fxgraph_cache_hit") == 1


def test_a_local_hit_does_not_ask_the_store(seed):
    base, a = seed
    env, root = copy_store(seed, "warm")
    env = {**host_env(base, "a"), "ADSTORE_ROOT": str(root)}  # A's own Inductor directories: warm
    with Store.open(root) as store:
        before = {e.key: e.hits for e in store.entries() if e.namespace != "inductor_toolchain"}
    b = on_host(compile_host, env, True, INLINE)
    assert b["builds"] == [] and b["inductor"].get("fxgraph_cache_hit") == 1 and b["output"] == a["output"], b
    with Store.open(root) as store:
        after = {e.key: e.hits for e in store.entries() if e.namespace != "inductor_toolchain"}
    assert after == before and len(before) == 2, (before, after)  # FX graph and AOTAutograd: never looked up
