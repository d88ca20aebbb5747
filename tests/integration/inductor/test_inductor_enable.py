"""``enable()`` and ``disable()``: what they change in torch, and that ``disable()`` puts back exactly what was there.

In this process, without compiling: the configuration flags, each remote
cache class's ``backend_override_cls`` and the watched Inductor functions.
"""

from __future__ import annotations

import pytest

from adstore.integration import inductor
from adstore.store import Store

torch = pytest.importorskip("torch")


def _torch_state():
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch._inductor.remote_cache as remote_cache
    from torch._inductor import codecache, cpp_builder
    from torch._inductor.cpu_vec_isa import VecISA

    return {
        "flags": (
            inductor_config.fx_graph_remote_cache,
            inductor_config.autotune_remote_cache,
            inductor_config.bundled_autotune_remote_cache,
            functorch_config.enable_remote_autograd_cache,
            dynamo_config.automatic_dynamic_remote_pgo,
        ),
        "backends": {n: vars(getattr(remote_cache, n)).get("backend_override_cls") for n in inductor.NAMESPACES},
        "watched": (
            vars(codecache.CppCodeCache)["_load_library"],
            vars(codecache.CppCodeCache)["load_async"],
            vars(cpp_builder.CppBuilder)["build"],
            codecache._precompile_header,
            vars(VecISA)["check_build"],
        ),
    }


def test_enable_plugs_every_cache_and_disable_restores_torch(tmp_path):
    before = _torch_state()
    with Store.open(tmp_path / "store") as store:
        assert inductor.enable(store) is True
        try:
            during = _torch_state()
            assert inductor.active() is not None and inductor.active().store is store
            assert during["flags"][0] is True and during["flags"][3] is True and during["flags"][4] is True
            assert all(callable(b) for b in during["backends"].values())
            made = during["backends"]["RemoteFxGraphCache"]()
            assert made.namespace == "inductor_fx_graph" and made.get("pt2:fx-graph-v1::nothing:c1") is None
            assert all(w is not b for w, b in zip(during["watched"], before["watched"], strict=True))
        finally:
            inductor.disable()
        assert inductor.active() is None
        assert _torch_state() == before
        assert store.lookup("0" * 64).reason == "absent"  # a store the caller gave stays open


def test_enable_without_a_usable_store_changes_nothing(tmp_path, monkeypatch):
    blocked = tmp_path / "blocked"
    blocked.write_text("not a directory")
    monkeypatch.setenv("ADSTORE_ROOT", str(blocked))
    before = _torch_state()
    assert inductor.enable() is False
    assert inductor.active() is None and _torch_state() == before


def test_inductor_waits_for_the_toolchain_restore_and_a_stuck_one_only_costs_the_wait(tmp_path, monkeypatch):
    """The toolchain entry is restored in the background; an unanswered ISA probe waits for it, boundedly."""
    import threading

    from adstore.integration.inductor import entries, plug

    release, started = threading.Event(), threading.Event()

    def stuck_restore(self, answered=None) -> bool:
        started.set()
        release.wait(60)
        return True

    monkeypatch.setattr(entries.InductorEntries, "find_toolchain", stuck_restore)
    monkeypatch.setattr(plug, "TOOLCHAIN_WAIT", 0.05)
    from torch._inductor.cpu_vec_isa import VecAVX2

    with Store.open(tmp_path / "store") as store:
        assert inductor.enable(store) is True
        try:
            assert started.wait(30)
            before = inductor.FAILOPEN["remote_timeout"]
            VecAVX2().check_build("not C++")  # the probe waits, gives up, and runs (and fails to build)
            VecAVX2().check_build("not C++ either")  # the deadline is past: no second wait, no second count
            assert inductor.FAILOPEN["remote_timeout"] == before + 1
            release.set()
            plug._state.toolchain.thread.join(30)
            plug._await_toolchain()  # over: returns at once
        finally:
            release.set()
            inductor.disable()


@pytest.mark.parametrize("step", ["flag", "watch", "probes"])
def test_enable_failing_midway_puts_every_flag_and_backend_back(tmp_path, monkeypatch, step):
    """A step after the first backend and flag are switched raises: enable() returns False, torch is as it was."""
    from adstore.integration.inductor import kernels, plug
    from adstore.integration.placement import probes

    def boom(*args, **kwargs):
        raise RuntimeError(f"{step} step broke")

    if step == "flag":  # the second configuration module cannot be set
        seen: list[str] = []
        module = plug._module

        def second_breaks(name):
            seen.append(name)
            if len(seen) == 2:
                raise RuntimeError("flag step broke")
            return module(name)

        monkeypatch.setattr(plug, "_module", second_breaks)
    elif step == "watch":
        monkeypatch.setattr(kernels.RECORDER, "install", boom)
    else:
        monkeypatch.setattr(probes.PROBES, "install", boom)
    before = _torch_state()
    counted = inductor.FAILOPEN["integration_error"]
    with Store.open(tmp_path / "store") as store:
        assert inductor.enable(store) is False
        assert inductor.active() is None
        assert _torch_state() == before
        assert inductor.FAILOPEN["integration_error"] == counted + 1
        assert store.lookup("0" * 64).reason == "absent"  # the caller's store stays open
    monkeypatch.undo()
    with Store.open(tmp_path / "store") as store:  # and a later enable works
        assert inductor.enable(store) is True
        inductor.disable()
    assert _torch_state() == before


def test_the_toolchain_wait_is_one_deadline_per_process():
    """Three steps ask for a stuck restore: the process waits TOOLCHAIN_WAIT once in all, and counts it once."""
    import threading

    from adstore.integration.inductor.toolchain import Toolchain

    now = [100.0]
    waits: list[float] = []

    def waiter(event: threading.Event, timeout: float) -> bool:
        waits.append(timeout)
        now[0] += timeout  # a stuck restore: the whole timeout passes
        return False

    class Stuck:
        store = None

        def find_toolchain(self, answered=None):
            threading.Event().wait(30)  # never sets anything within the test

    chain = Toolchain(Stuck(), wait=10.0, answers_wait=1.0, clock=lambda: now[0], waiter=waiter, sweep=False)  # type: ignore[arg-type]
    before = inductor.FAILOPEN["remote_timeout"]
    chain.start()
    now[0] += 4.0  # Dynamo traced for 4 s before the first ISA probe
    for _ in range(3):
        chain.wait_answers()  # ten probes ask: the first waits its second, the others run at once
    chain.wait_done()
    chain.wait_done()
    assert waits == [1.0, 5.0], waits  # the answers' second, then the rest of the one deadline, once
    assert inductor.FAILOPEN["remote_timeout"] == before + 1
