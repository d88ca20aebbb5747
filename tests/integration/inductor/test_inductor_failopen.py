"""Failing open without a compile: a full, closed or damaged store makes a get a miss and a put a no-op.

:class:`~adstore.integration.inductor.entries.InductorEntries` is what
Inductor's backend calls; nothing it meets may raise into ``torch.compile``.
Each case is counted under its reason (``FAILOPEN``, and the store's
``inductor.failopen.<reason>`` when the store can still count) and logged once.
"""

from __future__ import annotations

import logging
import os

import pytest

from adstore.integration.inductor.entries import FAILOPEN, InductorEntries
from adstore.store import Store

pytest.importorskip("torch")

ME = frozenset({os.geteuid(), 0})
FX = "inductor_fx_graph"


def test_a_full_store_keeps_nothing_and_raises_nothing(tmp_path, caplog):
    before = FAILOPEN["over_budget"]
    with Store.open(tmp_path / "store", max_size=16 << 10, inline_threshold=1024) as store:
        entries = InductorEntries(store, trusted=ME, owns_store=False)
        with caplog.at_level(logging.WARNING, logger="adstore.integration.inductor"):
            entries.put(FX, "pt2:fx-graph-v1::k1:c1", os.urandom(64 << 10))
            entries.put(FX, "pt2:fx-graph-v1::k2:c1", os.urandom(64 << 10))
        assert FAILOPEN["over_budget"] == before + 2
        assert entries.get(FX, "pt2:fx-graph-v1::k1:c1") is None
        store.flush()
        assert store.stats().counters.get("inductor.failopen.over_budget", 0) >= 2
    logged = len([r for r in caplog.records if "over_budget" in r.getMessage()])
    assert logged == (1 if before == 0 else 0)  # once per reason and process


def test_a_stored_value_round_trips_and_a_damaged_one_is_a_miss_then_replaced(tmp_path):
    with Store.open(tmp_path / "store", inline_threshold=1024) as store:
        entries = InductorEntries(store, trusted=ME, owns_store=False)
        value = b'{"data": "' + os.urandom(8 << 10).hex().encode() + b'"}'
        entries.put(FX, "pt2:fx-graph-v1::k:c1", value)
        assert entries.get(FX, "pt2:fx-graph-v1::k:c1") == value
        key, components = entries.key(FX, "pt2:fx-graph-v1::k:c1")
        assert store.entry(key).namespace == FX and components["inductor_key"] == "pt2:fx-graph-v1::k:c1"
        assert {"torch_key", "toolchain"} <= set(components)
        ref = store.lookup(key).manifest.artifacts["value"]
        path = store.blob_path(ref)
        os.chmod(path, 0o644)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # inside a zstd frame (a byte of the seek table at the end changes no content)
        path.write_bytes(bytes(data))
        before = FAILOPEN["checksum"]
        assert entries.get(FX, "pt2:fx-graph-v1::k:c1") is None  # never handed to Inductor's unpickler
        assert FAILOPEN["checksum"] == before + 1
        entries.put(FX, "pt2:fx-graph-v1::k:c1", value)  # Inductor compiled and saved again
        assert entries.get(FX, "pt2:fx-graph-v1::k:c1") == value


def test_a_closed_store_is_a_miss_and_a_no_op(tmp_path):
    store = Store.open(tmp_path / "store")
    entries = InductorEntries(store, trusted=ME, owns_store=False)
    entries.key(FX, "warm")  # the identity is computed while the store is open
    store.close()
    before = sum(FAILOPEN.values())
    assert entries.get(FX, "pt2:fx-graph-v1::k:c1") is None
    entries.put(FX, "pt2:fx-graph-v1::k:c1", b"{}")
    assert entries.restore_toolchain() == 0
    assert sum(FAILOPEN.values()) == before + 3
