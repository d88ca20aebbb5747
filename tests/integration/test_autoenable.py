"""``ADSTORE_ENABLE=1`` in real interpreters: what each Python process does at start, without compiling.

The installed ``adstore-enable.pth`` runs in every interpreter; with the
variable on it watches for ``torch._dynamo`` and imports nothing of torch or
the store, in the program and in every process it starts (``multiprocessing``
spawn, forkserver and fork workers, subprocesses); unset or ``0`` it imports
nothing of adstore at all.  The compiles are in
``tests/integration/inductor/test_run_program.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from adstore.daemon.run import BOOTSTRAP, bootstrap_installed

#: What a process reports about itself: adstore's modules it has, and whether torch's compiler is watched.
REPORT = """
import json, sys

def report():
    onimport = sys.modules.get("adstore.integration.onimport")
    return {
        "modules": sorted(m for m in sys.modules if m.startswith("adstore") or m == "lmdb" or m.startswith("torch")),
        "watched": onimport.watched() if onimport is not None else None,
    }
"""


def _python(code: str, env_value: str | None, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ADSTORE_ENABLE"}
    if env_value is not None:
        env["ADSTORE_ENABLE"] = env_value
    env["ADSTORE_ROOT"] = str(tmp_path / "store")
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(REPORT) + textwrap.dedent(code))
    done = subprocess.run([sys.executable, str(prog)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_bootstrap_is_installed_in_this_interpreter():
    assert bootstrap_installed(), f"{BOOTSTRAP} missing from site-packages: reinstall (pip install -e .)"


@pytest.mark.parametrize("value", [None, "0", "off", ""])
def test_off_or_unset_imports_nothing_of_adstore(tmp_path, value):
    got = _python("print(json.dumps(report()))", value, tmp_path)
    assert got == {"modules": [], "watched": None}


@pytest.mark.parametrize("value", ["1", "true", "ON"])
def test_on_watches_torchs_compiler_and_imports_nothing_heavy(tmp_path, value):
    got = _python("print(json.dumps(report()))", value, tmp_path)
    assert got["watched"] == ["torch._dynamo"]
    assert got["modules"] == [
        "adstore",
        "adstore.integration",
        "adstore.integration.autoenable",
        "adstore.integration.onimport",
    ]
    assert not (tmp_path / "store").exists()  # no store is opened before a compile


def test_every_process_the_program_starts_watches_too(tmp_path):
    """spawn and forkserver workers are new interpreters, a subprocess too: each runs the bootstrap itself."""
    code = """
    import multiprocessing, subprocess

    def child(_):
        return report()

    if __name__ == "__main__":
        out = {}
        for method in ("spawn", "forkserver", "fork"):
            with multiprocessing.get_context(method).Pool(1) as pool:
                out[method] = pool.apply(child, (0,))
        sub = subprocess.run([sys.executable, "-c", %r], capture_output=True, text=True, check=True)
        out["subprocess"] = json.loads(sub.stdout)
        print(json.dumps(out))
    """ % (textwrap.dedent(REPORT) + "\nprint(json.dumps(report()))")
    got = _python(code, "1", tmp_path)
    assert set(got) == {"spawn", "forkserver", "fork", "subprocess"}
    for method, report in got.items():
        assert report["watched"] == ["torch._dynamo"], (method, report)
        assert "adstore.store" not in report["modules"] and "lmdb" not in report["modules"], (method, report)


def test_a_program_that_never_compiles_never_imports_adstores_torch_side(tmp_path):
    code = """
    import torch
    y = (torch.ones(3) * 2).sum().item()
    print(json.dumps({**report(), "y": y}))
    """
    got = _python(code, "1", tmp_path)
    assert got["y"] == 6.0 and got["watched"] == ["torch._dynamo"]
    assert "torch._dynamo" not in got["modules"]
    assert not [m for m in got["modules"] if m.startswith(("adstore.integration.inductor", "adstore.store"))]
    assert not (tmp_path / "store").exists()


def test_adstore_run_sets_the_environment_and_passes_the_exit_status(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADSTORE_")}
    code = (
        "import os, sys; print(os.environ['ADSTORE_ENABLE'], os.environ['ADSTORE_ROOT'], "
        "os.environ['ADSTORE_REMOTE'], os.environ['ADSTORE_REMOTE_MODE']); sys.exit(3)"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "adstore",
            "run",
            "--root",
            "rel",
            "--remote",
            "http://127.0.0.1:9/x",
            "--mode",
            "read",
            "--",
            sys.executable,
            "-c",
            code,
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.split() == ["1", str(tmp_path / "rel"), "http://127.0.0.1:9/x", "read"]


@pytest.mark.parametrize(
    ("argv", "message"), [([], "give the program to run"), (["--", "no-such-cmd-x"], "command not found")]
)
def test_adstore_run_without_a_program_is_a_one_line_error(argv, message):
    done = subprocess.run([sys.executable, "-m", "adstore", "run", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
