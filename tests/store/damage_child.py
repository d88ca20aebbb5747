"""One damage case in a child process (``python damage_child.py ROOT EXPECTED_JSON``).

Runs what a pipeline and an operator would run on a damaged store, in this
order, printing one JSON line per step *before* and after it (flushed), so a
parent that sees this process die by a signal knows which step it was:

1. ``read``: open the store, look up every expected key, read every artifact
   of a hit (a lookup must never raise; reads may raise the store's errors);
2. the CLI's ``stats``, ``verify`` and ``verify --fix`` (in this process,
   through ``adstore.daemon.cli.main``; their exit codes);
3. ``after``: the store must open, and every lookup is a clean miss or a hit
   whose bytes hash to what was saved; then ``verify`` and ``gc --max-size 1M``.

A raw ``lmdb`` exception anywhere is reported as such, never swallowed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys
import traceback


def _emit(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _classify(exc: BaseException) -> str:
    import lmdb

    from adstore.store import AdstoreError

    if isinstance(exc, lmdb.Error):
        return f"raw_lmdb:{type(exc).__name__}"
    if isinstance(exc, AdstoreError):
        return f"store:{exc.reason}"
    return f"internal:{type(exc).__name__}"


def _read(root: str, expected: dict[str, dict[str, str]]) -> dict[str, object]:
    from adstore.store import AdstoreError, Store

    out: dict[str, object] = {"hits": 0, "misses": {}, "wrong_bytes": 0, "read_errors": {}, "lookup_raised": 0}
    try:
        store = Store.open(root, create=False, grace_period=0.0)
    except Exception as exc:  # noqa: BLE001  (classified, not swallowed)
        out["open_error"] = _classify(exc)
        return out
    with store:
        for key, artifacts in expected.items():
            try:
                res = store.lookup(key, count=False)
            except Exception as exc:  # noqa: BLE001
                out["lookup_raised"] += 1  # type: ignore[operator]
                out["read_errors"][_classify(exc)] = out["read_errors"].get(_classify(exc), 0) + 1  # type: ignore
                continue
            if not res.hit:
                out["misses"][str(res.reason)] = out["misses"].get(str(res.reason), 0) + 1  # type: ignore
                continue
            try:
                got = {
                    name: hashlib.sha256(store.read_artifact(res.manifest, name)).hexdigest()
                    for name in res.manifest.artifacts
                }
            except AdstoreError as exc:
                out["read_errors"][_classify(exc)] = out["read_errors"].get(_classify(exc), 0) + 1  # type: ignore
                continue
            except Exception as exc:  # noqa: BLE001
                out["read_errors"][_classify(exc)] = out["read_errors"].get(_classify(exc), 0) + 1  # type: ignore
                continue
            if got != artifacts:
                out["wrong_bytes"] += 1  # type: ignore[operator]
            else:
                out["hits"] += 1  # type: ignore[operator]
    return out


def _cli(*argv: str) -> dict[str, object]:
    from adstore.daemon.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(list(argv))
        except Exception as exc:  # noqa: BLE001  (main maps errors itself: this is a bug)
            return {"exit": 70, "stderr": f"escaped {_classify(exc)}"}
    lines = [line for line in err.getvalue().splitlines() if "WARNING" not in line]
    return {"exit": code, "stderr": "\n".join(lines)[-400:]}


def main(root: str, expected_json: str) -> int:
    expected = json.loads(expected_json)
    steps = (
        ("read", lambda: _read(root, expected)),
        ("stats", lambda: _cli("stats", "--root", root)),
        ("verify", lambda: _cli("verify", "--root", root)),
        ("fix", lambda: _cli("verify", "--fix", "--root", root)),
        ("after", lambda: _read(root, expected)),
        ("verify_after", lambda: _cli("verify", "--root", root)),
        ("gc", lambda: _cli("gc", "--root", root, "--max-size", "1M", "--grace-period", "0")),
    )
    for name, step in steps:
        _emit(step=name, phase="start")
        try:
            result = step()
        except Exception as exc:  # noqa: BLE001
            result = {"escaped": _classify(exc), "trace": traceback.format_exc()[-600:]}
        _emit(step=name, phase="done", **result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
