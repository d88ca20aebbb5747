"""``adstore explain A B``: the environment difference between two entries on its own line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adstore.daemon.cli import main
from adstore.daemon.explain import ENV_COMPONENTS
from adstore.store import Store

TOOLCHAIN = {"torch": "2.13.0+cpu", "cpu": {"capability": "AVX512", "flags": "9e8f"}, "gpus": []}


def publish(root: Path, key: str, components: dict) -> None:
    with Store.open(root) as store:
        ref = store.put_bytes(key.encode())
        gen = store.new_generation()
        store.publish(key, generation=gen, artifacts={"engine.json": ref}, namespace="engine", components=components)
        store.commit(key, generation=gen)


def explain(capsys: pytest.CaptureFixture[str], root: Path, *argv: str) -> str:
    assert main(["--root", str(root), "explain", *argv]) == 0
    return capsys.readouterr().out


def test_explain_names_the_environment_fields_that_differ(capsys, tmp_path: Path) -> None:
    avx2 = {**TOOLCHAIN, "cpu": {**TOOLCHAIN["cpu"], "capability": "AVX2"}}
    publish(tmp_path, "a" * 64, {"graph": "g1", "toolchain": TOOLCHAIN})
    publish(tmp_path, "b" * 64, {"graph": "g1", "toolchain": avx2})
    publish(tmp_path, "c" * 64, {"graph": "g2", "toolchain": TOOLCHAIN})
    publish(tmp_path, "d" * 64, {"model": "m"})
    out = explain(capsys, tmp_path, "aaaa", "bbbb")
    assert "environment: built in different environments: toolchain.cpu.capability" in out
    assert 'toolchain.cpu.capability: A="AVX512"  B="AVX2"' in out
    data = json.loads(explain(capsys, tmp_path, "--json", "aaaa", "bbbb"))
    assert data["environment"] == {
        "recorded": True,
        "same": False,
        "differences": [{"path": "toolchain.cpu.capability", "a": "AVX512", "b": "AVX2"}],
    }
    assert "environment: same" in explain(capsys, tmp_path, "aaaa", "cccc")  # another graph, same environment
    assert "environment:" not in explain(capsys, tmp_path, "dddd", "dddd")  # none recorded
    data = json.loads(explain(capsys, tmp_path, "--json", "aaaa", "dddd"))
    assert data["environment"]["differences"] == [{"path": "toolchain", "a": TOOLCHAIN, "b": "<absent>"}]


def test_the_daemon_knows_the_integration_environment_components() -> None:
    """The daemon does not import torch; the names it shows are the integration's."""
    from adstore.integration.validity.envcheck import ENV_COMPONENTS as INTEGRATION

    assert ENV_COMPONENTS == INTEGRATION
