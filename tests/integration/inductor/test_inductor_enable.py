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
    from torch._inductor import codecache
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

    def stuck_restore(self, answered=None) -> int:
        started.set()
        release.wait(60)
        return 0

    monkeypatch.setattr(entries.InductorEntries, "restore_toolchain", stuck_restore)
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
