"""The toolchain entry across install paths (headers merged with a cap, chosen by path, a miss named); hit counters.

Inductor names its precompiled header after a command line holding torch's
and Python's include and library paths, so the same venv at another path
needs another header.  Two such hosts share one toolchain entry: each keeps
its own header in it (neither replaces the other's on every run), each
places only the header built under its own paths, and a host none of the
stored headers fits is told which path differs.  The paths are injected
(``install_paths``); the store, the files and the placement are real.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from adstore.integration.inductor import entries as entries_mod
from adstore.integration.inductor.entries import TOOLCHAIN_NAMESPACE, InductorEntries
from adstore.integration.inductor.toolchain_entry import HEADER_CAP, choose, header_of, merge, path_differences
from adstore.store import Store

pytest.importorskip("torch")

ME = frozenset({os.geteuid(), 0})


def paths(venv: str) -> dict[str, str]:
    return {
        "torch": f"{venv}/lib/python3.11/site-packages/torch",
        "python_include": "/usr/include/python3.11",
        "python_lib": "/usr/lib",
        "prefix": venv,
    }


A, B, C = paths("/opt/venv"), paths("/home/me/venv"), paths("/srv/venv")


def test_headers_merge_newest_first_up_to_the_cap_and_their_files_go_with_them():
    artifacts: dict[str, object] = {"cache.ab.probe.so": 1}
    meta: dict = {"isa": "kept"}
    for i in range(HEADER_CAP + 2):
        artifacts, meta = merge(artifacts, meta, {f"pch.h{i}.h": i, f"pch.h{i}.h.gch": i}, paths(f"/v{i}"))
    kept = [h["name"] for h in meta["headers"]]
    assert kept == [f"h{i}.h" for i in reversed(range(2, HEADER_CAP + 2))]
    assert {header_of(a) for a in artifacts} - {None} == set(kept)
    assert artifacts["cache.ab.probe.so"] == 1 and meta["isa"] == "kept"  # probes and other meta stay
    assert meta["headers"][0]["paths"] == paths(f"/v{HEADER_CAP + 1}")


def test_a_host_places_only_the_header_built_under_its_paths_and_else_names_the_path():
    artifacts, meta = merge(None, None, {"pch.ha.h": 1, "pch.ha.h.gch": 1}, A)
    artifacts, meta = merge(artifacts, meta, {"pch.hb.h": 2, "pch.hb.h.gch": 2}, B)
    assert choose(artifacts, meta, A) == ({"pch.ha.h": 1, "pch.ha.h.gch": 1}, [])
    assert choose(artifacts, meta, B)[0] == {"pch.hb.h": 2, "pch.hb.h.gch": 2}
    chosen, differs = choose(artifacts, meta, C)
    assert chosen == {} and differs == path_differences(B, C) and len(differs) == 1
    assert differs[0].startswith("torch: /home/me/venv/") and "(builder) vs /srv/venv/" in differs[0]
    # An entry written before headers carried their paths is placed whole.
    assert choose(artifacts, {}, C)[0] == artifacts


def _host(tmp_path: Path, name: str, monkeypatch, here: dict[str, str]) -> tuple[Path, Path]:
    """Host ``name``: its own Inductor cache and header directories, its install paths (injected)."""
    from torch._inductor import codecache

    cache, headers = tmp_path / name / "inductor", tmp_path / name / "headers"
    cache.mkdir(parents=True, mode=0o700)
    headers.mkdir(mode=0o700)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setattr(codecache, "_HEADER_DIR", str(headers))
    monkeypatch.setattr(entries_mod, "install_paths", lambda: dict(here))
    return cache, headers


def _build_header(headers: Path, name: str) -> list[str]:
    """What Inductor's header step leaves: the header and its (large) precompiled form."""
    (headers / name).write_text("#include <torch/csrc/inductor/cpp_prefix.h>\n")
    (headers / f"{name}.gch").write_bytes(os.urandom(64 << 10))
    return [str(headers / name), str(headers / f"{name}.gch")]


def test_two_install_paths_share_one_entry_without_replacing_each_others_header(tmp_path, monkeypatch, caplog):
    with Store.open(tmp_path / "store", inline_threshold=1024) as store:
        entries = InductorEntries(store, trusted=ME, owns_store=False)
        _, headers = _host(tmp_path, "a", monkeypatch, A)
        entries.save_toolchain(_build_header(headers, "ha.h"), {}, set())

        _, headers = _host(tmp_path, "b", monkeypatch, B)
        with caplog.at_level(logging.WARNING, logger="adstore.integration.inductor"):
            assert entries.restore_toolchain() == 0  # A's header would never be used here
        (line,) = [r.getMessage() for r in caplog.records if "install path" in r.getMessage()]
        assert "torch: /opt/venv/lib/python3.11/site-packages/torch (builder) vs /home/me/venv/" in line
        entries.save_toolchain(_build_header(headers, "hb.h"), {}, set())  # Inductor built B's own

        key, _ = entries.key(TOOLCHAIN_NAMESPACE, "toolchain")
        manifest = store.lookup(key, count=False).manifest
        assert {"pch.ha.h", "pch.ha.h.gch", "pch.hb.h", "pch.hb.h.gch"} <= set(manifest.artifacts)
        assert [h["name"] for h in manifest.meta["headers"]] == ["hb.h", "ha.h"]

        _, headers = _host(tmp_path, "a2", monkeypatch, A)
        assert entries.restore_toolchain() == 2 and sorted(p.name for p in headers.iterdir()) == ["ha.h", "ha.h.gch"]
        _, headers = _host(tmp_path, "b2", monkeypatch, B)
        assert entries.restore_toolchain() == 2 and sorted(p.name for p in headers.iterdir()) == ["hb.h", "hb.h.gch"]
        store.flush()
        assert store.stats().counters.get("inductor.install_path_differs") == 1


def test_a_hit_counts_its_namespace_and_the_compile_time_it_saved(tmp_path):
    with Store.open(tmp_path / "store", inline_threshold=1024) as store:
        entries = InductorEntries(store, trusted=ME, owns_store=False)
        entries.put("inductor_fx_graph", "pt2:fx-graph-v1::k:c1", b"graph", seconds=2.5)
        entries.put("inductor_aot_autograd", "pt2:aot::k:c1", b"aot", seconds=3.0)
        key, _ = entries.key("inductor_fx_graph", "pt2:fx-graph-v1::k:c1")
        assert store.lookup(key, count=False).manifest.meta["compile_seconds"] == 2.5
        assert entries.get("inductor_aot_autograd", "pt2:aot::k:c1") == b"aot"
        assert entries.get("inductor_fx_graph", "pt2:fx-graph-v1::k:c1") == b"graph"
        store.flush()
        counters = store.stats().counters
        # The AOTAutograd hit's compile contains the FX graph's: only the FX-graph entry's time is counted.
        assert counters["ms_saved"] == 2500
        assert counters["inductor.hits.inductor_fx_graph"] == 1 and counters["inductor.hits.inductor_aot_autograd"] == 1


def test_a_graph_hit_under_another_install_path_names_the_path(tmp_path, monkeypatch, caplog):
    keyed = ("torch", "python_include", "python_lib")
    with Store.open(tmp_path / "store", inline_threshold=1024) as store:
        entries = InductorEntries(store, trusted=ME, owns_store=False)
        monkeypatch.setattr(entries_mod, "keyed_paths", lambda: {k: A[k] for k in keyed})
        entries.put("inductor_fx_graph", "pt2:fx-graph-v1::g:c1", b"graph", seconds=1.0)
        with caplog.at_level(logging.WARNING, logger="adstore.integration.inductor"):
            assert entries.get("inductor_fx_graph", "pt2:fx-graph-v1::g:c1") == b"graph"  # same paths: silent
            assert not [r for r in caplog.records if "install path" in r.getMessage()]
            monkeypatch.setattr(entries_mod, "keyed_paths", lambda: {k: C[k] for k in keyed})
            assert entries.get("inductor_fx_graph", "pt2:fx-graph-v1::g:c1") == b"graph"  # a hit, kernels rebuilt
        (line,) = [r.getMessage() for r in caplog.records if "install path" in r.getMessage()]
        assert "torch: /opt/venv/lib/python3.11/site-packages/torch (builder) vs /srv/venv/" in line


def test_a_merge_never_republishes_a_header_this_user_would_refuse(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    with Store.open(tmp_path / "store", inline_threshold=1024) as store:
        entries = InductorEntries(store, trusted=ME, owns_store=False)
        _, headers = _host(tmp_path, "a", monkeypatch, A)
        entries.save_toolchain(_build_header(headers, "ha.h"), {}, set())
        key, _ = entries.key(TOOLCHAIN_NAMESPACE, "toolchain")
        gch = store.blob_path(store.lookup(key, count=False).manifest.artifacts["pch.ha.h.gch"])
        os.chown(gch, 1001, 1001)  # as if another user had written A's header

        _, headers = _host(tmp_path, "b", monkeypatch, B)
        entries.save_toolchain(_build_header(headers, "hb.h"), {}, set())
        manifest = store.lookup(key, count=False).manifest
        assert {a for a in manifest.artifacts if a.startswith("pch.")} == {"pch.hb.h", "pch.hb.h.gch"}
        assert [h["name"] for h in manifest.meta["headers"]] == ["hb.h"]


def test_a_host_that_built_no_header_never_fetches_the_header_entry_at_its_save(tmp_path, monkeypatch):
    """The exit-time save of a host whose kernels all came from the remote moves 0 header bytes.

    Its answers are saved in their own entry; the header entry is neither
    looked up (a remote restore would download every header it holds) nor
    saved.  A save that has a header merges with this store's entry only.
    """
    from adstore.store.remote import MemoryBackend, Remote, Signer, TrustedKeys, generate_keypair

    pair = generate_keypair()
    backend = MemoryBackend()
    signer, keys = Signer.from_pem(pair.private_pem), TrustedKeys.from_pem(pair.public_pem)
    answers = {"a" * 64: True, "b" * 64: False}
    with Store.open(
        tmp_path / "builder", inline_threshold=1024, remote=Remote(backend, mode="read-write", signer=signer)
    ) as store:
        _, headers = _host(tmp_path, "builder", monkeypatch, A)
        InductorEntries(store, trusted=ME, owns_store=False).save_toolchain(
            _build_header(headers, "ha.h"), answers, set()
        )
        key, _ = InductorEntries(store, trusted=ME, owns_store=False).key(TOOLCHAIN_NAMESPACE, "toolchain")
        header = [r for n, r in store.lookup(key, count=False).manifest.artifacts.items() if n.startswith("pch.")]
    reader = Remote(backend, mode="read", trusted=keys)
    with Store.open(tmp_path / "new", inline_threshold=1024, remote=reader) as store:
        entries = InductorEntries(store, trusted=ME, owns_store=False)
        _, headers = _host(tmp_path, "new", monkeypatch, A)
        assert entries.find_toolchain()  # the answers' entry, from the remote
        entries.save_toolchain([], answers, set())  # at exit: no kernel built, no header met
        assert not [r for r in header if store.has_blob(r)] and store.entry(key) is None
        entries.save_toolchain(_build_header(headers, "ha.h"), answers, stored := set())  # a header met after all
        assert store.lookup(key, count=False, local=True).hit and {"pch.ha.h", "pch.ha.h.gch"} <= stored
        store.flush()
        assert store.stats().counters["remote.hits"] == 1  # the answers' entry; never the header entry's
