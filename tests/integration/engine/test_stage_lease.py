"""The compile stage's single-flight lease is its own key, not its cache point's.

Two hosts compiling different stages under one prefix (other input shapes,
other options) must not wait for each other: each waits only for a host
compiling the very stage it needs.  Host A is held inside its compile (a
hook at the compile step, so the race is the same every run); host B with
other input shapes compiles at once, host C with A's own stage follows A's
lease (the control: the lease is live, so B's not waiting proves the keying).
"""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from adstore.integration.coordination.events import CacheEvent, EventKind, Source
from adstore.integration.engine.hashing import input_specs
from adstore.integration.engine.index import index_key, lease_key
from adstore.integration.engine.stage import EngineStage
from adstore.integration.pipeline.prefix import CachedPrefix

PREFIX_KEY, SNAPSHOT = "a" * 64, "b" * 64


@pytest.fixture
def remote(monkeypatch):
    monkeypatch.setenv("ADSTORE_REMOTE_MODE", "read-write")
    monkeypatch.setenv("ADSTORE_REMOTE_WAIT", "1")  # only the control (host C) waits, this long
    return f"memory://stage-lease-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def held_compile(monkeypatch):
    """The compile step as a hook (no real compile): a host whose root is in ``gates`` says it started, then
    waits for the test to let it finish."""
    gates: dict[str, tuple[threading.Event, threading.Event]] = {}

    def compile_step(self, module, example_inputs, key):
        gate = gates.get(str(self.root))
        if gate is not None:
            gate[0].set()
            assert gate[1].wait(120), "the test never let the compile finish"
        return module, CacheEvent(EventKind.SAVE, key=key.key if key else None, source=Source.COMPILED)

    monkeypatch.setattr(EngineStage, "_compile", compile_step)
    return gates


def _compile(tmp_path, host: str, remote: str, shape: tuple[int, ...]):
    """Host ``host`` runs the compile step of ``cached_prefix``'s result (same prefix on every host)."""
    prefix = CachedPrefix(
        module=torch.nn.Identity(), events=(), key=PREFIX_KEY, root=str(tmp_path / host), snapshot=SNAPSHOT
    )
    return prefix.compile(torch.nn.Identity(), (torch.zeros(shape),), remote=remote)


def test_stages_with_other_inputs_under_one_prefix_do_not_wait_for_each_other(tmp_path, remote, held_compile):
    started, go = threading.Event(), threading.Event()
    held_compile[str(tmp_path / "a")] = (started, go)
    done: dict[str, object] = {}
    runner = threading.Thread(target=lambda: done.update(a=_compile(tmp_path, "a", remote, (2, 8))))
    runner.start()
    try:
        assert started.wait(120), "host A never reached its compile"
        b = _compile(tmp_path, "b", remote, (4, 8))  # other input shapes: another stage under the same prefix
        c = _compile(tmp_path, "c", remote, (2, 8))  # A's own stage: it follows A's lease (the control)
    finally:
        go.set()
        runner.join(120)
    b_miss, c_miss = b.events[0], c.events[0]
    assert b_miss.kind == EventKind.MISS and b_miss.reason == "absent", b_miss  # led its own lease: no wait
    assert "waited" not in (b_miss.detail or ""), b_miss
    assert [e.kind for e in b.events] == [EventKind.MISS, EventKind.SAVE]
    assert c_miss.kind == EventKind.MISS and c_miss.reason == "single_flight_timeout", c_miss
    assert [e.kind for e in done["a"].events] == [EventKind.MISS, EventKind.SAVE]


def test_the_ranks_of_a_host_share_one_lease_and_other_stages_have_their_own():
    def key(rank: int, snapshot: str, shape: tuple[int, ...]):
        return index_key(
            prefix={"key": PREFIX_KEY, "snapshot": snapshot},  # each rank restores its own snapshot
            suffix=[{"name": "compile", "config": {}}],
            code=[EngineStage],
            inputs=input_specs((torch.zeros(shape),)),
            settings={},
            backend="aoti",
            rank=rank,
            world_size=2,
        )

    rank0, rank1 = key(0, "b" * 64, (2, 8)), key(1, "c" * 64, (2, 8))
    assert rank0.key != rank1.key  # each rank has its own index entry ...
    assert lease_key(rank0) == lease_key(rank1)  # ... and both follow (or lead) one lease
    assert lease_key(key(0, "b" * 64, (4, 8))) != lease_key(rank0)
