"""One simulated fleet host: ``python fleet_host.py ENV_JSON`` compiles the hosts' model and prints a JSON result.

Run as its own process so the caller can put it in a mount namespace (another
``/proc/cpuinfo``) or start it through another path of the venv.  Compiler
runs are counted by an audit hook installed first thing: every
``subprocess.Popen``, ``os.posix_spawn`` or ``os.exec*`` whose arguments hold
``-o TARGET`` and no ``-E`` (a compile or link, not the preprocessing Inductor
runs in every process) is one run.  ``TORCHINDUCTOR_COMPILE_THREADS=1`` (in
:func:`inductor_hosts.host_env`) keeps them in this process.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

RUNS: list[str] = []


def _argv(event: str, args: tuple[Any, ...]) -> Any:
    if event == "subprocess.Popen":
        return args[1]
    if event in ("os.posix_spawn", "os.exec"):
        return args[1]
    return None


def _hook(event: str, args: tuple[Any, ...]) -> None:
    argv = _argv(event, args)
    if argv is None or isinstance(argv, str | bytes):
        return
    argv = [os.fsdecode(a) for a in argv]
    if "-o" in argv[:-1] and "-E" not in argv:
        RUNS.append(argv[argv.index("-o") + 1])


sys.addaudithook(_hook)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from inductor_hosts import compile_host

    env = json.loads(sys.argv[1])
    result = compile_host(env, True)
    result["compiler_runs"] = list(RUNS)
    from adstore.store import Store

    with Store.open(env["ADSTORE_ROOT"]) as store:  # after disable(): what it counted at the end too
        result["counters"] = dict(store.stats().counters)
    result["prefix"] = sys.prefix
    result["torch"] = sys.modules["torch"].__file__
    print("RESULT " + json.dumps(result, default=str))


if __name__ == "__main__":
    main()
