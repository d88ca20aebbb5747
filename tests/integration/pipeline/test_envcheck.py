"""Environment checks of the pipeline cache (docs/pipeline-cache.md, "Environment checks").

An entry is built in this process, then looked up from fresh interpreters
(``env_child.py``) whose environment differs: a torch version simulated with
``ADSTORE_ENV_OVERRIDES``, a really different installed ``transformers``
(a distribution earlier on ``PYTHONPATH``), and only volatile facts (host
name in a UTS namespace when the kernel allows one, working directory, pid).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import env_child
import pytest
import torch

from adstore.integration import cached_prefix, environment_fingerprint
from adstore.integration.errors import CacheKeyError
from adstore.integration.validity.envcheck import OVERRIDES_VAR, apply_overrides, env_differences, find_mismatch
from adstore.store import Store

HERE = Path(__file__).parent


def kinds(events: list[dict]) -> list[tuple[str, str | None]]:
    return [(e["kind"], e["reason"]) for e in events]


def run_child(
    root: Path, out: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None, prefix: tuple[str, ...] = ()
) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != OVERRIDES_VAR}
    subprocess.run(
        [*prefix, sys.executable, str(HERE / "env_child.py"), str(root), str(out)],
        env={**environ, **(env or {})},
        cwd=cwd,
        check=True,
        timeout=300,
    )
    return json.loads(out.read_text())


@pytest.fixture
def built(tmp_path, monkeypatch) -> tuple[Path, str]:
    """The entry, built in this (unsimulated) process."""
    monkeypatch.delenv(OVERRIDES_VAR, raising=False)
    root = tmp_path / "store"
    result = cached_prefix(env_child.KEY, env_child.build, root=root)
    assert [(e.kind, e.reason) for e in result.events] == [("miss", "absent"), ("save", None)]
    return root, result.key


def test_another_torch_is_a_miss_naming_the_field_and_explain_shows_it(built, tmp_path):
    root, key = built
    child = run_child(root, tmp_path / "torch.json", env={OVERRIDES_VAR: json.dumps({"env.torch": "2.99.0"})})
    assert kinds(child["events"]) == [("miss", "incompatible_env"), ("save", None)]
    detail = child["events"][0]["detail"]
    assert detail.split(": ", 1)[1].startswith("env.torch"), detail
    assert json.dumps(torch.__version__) in detail and '"2.99.0"' in detail and key[:16] in detail
    assert child["key"] != key
    again = cached_prefix(env_child.KEY, env_child.build, root=root)  # this process: its own entry, untouched
    assert again.hit and again.key == key

    cli = [sys.executable, "-m", "adstore.daemon", "--root", str(root)]
    text = subprocess.run(
        [*cli, "explain", key[:12], child["key"][:12]], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    line = next(ln for ln in text.splitlines() if ln.startswith("environment:"))
    assert "built in different environments" in line and "env.torch" in line, text
    assert f'env.torch: A={json.dumps(torch.__version__)}  B="2.99.0"' in text
    data = json.loads(
        subprocess.run(
            [*cli, "--json", "explain", key, child["key"]], capture_output=True, text=True, check=True, timeout=120
        ).stdout
    )
    assert data["differing"] == ["env"] and not data["environment"]["same"]
    assert {"path": "env.torch", "a": torch.__version__, "b": "2.99.0"} in data["environment"]["differences"]
    same = json.loads(
        subprocess.run(
            [*cli, "--json", "explain", key, key], capture_output=True, text=True, check=True, timeout=120
        ).stdout
    )
    assert same["environment"] == {"recorded": True, "same": True, "differences": []}


def test_another_installed_transformers_is_a_miss_naming_the_field(built, tmp_path):
    """A real difference: the child's ``importlib.metadata`` finds another transformers first."""
    root, _key = built
    site = tmp_path / "site"
    dist = site / "transformers-0.0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 0.0.1\n")
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    child = run_child(root, tmp_path / "tf.json", env={"PYTHONPATH": pythonpath})
    assert kinds(child["events"]) == [("miss", "incompatible_env"), ("save", None)]
    assert "env.transformers" in child["events"][0]["detail"] and '"0.0.1"' in child["events"][0]["detail"]


def test_volatile_facts_do_not_enter_the_key(built, tmp_path):
    """Another pid and working directory, and another host name when user namespaces allow: a hit."""
    root, key = built
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
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    child = run_child(root, tmp_path / "volatile.json", cwd=elsewhere, prefix=prefix)
    assert kinds(child["events"]) == [("hit", None)] and child["key"] == key
    assert child["cwd"] == str(elsewhere) and child["pid"] != os.getpid()
    if prefix:
        assert child["host"] == "other-host"
    env = environment_fingerprint()
    assert set(env) <= {"adstore_format", "torch", "torch_git", "python", "python_abi", "code", "transformers"}


def test_a_simulated_environment_never_shares_a_key_with_a_real_one(built, monkeypatch):
    """Overriding a field with its own value still marks the key: a simulating process
    neither loads a real host's entry nor writes one a real host would load."""
    root, key = built
    monkeypatch.setenv(OVERRIDES_VAR, json.dumps({"env.torch": torch.__version__}))
    result = cached_prefix(env_child.KEY, env_child.build, root=root, save=False)
    assert [(e.kind, e.reason) for e in result.events] == [("miss", "incompatible_env"), ("bypass", "save_disabled")]
    assert result.key != key and "env.simulated" in result.events[0].detail
    monkeypatch.setenv(OVERRIDES_VAR, "{not json")
    broken = cached_prefix(env_child.KEY, env_child.build, root=root)  # fail open
    assert [(e.kind, e.reason) for e in broken.events] == [("miss", "key_error"), ("bypass", "key_error")]
    with Store.open(root) as store:
        assert [e.key for e in store.entries()] == [key]


def test_overrides_name_existing_fields_only():
    record = {"torch": "2.0", "cpu": {"capability": "AVX2"}}
    out = apply_overrides(record, "toolchain", {OVERRIDES_VAR: '{"toolchain.cpu.capability": "DEFAULT"}'})
    assert out == {"torch": "2.0", "cpu": {"capability": "DEFAULT"}, "simulated": ["toolchain.cpu.capability"]}
    assert record["cpu"]["capability"] == "AVX2"  # the observed record is not changed
    assert apply_overrides(record, "env", {OVERRIDES_VAR: '{"toolchain.torch": "3"}'}) == record
    for bad in ('{"toolchain.cpu.capabilty": "X"}', '{"hostname": "x"}', '["env.torch"]', "{"):
        with pytest.raises(CacheKeyError):
            apply_overrides(record, "toolchain", {OVERRIDES_VAR: bad})


def test_a_mismatch_needs_the_same_request_and_another_environment():
    here = {"model": "m", "env": {"torch": "2.1", "code": {"T": "aa"}}, "settings": {"opt": 1, "derived": "x"}}
    moved = {**here, "env": {"torch": "2.0", "code": {"T": "aa"}}, "settings": {"opt": 1, "derived": "y"}}
    edited = {**here, "env": {"torch": "2.0", "code": {"T": "bb"}}}
    other = {**here, "model": "n", "env": {"torch": "2.0", "code": {"T": "aa"}}}
    opts = {"env": ("env",), "request": ("env.code",), "derived": ("settings.derived",)}
    found = find_mismatch([("k-other", other), ("k-edited", edited), ("k-moved", moved)], here, **opts)
    assert found is not None and found.key == "k-moved" and found.fields == ["env.torch"]
    assert found.error().reason == "incompatible_env" and found.error().fields == ["env.torch"]
    assert find_mismatch([("k-same", here)], here, **opts) is None  # same environment: not this miss
    assert find_mismatch([("k-edited", edited)], here, **opts) is None  # edited code is another request
    diffs = env_differences({"env": {"torch": "1", "simulated": ["env.torch"]}}, {"env": {"torch": "2"}})
    assert [d.field for d in diffs] == ["env.torch", "env.simulated"]  # a real field is named first
