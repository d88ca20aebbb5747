"""Near-identical hosts share plain ``torch.compile``'s entries, and a host that still compiles says why.

Host A compiles the small model once (a fresh process with its own store,
Inductor directory and ``TMPDIR``); each test starts another host on a copy
of A's store and counts its compiler runs (:mod:`fleet_host`'s audit hook):

* C: ``/proc/cpuinfo`` without ``hypervisor``/``tsc_known_freq`` and with
  another model string (bare metal against a VM), through a mount namespace:
  no compiler run;
* A again, on its own directories: Inductor's local hit, counted as such;
* F: the interpreter (and its venv) bind-mounted at another path, so torch's
  and Python's directories differ: kernels are named relative to those roots
  (:mod:`adstore.integration.validity.roots`), so no compiler run and no word;
* G: the same, with Inductor's caches off: kernels are built, and the precompiled
  header, whose bytes hold the path, is built too and one log line names the path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from inductor_hosts import host_env, moved_interpreter

pytest.importorskip("torch")

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
VOLATILE = ("hypervisor", "tsc_known_freq", "arch_capabilities")


def run_host(env: dict[str, str], *, python: str = sys.executable, prefix: list[str] | None = None) -> dict:
    cmd = [*(prefix or []), python, str(HERE / "fleet_host.py"), json.dumps(env)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def store_copy(base: Path, source: Path, name: str) -> dict[str, str]:
    shutil.copytree(source, base / name / "store")
    return host_env(base, name, base / name / "store")


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    base = tmp_path_factory.mktemp("fleet")
    a = run_host(host_env(base, "a"))
    assert a["enabled"] and a["compiler_runs"] and a["inductor"].get("fxgraph_cache_miss") == 1, a
    return base, a


def _namespace() -> list[str]:
    unshare = shutil.which("unshare")
    ok = unshare is not None and os.geteuid() == 0
    if ok:
        ok = subprocess.run([unshare, "-m", "--propagation", "private", "true"], check=False).returncode == 0
    if not ok:
        pytest.skip("needs root and mount namespaces (unshare -m)")
    return [str(unshare), "-m", "--propagation", "private"]


def test_a_host_whose_cpuinfo_lacks_hypervisor_runs_no_compiler(seed, tmp_path):
    base, a = seed
    cpuinfo = tmp_path / "cpuinfo"
    lines = []
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, sep, value = line.partition(":")
        if key.strip() == "flags":
            line = f"{key}{sep} " + " ".join(f for f in value.split() if f not in VOLATILE)
        elif key.strip() == "model name":
            line = f"{key}{sep} Another CPU @ 2.10GHz"
        lines.append(line)
    cpuinfo.write_text("\n".join(lines) + "\n")
    mount = ["sh", "-c", f'mount --bind "{cpuinfo}" /proc/cpuinfo && exec "$@"', "sh"]
    c = run_host(store_copy(base, base / "a" / "store", "c"), prefix=[*_namespace(), *mount])
    assert c["compiler_runs"] == [], c["compiler_runs"]
    assert c["inductor"].get("fxgraph_cache_hit") == 1 and c["output"] == a["output"], c
    assert c["counters"].get("inductor.hits.inductor_fx_graph") == 1
    assert c["counters"].get("ms_saved", 0) > 0  # A's compile time, recorded with its entry


def test_a_restart_that_inductor_serves_from_its_own_directory_is_counted(seed):
    base, _ = seed
    again = run_host(host_env(base, "a"))  # A's own Inductor directory and store
    assert again["compiler_runs"] == [] and again["inductor"].get("fxgraph_cache_hit") == 1
    assert again["counters"].get("inductor.local_hits") == 1
    assert again["counters"].get("inductor.hits.inductor_fx_graph", 0) == 0  # adstore was never asked


def _moved(tmp_path: Path) -> tuple[list[str], str]:
    moved = moved_interpreter(tmp_path / "moved")
    if moved is None:
        pytest.skip("needs root and mount namespaces (unshare -m)")
    return moved


def test_the_interpreter_at_another_path_runs_no_compiler(seed, tmp_path):
    base, a = seed
    prefix, python = _moved(tmp_path)
    f = run_host(store_copy(base, base / "a" / "store", "f"), python=python, prefix=prefix)
    assert f["torch"].startswith(str(tmp_path / "moved")), f["torch"]  # torch's headers are elsewhere
    assert f["compiler_runs"] == [], f["compiler_runs"]
    assert f["inductor"].get("fxgraph_cache_hit") == 1 and f["output"] == a["output"], f
    assert f["counters"].get("inductor.hits.inductor_fx_graph") == 1
    assert not [w for w in f["warnings"] if "install path" in w], f["warnings"]
    assert f["store"].get("inductor.install_path_differs", 0) == 0


def test_a_kernel_built_at_another_path_names_the_path_its_header_holds(seed, tmp_path):
    """No Inductor cache: the kernels are built, and the precompiled header, whose bytes hold the path, too."""
    base, a = seed
    prefix, python = _moved(tmp_path)
    env = {**store_copy(base, base / "a" / "store", "g"), "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    g = run_host(env, python=python, prefix=prefix)
    assert g["output"] == a["output"]
    assert any(r.endswith(".gch") for r in g["compiler_runs"]), g["compiler_runs"]  # its own header
    (line,) = [w for w in g["warnings"] if "install path" in w]
    assert f"(builder) vs {tmp_path / 'moved'}/" in line and line.count("torch: ") == 1, line
    assert g["store"].get("inductor.install_path_differs", 0) >= 1
