"""The compile stage's store: without a root, the one the environment names, its seed included.

The cache point before the stage opens the store ``ADSTORE_ROOT`` and its
seed (``ADSTORE_SEED``) name; a stage that opened the root alone missed
(``absent``) on a new host whose prefix the seed served, and compiled.  The
contract suite's seed row runs the whole restart (slow); this checks the
store the stage opens, without a compile.
"""

from __future__ import annotations

from pathlib import Path

from adstore.integration.engine.stage import EngineStage
from adstore.store import Store

PREFIX = {"key": "k" * 64, "snapshot": "s" * 64}


def test_a_stage_without_a_root_opens_the_environments_store_with_its_seed(tmp_path, monkeypatch):
    seed = tmp_path / "seed"
    Store.open(seed).close()
    monkeypatch.setenv("ADSTORE_ROOT", str(tmp_path / "store"))
    monkeypatch.setenv("ADSTORE_SEED", str(seed))
    monkeypatch.delenv("ADSTORE_REMOTE", raising=False)
    stage = EngineStage(prefix=PREFIX)
    try:
        store = stage.store()
        assert Path(store.root) == tmp_path / "store"
        assert store.seed is not None
    finally:
        stage.close()


def test_a_stage_with_a_root_opens_that_root(tmp_path, monkeypatch):
    monkeypatch.setenv("ADSTORE_ROOT", str(tmp_path / "elsewhere"))
    stage = EngineStage(root=str(tmp_path / "store"), prefix=PREFIX)
    try:
        assert Path(stage.store().root) == tmp_path / "store"
    finally:
        stage.close()
