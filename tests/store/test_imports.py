"""What importing the store costs: a name's module loads when the name is first used.

A warm restart opens a store and reads one entry.  It must not pay for the
maintenance passes, the index rebuild or the remote tier (``http.client``,
``ssl``, the S3 and HTTP backends), nor, for a bare ``import adstore.store``,
for LMDB, zstandard or psutil.  Each check runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import adstore.store
import adstore.store.remote

#: Never loaded by a process that opens a store without a remote and reads from it.
UNUSED_WITHOUT_REMOTE = (
    "adstore.store.tiered",
    "adstore.store.remote.client",
    "adstore.store.remote.httpcache",
    "adstore.store.remote.s3",
    "adstore.store.maintenance.eviction",
    "adstore.store.maintenance.sweep",
    "adstore.store.maintenance.verify",
    "adstore.store.maintenance.repair",
    "adstore.store.records.rebuild",
)


def _loaded(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_import_adstore_store_loads_only_names_and_errors() -> None:
    loaded = _loaded("import adstore.store")
    ours = {m for m in loaded if m.startswith("adstore.")}
    assert ours == {f"adstore.store.{m}" for m in ("clock", "errors", "lazy", "names", "reasons")} | {"adstore.store"}
    assert not loaded & {"lmdb", "zstandard", "psutil", "xxhash", "http.client"}


def test_a_warm_read_without_a_remote_loads_no_remote_tier_and_no_maintenance(tmp_path) -> None:
    root = tmp_path / "s"
    with adstore.store.Store.open(root) as store:
        ref = store.put_bytes(b"x" * 100_000)
        gen = store.new_generation()
        store.publish("k", rank=0, world_size=1, generation=gen, artifacts={"a": ref}, components={})
        store.commit("k", rank=0, generation=gen)
    loaded = _loaded(
        "from adstore.store import Store\n"
        f"s = Store.open({str(root)!r})\n"
        "r = s.lookup('k')\n"
        "assert r.hit and s.read_artifact(r.manifest, 'a') == b'x' * 100_000\n"
    )
    assert not loaded & set(UNUSED_WITHOUT_REMOTE), sorted(loaded & set(UNUSED_WITHOUT_REMOTE))


@pytest.mark.parametrize("package", [adstore.store, adstore.store.remote])
def test_every_public_name_resolves_and_an_unknown_one_is_an_attribute_error(package) -> None:
    lazy = {name for names in package._LAZY.values() for name in names}
    assert lazy <= set(package.__all__) and "lazy_exports" not in lazy
    for name in package.__all__:
        assert getattr(package, name) is not None, name
        assert name in dir(package)
    with pytest.raises(AttributeError, match="no_such_name"):
        package.no_such_name  # noqa: B018
