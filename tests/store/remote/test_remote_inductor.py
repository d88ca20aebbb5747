"""Inductor's caches through adstore with a remote tier: two spawned "hosts" share one real server.

Host A (read-write, signing) runs plain ``torch.compile`` on a small MLP with
``adstore.integration.inductor.enable()``; its FX-graph, AOTAutograd and
toolchain entries (kernels inline in the index, the precompiled header a
compressed blob file) are pushed as signed records.  Host B (read-only,
trusting A's key, an empty store, empty Inductor cache directory and
``TMPDIR``) builds no kernel, no ISA probe and no header (nor fetches one:
no build needs it, nor does its save at exit: 0 header bytes, 3 remote hits),
and computes A's outputs bit for bit.  In the slow run: a host trusting
another key compiles everything itself (``untrusted_remote``), and a host
whose remote is down compiles and says so once.  The S3 server (moto) in the default run; the
Bazel HTTP protocol (WebDAV) in the slow run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from adstore.integration.inductor.entries import TOOLCHAIN_KEY, TOOLCHAIN_NAMESPACE
from adstore.store import Store
from adstore.store.remote import write_keypair

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "inductor"))
from inductor_hosts import compile_host, host_env, on_host  # noqa: E402


def header_refs(root: Path) -> list[tuple[str, int]]:
    """The precompiled header's blobs (digest, size) in the toolchain entry of the store at ``root``."""
    with Store.open(root) as store:
        keys = [e.key for e in store.entries(namespace=TOOLCHAIN_NAMESPACE)]
        (key,) = [k for k in keys if store.entry(k).components.get("inductor_key") == TOOLCHAIN_KEY]
        (manifest,) = store.manifests(key)
        return sorted({(r.digest, r.size) for n, r in manifest.artifacts.items() if n.startswith("pch.")})


def held(root: Path, refs: list[tuple[str, int]]) -> int:
    """How many of ``refs``' bytes the store at ``root`` holds."""
    with Store.open(root) as store:
        return sum(size for digest, size in refs if store.has_blob(digest))


@pytest.mark.parametrize("backend", ["s3", pytest.param("http", marks=pytest.mark.slow)])
def test_host_b_builds_no_kernel_host_a_built(backend, request, tmp_path):
    url = request.getfixturevalue(f"{backend}_url")
    private, public = write_keypair(tmp_path / "keys")
    writer = {"ADSTORE_REMOTE": url, "ADSTORE_REMOTE_MODE": "read-write", "ADSTORE_SIGNING_KEY": str(private)}
    a = on_host(compile_host, host_env(tmp_path, "a", **writer))
    assert a["enabled"] and a["failopen"] == {} and a["builds"], a
    assert a["store"]["remote.records_up"] >= 4, a["store"]  # FX graph, AOTAutograd, toolchain, ISA answers
    b_env = host_env(tmp_path, "b", ADSTORE_REMOTE=url, ADSTORE_TRUSTED_KEYS=str(public))
    b = on_host(compile_host, b_env)
    assert b["builds"] == [] and b["probes"] == 0 and b["preprocessed"] == 0, b
    # No build needs the precompiled header: its ~150 MB are neither downloaded nor placed.
    assert b["store"]["remote.bytes_down"] < 10_000_000 and not list(Path(b_env["TMPDIR"]).rglob("*.gch")), b
    assert b["output"] == a["output"] and b["failopen"] == {}, b
    assert b["inductor"].get("fxgraph_cache_hit") == 1 and b["aot_autograd"].get("autograd_cache_hit") == 1, b
    assert b["store"]["remote.hits"] >= 3 and b["store"]["inductor.files_placed"] > 0, b["store"]
    assert "remote.bytes_up" not in b["store"]
    # At exit too (the toolchain save): B built no header, so it neither looks the header entry up nor
    # fetches it. Its remote hits are the checklist's 3 (ISA answers, FX graph, AOTAutograd) and it holds
    # none of the header's bytes (docs/torch-compile.md, "A fleet checklist").
    header = header_refs(tmp_path / "a" / "store")
    assert sum(size for _, size in header) > 1_000_000, header  # A's header: what B must not move
    at_exit = b["store_at_exit"]
    assert (held(tmp_path / "b" / "store", header), at_exit["remote.hits"]) == (0, 3), at_exit
    remote = {k: v for k, v in at_exit.items() if k.startswith("remote.")}
    assert remote == {k: v for k, v in b["store"].items() if k.startswith("remote.")}, at_exit  # exit: no call


@pytest.mark.slow
def test_an_untrusted_writers_entries_are_never_loaded(s3_url, tmp_path):
    private, _ = write_keypair(tmp_path / "keys")
    _, other_public = write_keypair(tmp_path / "other")
    writer = {"ADSTORE_REMOTE": s3_url, "ADSTORE_REMOTE_MODE": "read-write", "ADSTORE_SIGNING_KEY": str(private)}
    a = on_host(compile_host, host_env(tmp_path, "a", **writer))
    c = on_host(compile_host, host_env(tmp_path, "c", ADSTORE_REMOTE=s3_url, ADSTORE_TRUSTED_KEYS=str(other_public)))
    assert c["failopen"].get("untrusted_remote", 0) >= 2, c["failopen"]  # the toolchain's and the graph's records
    assert len([w for w in c["warnings"] if "untrusted_remote" in w]) == 1, c["warnings"]
    assert c["inductor"].get("fxgraph_cache_miss", 0) >= 1 and c["builds"], c
    assert c["output"] == a["output"] and "remote.hits" not in c["store"]


@pytest.mark.slow
def test_a_remote_that_is_down_means_a_compile_and_one_log_line(tmp_path):
    down = {"ADSTORE_REMOTE": "http://127.0.0.1:9/adstore", "ADSTORE_REMOTE_MODE": "read-write"}
    c = on_host(compile_host, host_env(tmp_path, "c", **down))
    assert c["enabled"] and c["builds"] and c["inductor"].get("fxgraph_cache_miss", 0) >= 1, c
    reasons = {r for r in c["failopen"] if r.startswith("remote_")}
    assert reasons and all(c["failopen"][r] >= 1 for r in reasons), c["failopen"]
    assert len([w for w in c["warnings"] if "without adstore" in w]) == len(reasons), c["warnings"]
