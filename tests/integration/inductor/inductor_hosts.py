"""Simulated hosts of the Inductor-cache tests: each compiles in a fresh spawned process with its own directories.

A host is a store root, an Inductor cache directory and a ``TMPDIR`` (where
the precompiled header lives) of its own; test modules run :func:`compile_host`
through :func:`on_host` and compare what each host compiled and computed.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["host_env", "on_host", "count_builds", "count_probes", "compile_host"]


def host_env(base: Path, name: str, root: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of host ``name`` under ``base``: store root, Inductor cache directory, TMPDIR."""
    home = base / name
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return {
        "ADSTORE_ROOT": str(root if root is not None else home / "store"),
        "TORCHINDUCTOR_CACHE_DIR": str(home / "inductor"),
        "TMPDIR": str(home / "tmp"),
        "TORCHINDUCTOR_COMPILE_THREADS": "1",  # kernels build in the host's process, where they are counted
        **extra,
    }


def on_host(fn: Any, *args: Any) -> Any:
    """Run ``fn(*args)`` in a fresh spawned process (another "host")."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, args)


def count_builds() -> list[str]:
    """From now on, the target of every ``CppBuilder.build`` of this process, in a list this returns.

    Every C++ compile Inductor runs goes through it: kernels (``.so``), ISA
    probes, the precompiled header (``.gch``) and the header's ``g++ -E``
    (``.i``, run in every process).  Builds in compile workers are not seen:
    a host counts with ``TORCHINDUCTOR_COMPILE_THREADS=1`` (:func:`host_env`).
    """
    from torch._inductor import cpp_builder

    builds: list[str] = []
    build = cpp_builder.CppBuilder.build

    def counted(self: Any) -> Any:
        builds.append(self.get_target_file_path())
        return build(self)

    cpp_builder.CppBuilder.build = counted  # type: ignore[method-assign]
    return builds


def count_probes() -> list[str]:
    """From now on, every ISA probe this process loads in a subprocess (``VecISA._probe_load``), in a list."""
    from torch._inductor.cpu_vec_isa import VecISA

    probes: list[str] = []
    probe = VecISA._probe_load

    def counted(self: Any, output_path: str) -> bool:
        probes.append(output_path)
        return probe(self, output_path)

    VecISA._probe_load = counted  # type: ignore[method-assign]
    return probes


def _counters_at_exit() -> dict[str, int]:
    """The store's ``inductor.*`` and ``remote.*`` counters once the process let go of it (``adstore stats``)."""
    from adstore.store import Store

    with Store.open(os.environ["ADSTORE_ROOT"]) as store:
        return {k: v for k, v in store.stats().counters.items() if k.startswith(("inductor.", "remote."))}


def compile_host(env: dict[str, str], enable: bool = True, inline_threshold: int | None = None) -> dict[str, Any]:
    """``torch.compile`` a small model under ``env`` (with adstore enabled unless ``enable=False``).

    Returns a digest of the output, Inductor's cache counters, how many C++
    builds ran (kernels, ISA probes and precompiled headers: every
    ``CppBuilder.build`` of the process), how many ISA probes ran in a
    subprocess, the fail-open reasons and the store's
    ``inductor.*`` and ``remote.*`` counters (before the exit-time save, and
    ``store_at_exit`` after it), and adstore's warnings.
    """
    os.environ.update(env)
    import tempfile

    tempfile.tempdir = None  # TMPDIR is read again
    t0 = time.perf_counter()
    import torch
    from torch._dynamo.utils import counters

    builds = count_builds()
    probes = count_probes()

    import logging

    from adstore.integration import inductor

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("adstore").addHandler(handler)

    store = None
    if enable and inline_threshold is not None:  # kernels as blob files (they are inline otherwise)
        from adstore.store import Store

        store = Store.from_env(inline_threshold=inline_threshold)
    enabled = inductor.enable(store) if enable else False
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        out = torch.compile(m)(x)
    seconds = time.perf_counter() - t0
    store_counters: dict[str, int] = {}
    entries = inductor.active()
    if entries is not None:
        entries.store.flush()
        store_counters = {
            k: v for k, v in entries.store.stats().counters.items() if k.startswith(("inductor.", "remote."))
        }
    inductor.disable()  # what the process does at exit: keep what it built (the toolchain save), close the store
    if store is not None:
        store.close()
    return {
        "enabled": enabled,
        "output": hashlib.sha256(out.contiguous().numpy().tobytes()).hexdigest(),
        "inductor": dict(counters["inductor"]),
        "aot_autograd": dict(counters["aot_autograd"]),
        "builds": [b for b in builds if not b.endswith(".i")],
        # the header's g++ -E: in every process that loads a kernel without adstore, in one that builds one with it
        "preprocessed": len([b for b in builds if b.endswith(".i")]),
        "probes": len(probes),  # ISA probe subprocesses
        "failopen": dict(inductor.FAILOPEN),
        "store": store_counters,
        "store_at_exit": _counters_at_exit() if enabled else {},
        "seconds": seconds,
        "warnings": warnings,
    }
