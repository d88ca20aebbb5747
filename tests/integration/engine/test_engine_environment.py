"""The next process and other environments (docs/pipeline-cache.md, "Environment checks").

A next process's hit loads the package without probing the CPU; two
processes compiling at once share one store (slow); another CPU capability
or a (simulated) GPU host is an ``incompatible_env`` miss naming the field,
while volatile facts (pid, working directory, host name) do not change the
hash.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from engine_support import X, lookup_in, make_model

from adstore.integration.engine.cache import EngineCache
from adstore.integration.engine.storage import StoreEngineStorage
from adstore.store import Store


def _compile_in_child(root: str, seed: int) -> tuple[str, str, float]:
    """Spawned worker: compile through a store another process is writing too."""
    with Store.open(root, grace_period=0.0) as store:
        front = EngineCache(StoreEngineStorage(store))
        model = make_model(seed)
        engine = front.compile(model, (X,))
        err = (engine(X) - model(X)).abs().max().item()
        front.close()
        return engine.event.kind, engine.hash, err


def _hit_in_child(root: str) -> tuple[str, float, int]:
    """Spawned worker: a next-process hit; did loading the package probe the CPU's vector ISA?"""
    from torch._inductor import cpu_vec_isa

    with Store.open(root, grace_period=0.0) as store:
        front = EngineCache(StoreEngineStorage(store))
        model = make_model(1)
        engine = front.compile(model, (X,))
        err = (engine(X) - model(X)).abs().max().item()
        front.close()
    return engine.event.kind, err, cpu_vec_isa.valid_vec_isa_list.cache_info().currsize


def test_a_next_process_hit_loads_the_package_without_probing_the_cpu(env):
    """torch's package loader probes the vector ISA (compiling test programs, ~1 s) only to warn;
    the key pins the CPU capability, so the hit skips it and still computes the right outputs."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        kind, err, probed = pool.apply(_hit_in_child, (str(env["store"].root),))
    assert kind == "hit" and err < 1e-5
    assert probed == 0


@pytest.mark.slow
def test_concurrent_processes_compile_and_share_one_store(tmp_path, env):
    import multiprocessing as mp

    root = str(tmp_path / "shared")
    Store.open(root, grace_period=0.0).close()
    with mp.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(_compile_in_child, [(root, 21), (root, 22)])
    assert {r[1] for r in results} == {env["hash"]}
    assert all(r[2] < 1e-5 for r in results), results
    with Store.open(root, grace_period=0.0) as store:
        assert store.verify().ok
        assert [e.key for e in store.entries(namespace="engine")] == [env["hash"]]
        engine, event = lookup_in(StoreEngineStorage(store), make_model(23))
        assert engine is not None and event.kind == "hit"


def _lookup_in_child(
    root: str,
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    prefix: tuple[str, ...] = (),
    call: str = "lookup",
) -> dict:
    """A fresh interpreter looks the fixture's MLP up in ``root`` (or compiles it: ``call="compile"``); its event."""
    import subprocess
    import sys

    code = textwrap.dedent(
        f"""
        import json, os, socket, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from engine_support import X, make_model
        from adstore.integration.engine.cache import EngineCache
        from adstore.integration.engine.storage import StoreEngineStorage
        from adstore.store import Store
        with Store.open({root!r}) as store:
            front = EngineCache(StoreEngineStorage(store))
            if {call!r} == "compile":
                engine = front.compile(make_model(7), (X,))
                event = engine.event
            else:
                engine, event = front.lookup(make_model(7), (X,))
            ok = engine is not None and bool((engine(X) - make_model(7)(X)).abs().max() < 1e-5)
            front.close()
        print(json.dumps({{**event.to_dict(), "ok": ok, "host": socket.gethostname(), "cwd": os.getcwd()}}))
        """
    )
    out = subprocess.run(
        [*prefix, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_unsafe_tmpdir_turns_the_cache_off_and_the_engine_still_compiles(env, tmp_path):
    """A world-writable TMPDIR without the sticky bit holds no private directory for native code: the
    engine is AOTInductor's own, uncached, and the bypass names the reason; nothing reaches the program."""
    unsafe = tmp_path / "shared-tmp"
    unsafe.mkdir()
    unsafe.chmod(0o777)
    event = _lookup_in_child(str(env["store"].root), env={"TMPDIR": str(unsafe)}, call="compile")
    assert event["kind"] == "bypass" and event["reason"] == "unsafe_root", event
    assert "writable by every user" in event["detail"] and event["ok"], event
    event = _lookup_in_child(str(env["store"].root), env={"TMPDIR": str(unsafe)})
    assert event["kind"] == "bypass" and event["reason"] == "unsafe_root" and not event["ok"], event


def test_another_cpu_capability_is_an_incompatible_env_miss(env):
    """A real environment difference, no simulation: ATEN_CPU_CAPABILITY=default makes torch
    dispatch (and AOTInductor compile) for the baseline ISA. The next process's lookup misses
    with the field named; the engine stored for the other ISA is not loaded."""
    if str(torch.backends.cpu.get_cpu_capability()) == "DEFAULT":
        pytest.skip("this CPU has no vector ISA beyond the default")
    event = _lookup_in_child(str(env["store"].root), env={"ATEN_CPU_CAPABILITY": "default"})
    assert event["kind"] == "miss" and event["reason"] == "incompatible_env", event
    assert "toolchain.cpu.capability" in event["detail"] and env["hash"][:16] in event["detail"], event
    assert not event["ok"]


def test_simulated_gpu_fields_are_an_incompatible_env_miss(env):
    """No GPU here: ADSTORE_ENV_OVERRIDES simulates a GPU host (names, compute capability), the
    path a CUDA host takes; the miss names the field. The real GPU probe is not exercised."""
    event = _lookup_in_child(
        str(env["store"].root),
        env={"ADSTORE_ENV_OVERRIDES": json.dumps({"toolchain.gpus": [["NVIDIA H100 80GB HBM3", [9, 0]]]})},
    )
    assert event["reason"] == "incompatible_env" and "toolchain.gpus" in event["detail"], event


def test_volatile_facts_do_not_change_the_engine_hash(env, tmp_path):
    """Another pid, working directory and (when user namespaces allow it) host name: a hit."""
    import shutil
    import subprocess

    prefix: tuple[str, ...] = ()
    unshare = shutil.which("unshare")
    if (
        unshare
        and subprocess.run(
            [unshare, "--uts", "--map-root-user", "hostname", "other-host"], capture_output=True, check=False
        ).returncode
        == 0
    ):
        prefix = (unshare, "--uts", "--map-root-user", "sh", "-c", 'hostname other-host && exec "$0" "$@"')
    event = _lookup_in_child(str(env["store"].root), cwd=str(tmp_path), prefix=prefix)
    assert event["kind"] == "hit" and event["ok"] and event["cwd"] == str(tmp_path), event
    if prefix:
        assert event["host"] == "other-host"
