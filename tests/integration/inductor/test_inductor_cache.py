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
    # Every kernel came from the store: the ~150 MB header is neither placed nor preprocessed (no build needs it).
    assert not list(Path(env["TMPDIR"]).rglob("*.h.gch")), "the precompiled header was placed for nothing"
    assert b["preprocessed"] == 0 and seed[1]["preprocessed"] > 0, (b["preprocessed"], seed[1]["preprocessed"])


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
    # That build needed the precompiled header: placed from the store then, not built here.
    assert list(Path(env["TMPDIR"]).rglob("*.h.gch")), "the header was not placed for the build"
    assert not [p for p in b["builds"] if p.endswith(".gch")], b["builds"]
    assert b["preprocessed"] >= 1


def _build_through_a_submit(env: dict[str, str]) -> dict[str, object]:
    """With adstore enabled, load a new C++ kernel the way compile workers get it: through ``submit_fn``."""
    os.environ.update(env)
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    tempfile.tempdir = None
    from inductor_hosts import count_builds
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    from adstore.integration import inductor

    builds = count_builds()
    assert inductor.enable()
    sent: list[str] = []
    pool = ThreadPoolExecutor(1)

    def submit(work):  # what a worker would get: the builders' command lines as they are sent
        sent.extend(b.get_command_line() for b in work.args[1])
        return pool.submit(work)

    code = 'extern "C" void kernel(const float* in_ptr0, float* out_ptr0) { out_ptr0[0] = 2.0f * in_ptr0[0]; }'
    future = CppPythonBindingsCodeCache.load_pybinding_async(["const float*", "float*"], code, submit_fn=submit)
    loaded = callable(future())
    inductor.disable()
    return {"loaded": loaded, "sent": sent, "builds": builds, "failopen": dict(inductor.FAILOPEN)}


def test_a_build_sent_to_compile_workers_gets_the_header_settled_first(seed):
    """The deferred header is settled before a build is submitted: a worker never sees a placeholder."""
    env, _ = copy_store(seed, "workers")
    w = on_host(_build_through_a_submit, env)
    assert w["loaded"] and w["failopen"] == {}, w
    assert w["sent"] and not [c for c in w["sent"] if "adstore-deferred-header-" in c], w["sent"]
    assert any("-include " in c and "precompiled_headers" in c for c in w["sent"]), w["sent"]
    assert not [b for b in w["builds"] if b.endswith(".gch")], "the header came from the store, not a build"
    assert list(Path(env["TMPDIR"]).rglob("*.h.gch")) and not list(Path(env["TMPDIR"]).rglob("adstore-deferred-*"))
