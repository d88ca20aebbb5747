"""The reader of ``test_read_only.py``: runs inside a mount namespace where the store is a read-only bind mount.

``python read_only_child.py SPEC_JSON``; SPEC: ``{"ro": path, "keys": {key: {artifact: sha256}}, "uid": int|null,
"writable": path|null, "cli": bool}``.  Started as the reading user (``setpriv``), or, without mount
namespaces, imports as root and then drops to ``uid``; reads, tries every write, and prints one JSON report.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

from adstore.daemon.cli import main
from adstore.store import Store, StoreError


def _drop(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _error(fn: Any) -> str | None:
    try:
        fn()
    except StoreError as exc:
        return f"{type(exc).__name__}:{exc.reason}"
    return None


def _cli(root: str, *argv: str) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["--root", root, *argv])
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}


def _reads(store: Store, keys: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Every key's lookup, and whether each artifact's verified bytes hash to what the builder stored."""
    found: dict[str, Any] = {}
    for key, artifacts in keys.items():
        result = store.lookup(key)
        got = {}
        if result.hit and result.manifest is not None:
            got = {n: hashlib.sha256(store.read_artifact(result.manifest, n)).hexdigest() for n in artifacts}
        found[key] = {"hit": result.hit, "reason": result.reason, "intact": got == artifacts}
    return found


def main_(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("uid") is not None:
        _drop(spec["uid"])
    report: dict[str, Any] = {"uid": os.geteuid()}
    ro, keys = spec["ro"], spec["keys"]
    if spec.get("writable"):
        os.environ["ADSTORE_ROOT"] = spec["writable"]
        os.environ["ADSTORE_SEED"] = ro
        with Store.from_env() as store:
            report["seeded"] = _reads(store, keys)
            report["seed_meta"] = {k: store.lookup(k).manifest.meta.get("seed") for k in keys}  # type: ignore[union-attr]
            ref = store.put_bytes(b"built on this host")
            store.save("new-key", {"x": ref}, namespace="here")
            report["new_in_writable"] = store.lookup("new-key").hit
            assert store.seed is not None
            report["new_in_seed"] = str(store.seed.store.lookup("new-key").reason)
            report["counters"] = store.stats().counters
        return report
    with Store.open(ro, create=False) as store:
        report["read_only"] = store.read_only
        report["lockless"] = store.index.lockless
        report["reads"] = _reads(store, keys)
        report["again"] = _reads(store, keys)  # the memoized path
        key = next(iter(keys))
        report["writes"] = {
            "put_bytes": _error(lambda: store.put_bytes(b"new bytes")),
            "save": _error(lambda: store.save("other", {})),
            "pin": _error(lambda: store.pin(key)),
            "gc": _error(lambda: store.plan_remove([key]).execute()),
            "verify_fix": _error(lambda: store.verify(fix=True)),
        }
        report["verify_ok"] = store.verify().ok
        report["hits_in_memory"] = store.stats().counters.get("hits", 0)
    if spec.get("cli"):
        short = next(iter(keys))[:12]
        report["cli"] = {
            name: _cli(ro, *argv)
            for name, argv in {
                "ls": ["ls"],
                "stats": ["stats"],
                "inspect": ["inspect", short],
                "explain": ["explain", short],
                "verify": ["verify"],
                "verify_fix": ["verify", "--fix"],
                "gc": ["gc"],
                "rm": ["rm", short],
                "pin": ["pin", short],
                "ls_json": ["--json", "ls"],
            }.items()
        }
    report["files_after"] = sorted(str(p.relative_to(ro)) for p in Path(ro).rglob("*"))
    return report


if __name__ == "__main__":
    print(json.dumps(main_(json.loads(sys.argv[1]))))
