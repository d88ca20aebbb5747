"""The CLI reads entries too: ``adstore inspect`` and ``explain`` of a poisoned entry run nothing.

A snapshot pickle that calls ``os.system`` and hooks naming it are reported,
not run; a components row nested 100 000 deep is a clean error, not an
internal one.
"""

from __future__ import annotations

import json

from poison_support import publish, run_cli, sentinel_fixture  # noqa: F401  (the sentinel fixture)

from adstore.store import Store


def test_adstore_inspect_of_a_poisoned_snapshot_runs_nothing(tmp_path, sentinel):
    root = tmp_path / "store"
    hooks = json.dumps(
        [
            {
                "type": "importable",
                "scope": "",
                "phase": "pre",
                "with_module": False,
                "params": {"kind": "function", "qualname": "os.system"},
            }
        ]
    ).encode()
    evil = b"cos\nsystem\n(Vtouch " + str(sentinel).encode() + b"\ntR."
    publish(root, "evil", {"module.pt": evil, "hooks.json": hooks})
    out = run_cli(root, "inspect", "evil")
    assert out.returncode == 0 and "Traceback" not in out.stderr, (out.returncode, out.stderr)
    assert "os.system" in out.stdout and "outside the allowed prefixes" in out.stdout, out.stdout
    assert not sentinel.exists()


def test_adstore_explain_of_a_poisoned_components_row_is_a_clean_error(tmp_path):
    root = tmp_path / "store"
    publish(root, "evil", {"module.pt": b"x", "hooks.json": b"[]"})
    with Store.open(root) as store:
        with store.index.env.begin(write=True) as txn:
            txn.put(
                b"evil", ('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}").encode(), db=store.index.db["components"]
            )
    for args in (("explain", "evil"), ("inspect", "--no-summary", "evil")):
        out = run_cli(root, *args)
        assert out.returncode not in (0, 70), (args, out.returncode, out.stderr)  # 9: damaged store
        assert "internal error" not in out.stderr, (args, out.stderr)
