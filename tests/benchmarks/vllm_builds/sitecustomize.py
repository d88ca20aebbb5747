"""Counts the C++ compiles of every process of a vLLM run: on ``PYTHONPATH``, it runs in each one at start.

vLLM compiles in its worker process (spawned by the EngineCore, itself
spawned by the caller), and Inductor may compile in its own worker processes
too; none of them can be patched from the caller.  Every Python process
imports ``sitecustomize`` at start, so this one adds an audit hook there:
each ``subprocess.Popen`` whose arguments carry ``-o TARGET`` (how Inductor's
``CppBuilder`` runs the compiler) appends ``pid TARGET`` to the file named by
``ADSTORE_BUILDS_LOG``.  The hook sees one event name per audited call and
returns at once for the others; nothing is imported.
"""

import os
import sys

_LOG = os.environ.get("ADSTORE_BUILDS_LOG")


def _hook(event, args):
    if event != "subprocess.Popen":
        return
    argv = args[1]
    if isinstance(argv, str | bytes) or argv is None:
        return
    argv = [os.fsdecode(a) for a in argv]
    if "-o" not in argv[:-1]:
        return
    with open(_LOG, "a") as out:
        out.write(f"{os.getpid()} {argv[argv.index('-o') + 1]}\n")


if _LOG:
    sys.addaudithook(_hook)
