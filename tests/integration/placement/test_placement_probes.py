"""ISA answers travel in the toolchain entry's meta: saved merged, learnt on restore, malformed ones ignored.

On a real store, without compiling: what a warm ``enable()`` learns before
Inductor's first probe (the compile test counts the probe subprocesses:
tests/integration/inductor/test_inductor_cache.py).
"""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from adstore.integration.placement.probes import PROBES, valid_answers
from adstore.store import Store

pytest.importorskip("torch")
ME = frozenset({os.geteuid(), 0})


def _key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
def entries(tmp_path, monkeypatch):
    from adstore.integration.inductor.entries import InductorEntries

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with Store.open(tmp_path / "store") as store:
        yield InductorEntries(store, trusted=ME, owns_store=False)


def test_answers_saved_with_the_toolchain_entry_are_learnt_on_restore_and_merged(entries):
    from adstore.integration.inductor.entries import TOOLCHAIN_NAMESPACE

    first, second = _key("avx2 probe"), _key("avx512 probe")
    entries.save_toolchain([], {first: True}, set())
    entries.save_toolchain([], {second: False}, set())  # another process's answers: added, the first kept
    key, _ = entries.key(TOOLCHAIN_NAMESPACE, "isa")  # the answers' own entry
    assert valid_answers(entries.store.lookup(key).manifest.meta["isa_probes"]) == {first: True, second: False}
    header, _ = entries.key(TOOLCHAIN_NAMESPACE, "toolchain")
    assert entries.store.entry(header) is None  # no header met: the header entry is not written
    answered = threading.Event()
    entries.restore_toolchain(answered)
    assert answered.is_set() and PROBES._answer(first) is True and PROBES._answer(second) is False


def test_malformed_answers_in_the_entry_are_ignored(entries):
    from adstore.integration.inductor.entries import TOOLCHAIN_NAMESPACE

    good = _key("a probe")
    hostile = {good.upper(): True, "../" + good: True, good: "yes", _key("list"): [True], "x" * 64: False}
    key, components = entries.key(TOOLCHAIN_NAMESPACE, "toolchain")
    entries.store.save(key, {}, namespace=TOOLCHAIN_NAMESPACE, components=components, meta={"isa_probes": hostile})
    entries.restore_toolchain(threading.Event())
    assert all(PROBES._answer(k) is None for k in (good, good.upper(), _key("list")))
    entries.store.save(key, {}, namespace=TOOLCHAIN_NAMESPACE, components=components, meta={"isa_probes": [good]})
    entries.restore_toolchain(threading.Event())  # not a mapping at all: nothing learnt, nothing raised
    assert PROBES._answer(good) is None
